"""Watch mode against the kernel loop: the first rebuild of ``doit watch build:vit_fp8`` after a
kernel save, timed from the save to the end of that rebuild, beside a plain ``doit build:vit_fp8``
after the same kind of edit, alternated in one scratch tree (``python benchmarks/watch.py``).

Each pair edits the kernel twice (a new function body each time: the kernel-edit build of the
README) — once with watch mode running and once with no watcher — and the ratio is watch ÷
plain per pair; the goal is at most 1.5. Writes ``benchmarks/results/watch.json``.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))
from run import KERNEL, MAIN_TARGET, Bench, make_scratch, median  # noqa: E402

GOAL = 1.5


def _edit(kernel: Path, n: int) -> None:
    with open(kernel, "a") as f:
        f.write(f"\nint ipubuild_watch_probe_{n}(int x) {{ return 5 * x + {n}; }}\n")


def _watched_rebuild(tree: Path, env: dict, kernel: Path, n: int) -> float:
    """Seconds from a kernel save to the end of the rebuild watch mode starts for it."""
    proc = subprocess.Popen([sys.executable, "-u", "-m", "doit", "watch", f"build:{MAIN_TARGET}"], cwd=tree,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    lines: list[str] = []
    ready, rebuilt = threading.Event(), threading.Event()

    def read():
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("watching "):
                (rebuilt if ready.is_set() else ready).set()
    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        if not ready.wait(600):
            raise RuntimeError("watch mode never started watching:\n" + "".join(lines[-20:]))
        time.sleep(0.5)
        saved = time.perf_counter()
        _edit(kernel, n)
        if not rebuilt.wait(600):
            raise RuntimeError("watch mode never rebuilt:\n" + "".join(lines[-20:]))
        elapsed = time.perf_counter() - saved
        if not any("deviceTest=PASS" in ln for ln in lines):
            raise RuntimeError("the watched rebuild did not pass:\n" + "".join(lines[-20:]))
        return elapsed
    finally:
        os.killpg(proc.pid, 2)
        proc.wait(30)


def _plain_rebuild(tree: Path, env: dict, kernel: Path, n: int) -> float:
    _edit(kernel, n)
    t0 = time.perf_counter()
    run = subprocess.run([sys.executable, "-m", "doit", f"build:{MAIN_TARGET}"], cwd=tree, env=env,
                         capture_output=True, text=True)
    elapsed = time.perf_counter() - t0
    if run.returncode != 0:
        raise RuntimeError("the kernel-edit build failed:\n" + run.stdout[-2000:] + run.stderr[-2000:])
    return elapsed


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pairs", type=int, default=3)
    p.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "watch.json"))
    args = p.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="ipubuild-watch-"))
    try:
        tree = make_scratch(REPO, work)
        env = Bench(tree, work, work).env     # the scratch tree's code and cache, a private device lock
        kernel = tree / KERNEL
        first = subprocess.run([sys.executable, "-m", "doit", f"build:{MAIN_TARGET}"], cwd=tree, env=env,
                               capture_output=True, text=True)
        if first.returncode != 0:
            print(first.stdout[-3000:], first.stderr[-3000:])
            return 1
        pairs = []
        for i in range(args.pairs):
            watched = _watched_rebuild(tree, env, kernel, 2 * i)
            plain = _plain_rebuild(tree, env, kernel, 2 * i + 1)
            pairs.append({"watch_s": round(watched, 3), "plain_s": round(plain, 3),
                          "ratio": round(watched / plain, 3)})
            print(f"[watch] pair {i + 1}: watched rebuild {watched:.2f} s, plain kernel-edit build {plain:.2f} s, "
                  f"ratio {watched / plain:.2f}", file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    ratio = median([q["ratio"] for q in pairs])
    result = {"target": MAIN_TARGET, "pairs": pairs, "median_ratio": ratio, "goal": GOAL, "met": ratio <= GOAL}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"watch mode's first rebuild after a kernel save ÷ a plain kernel-edit build: median {ratio:.2f} "
          f"(goal ≤ {GOAL}) over {len(pairs)} pairs; {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
