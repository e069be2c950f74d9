"""Micro-benchmarks of the engine: cache get/put latency, and a no-op doit run over 1500 phase
tasks. Writes JSON (default benchmarks/results/engine.json) and prints a table.

    python benchmarks/engine_micro.py [--out PATH]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

DODO = '''
from pathlib import Path
from ipubuild.engine import phase
from ipubuild.build.pipeline import Step, Workspace
from ipubuild.tasks import step_task

@phase("bench_toy", inputs=("src",), outputs=("out",))
def bench_toy(ctx):
    return {"out": ctx.bytes("src")[:16]}

def task_toy():
    ws = Workspace.at(Path(__file__).parent)
    for i in range(1500):
        yield step_task(ws, Step("toy", str(i), "bench_toy", sources={"src": Path(__file__).parent / "src" / f"{i % 50}.txt"},
                                 outputs={"out": f"toy/{i}"}))

DOIT_CONFIG = {"backend": "sqlite3", "dep_file": str(Path(__file__).parent / ".doit.db"), "verbosity": 0}
'''


def cache_latency(n: int = 2000) -> dict:
    from ipubuild.engine.store import Store
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        store = Store(Path(tmp))
        for label, size in (("1KiB", 1024), ("64KiB", 65536), ("1MiB", 1 << 20)):
            count = n if size <= 65536 else 100
            blobs = [os.urandom(size) for _ in range(count)]
            t0 = time.perf_counter()
            keys = [store.put(b) for b in blobs]
            t1 = time.perf_counter()
            for k in keys:
                assert store.get(k) is not None
            t2 = time.perf_counter()
            out[label] = {"put_us": round((t1 - t0) / count * 1e6, 1), "get_us": round((t2 - t1) / count * 1e6, 1),
                          "count": count}
        t0 = time.perf_counter()
        for i in range(n):
            store.put_action(f"{i:064x}", {"out": keys[i % len(keys)]})
        t1 = time.perf_counter()
        for i in range(n):
            store.get_action(f"{i:064x}")
        t2 = time.perf_counter()
        out["action_record"] = {"put_us": round((t1 - t0) / n * 1e6, 1), "get_us": round((t2 - t1) / n * 1e6, 1),
                                "count": n}
        store.close()
    return out


def noop_1500(repeats: int = 5) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        (root / "dodo.py").write_text(DODO)
        (root / "src").mkdir()
        for i in range(50):
            (root / "src" / f"{i}.txt").write_text(f"source {i}\n" * 10)
        cmd = [sys.executable, "-m", "doit"]
        t0 = time.perf_counter()
        subprocess.run(cmd, cwd=root, check=True, capture_output=True)
        clean = time.perf_counter() - t0
        samples = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            subprocess.run(cmd, cwd=root, check=True, capture_output=True)
            samples.append(time.perf_counter() - t0)
        return {"tasks": 1500, "clean_s": round(clean, 3), "noop_s": [round(s, 3) for s in samples],
                "noop_median_s": round(statistics.median(samples), 3),
                "noop_over_clean": round(statistics.median(samples) / clean, 3)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="benchmarks/results/engine.json")
    args = ap.parse_args()
    result = {"cache": cache_latency(), "doit_1500_tasks": noop_1500()}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"{'blob':<14}{'put µs':>10}{'get µs':>10}")
    for k, v in result["cache"].items():
        print(f"{k:<14}{v['put_us']:>10}{v['get_us']:>10}")
    d = result["doit_1500_tasks"]
    print(f"doit over 1500 phase tasks: clean {d['clean_s']} s, no-op median of 5 {d['noop_median_s']} s "
          f"(no-op/clean {d['noop_over_clean']})")


if __name__ == "__main__":
    main()
