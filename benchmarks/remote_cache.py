#!/usr/bin/env python3
"""What a remote cache (Bazel's HTTP protocol, served by a real nginx WebDAV on loopback) costs
and saves, on ``targets/vit_fp8.toml``.

    python benchmarks/remote_cache.py [--repeats N] [--out benchmarks/results/remote_cache.json]

Per build it also records CPU seconds (user + system of the build and every process it waited
for) and the peak PSS of its process tree (benchmarks/pss.py); ``fill_cpu_over_local_s`` is what
uploading cost in CPU, per repeat (the fill build less the local-only one).

Each repeat, in scratch copies of the tracked files (as benchmarks/run.py makes them), times:

* ``local``: a clean build without a remote (the reference);
* ``fill``: a clean build in another tree, uploading to an empty remote prefix;
* ``fresh``: a fresh copy with an empty local cache pointed at that remote (the issue's goal:
  at most 15 % of ``local``, no phase function run locally, the same package);
* ``warm``: the ``fill`` tree again with its local cache (artifacts and doit's DB removed);
* ``down``: a clean build pointed at a port where nothing listens.

Writes the samples, medians and per-repeat ratios as JSON and prints a table; every build must
PASS and every package must be byte-identical, or the script exits 1.
"""
from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from run import REPO, Bench, BuildFailed, machine_info, make_scratch, median, progress

TARGET = "vit_fp8"
CONF = """\
user root; daemon off; worker_processes 1; pid {root}/nginx.pid; error_log {root}/error.log;
events {{ worker_connections 256; }}
http {{ access_log {root}/access.log; client_body_temp_path {root}/tmp; client_max_body_size 2g;
  server {{ listen 127.0.0.1:{port};
    location / {{ root {root}/data; dav_methods PUT DELETE; create_full_put_path on; dav_access user:rw all:r; }} }} }}
"""
_SUMMARY = re.compile(r"^cache: (.*)$", re.M)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_nginx(root: Path) -> tuple[subprocess.Popen, int]:
    nginx = shutil.which("nginx") or "/usr/sbin/nginx"
    for d in ("data", "tmp"):
        (root / d).mkdir(parents=True, exist_ok=True)
    port = free_port()
    (root / "nginx.conf").write_text(CONF.format(root=root, port=port))
    proc = subprocess.Popen([nginx, "-e", str(root / "error.log"), "-c", str(root / "nginx.conf"), "-p", str(root)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return proc, port
        except OSError:
            time.sleep(0.05)
    raise SystemExit(f"nginx did not start: {(root / 'error.log').read_text()[-500:]}")


def cache_line(bench: Bench, result: dict) -> dict:
    found = _SUMMARY.findall((bench.logs / result["log"]).read_text())
    return {k: int(v.rstrip("B")) for k, v in (kv.split("=") for kv in found[-1].split())} if found else {}


def run(args) -> dict:
    scratch = Path(tempfile.mkdtemp(prefix="ipubuild-remote-bench-"))
    logs = scratch / "logs"
    logs.mkdir()
    proc, port = start_nginx(scratch / "nginx")
    samples: dict[str, list] = {k: [] for k in ("local", "fill", "fresh", "warm", "down")}
    info = machine_info()
    t_start = time.perf_counter()
    try:
        for i in range(args.repeats):
            progress(f"repeat {i + 1}/{args.repeats}")
            url = f"http://127.0.0.1:{port}/bench{i}"

            def tree(name: str, remote: str | None) -> Bench:
                b = Bench(make_scratch(REPO, scratch / f"{name}{i}"), logs, scratch / "failed")
                b.env.pop("IPUBUILD_REMOTE_CACHE", None)
                if remote:
                    b.env["IPUBUILD_REMOTE_CACHE"] = remote
                return b

            trees = {"local": tree("local", None), "fill": tree("fill", url),
                     "down": tree("down", f"http://127.0.0.1:{free_port()}/nothing")}
            runs = {}
            # the clean builds in a rotated order (the machine's load drifts), then the fresh
            # tree right after the fill, and the fill tree's warm rebuild
            order = ["local", "down", "fill"]
            for k in order[i % 3:] + order[:i % 3]:
                runs[k] = (trees[k], trees[k].build(TARGET, f"{k} {i}"))
                if k == "fill":
                    fresh = tree("fresh", url)
                    runs["fresh"] = (fresh, fresh.build(TARGET, f"fresh {i}"))
                    trees["fill"].remove_artifacts()
                    trees["fill"].remove_doit_db()
                    runs["warm"] = (trees["fill"], trees["fill"].build(TARGET, f"warm {i}"))
            digests = {k: hashlib.sha256((b.tree / "artifacts" / TARGET / f"{TARGET}.ipuexe").read_bytes()).hexdigest()
                       for k, (b, _) in runs.items()}
            for k, (b, r) in runs.items():
                samples[k].append({"wall_s": r["wall_s"], "cpu_s": r["cpu_s"], "peak_pss_mib": r["peak_pss_mib"],
                                   "uncached_phases": r["uncached_phases"],
                                   "executed_count": r["executed_count"], "cache": cache_line(b, r),
                                   "package_sha256": digests[k], "log": r["log"]})
            if len(set(digests.values())) != 1:
                raise SystemExit(f"packages differ between builds of repeat {i + 1}: {digests}")
            if runs["fresh"][1]["uncached_phases"]:
                raise SystemExit(f"the fresh tree ran phases locally: {runs['fresh'][1]['uncached_phases']}")
    finally:
        proc.terminate()
        proc.wait()
        requests = (scratch / "nginx" / "access.log").read_text().splitlines()
        if not args.keep_scratch:
            shutil.rmtree(scratch, ignore_errors=True)
    walls = {k: [s["wall_s"] for s in v] for k, v in samples.items()}
    ratios = {}
    for num, den in (("fresh", "local"), ("fresh", "fill"), ("fill", "local"), ("warm", "local"), ("down", "local")):
        per = [round(a / b, 4) for a, b in zip(walls[num], walls[den])]
        ratios[f"{num}/{den}"] = {"median": median(per), "per_repeat": per}
    cpu = {k: [s["cpu_s"] for s in v] for k, v in samples.items()}
    # what filling a remote costs: CPU seconds (user + system, the build and every process it
    # waited for) of the clean build that uploads, less the local-only one of the same repeat
    fill_cost = [round(a - b, 3) for a, b in zip(cpu["fill"], cpu["local"])]
    return {"schema": 2, "when": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": " ".join(sys.argv), "target": TARGET, "repeats": args.repeats,
            "total_s": round(time.perf_counter() - t_start, 1), "machine": info,
            "medians": {k: median(v) for k, v in walls.items()}, "ratios": ratios,
            "cpu_medians": {k: median(v) for k, v in cpu.items()},
            "fill_cpu_over_local_s": {"median": median(fill_cost), "per_repeat": fill_cost}, "samples": samples,
            "server_requests": {"GET": sum('"GET ' in r for r in requests), "PUT": sum('"PUT ' in r for r in requests)},
            "scratch": str(scratch) if args.keep_scratch else None}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "remote_cache.json")
    ap.add_argument("--keep-scratch", action="store_true")
    args = ap.parse_args()
    try:
        result = run(args)
    except BuildFailed as exc:
        print(exc, file=sys.stderr)
        return 1
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"{'build':<8}{'median s':>10}   ratios (median of per-repeat)")
    for k, v in result["medians"].items():
        print(f"{k:<8}{v:>10.2f}")
    for k, v in result["ratios"].items():
        print(f"  {k:<14}{v['median']:>8.3f}   {v['per_repeat']}")
    print(f"CPU s (median): " + ", ".join(f"{k} {v:.2f}" for k, v in result["cpu_medians"].items()))
    f = result["fill_cpu_over_local_s"]
    print(f"filling the remote: {f['median']:+.2f} CPU s over a local-only clean build {f['per_repeat']}")
    print(f"fresh tree's cache line: {result['samples']['fresh'][-1]['cache']}")
    print(f"written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
