#!/usr/bin/env python3
"""The simulator against the host reference, on big targets, in one process.

    python benchmarks/simulator_scale.py [--target FILE ...] [--repeats N] [--baseline REV]
                                         [--work DIR] [--out benchmarks/results/simulator_scale.json]

For every target file (default: ``targets/vit_fp8.toml`` and ``benchmarks/targets/vit_s16_1472.toml``)
a worker process builds the package once through ``ipubuild.build.build_in_process`` (its cache in
``--work``, so a second invocation with the same ``--work`` skips the builds), then alternates N
times: the ``run_device`` phase re-run through the engine (``force=True``; its ``elapsed_ms`` is the
figure the build's ``package build phase finished phase="run_device"`` line prints) and the host
reference's ``evaluate`` with the target's BLAS thread count (the figure of ``evaluated host
reference elapsed_ms``). Each repeat checks the device outputs against the reference with the
target's thresholds, and the profile's total cycles against the cost model's ``final_cycles``.

With ``--baseline REV`` the same is done, in the same invocation, with the ``ipubuild/`` package of
git revision REV (extracted under ``--work``); the two share one cache, so planning phases whose
code and inputs are unchanged are built once. Ratios are device / reference per repeat, within one
process; compare ratios, not milliseconds, across runs (the machine is shared).

Writes JSON (``--out``) and prints a table.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DEFAULT_TARGETS = ["targets/vit_fp8.toml", "benchmarks/targets/vit_s16_1472.toml"]
SCHEMA = 1
CACHE_SIZE = 64 * 2**30


# the worker: runs inside the code under test ----------------------------------------------------
def worker(tree: Path, target_file: str, repeats: int) -> dict:
    """Build ``target_file`` in ``tree``, then time the device and the reference ``repeats`` times."""
    import numpy as np

    from ipubuild.engine import canonical
    from ipubuild.graph import reference, tensors
    from ipubuild.build.build import all_steps, build_in_process
    from ipubuild.ir import Graph
    from ipubuild.build.pipeline import Workspace
    from ipubuild.targets import load_target

    os.chdir(tree)
    t0 = time.perf_counter()
    digests = build_in_process(tree, target_file)
    build_s = time.perf_counter() - t0
    ws = Workspace.at(tree)
    target = load_target(target_file)
    name = target["name"]
    step = next(s for s in all_steps(target, ws.artifacts) if s.phase == "run_device")
    inputs = {slot: digests[a] for slot, a in step.inputs.items()}
    graph = Graph.from_json(canonical.loads(ws.engine.fetch(digests[f"{name}/graph"])))
    arrays = tensors.unpack(ws.engine.fetch(digests[f"{name}/params"]))
    consts = {v: arrays[f"v{v}"] for v in graph.constants}
    values = {v: arrays[f"v{v}"] for v in graph.inputs}
    numerics = target["numerics"]
    final_cycles = canonical.loads(ws.engine.fetch(digests[f"{name}/cost"]))["final_cycles"]
    samples = []
    for _ in range(repeats):
        c0 = time.process_time()
        result = ws.engine.run("run_device", inputs, step.config, force=True)
        device_cpu_ms = (time.process_time() - c0) * 1000
        t1, c1 = time.perf_counter(), time.process_time()
        ref = reference.evaluate(graph, consts, values, threads=numerics["blas_threads"])
        reference_ms, reference_cpu_ms = (time.perf_counter() - t1) * 1000, (time.process_time() - c1) * 1000
        device = tensors.unpack(ws.engine.fetch(result.outputs["device_run"]))
        cos, err = reference.compare(device, {graph.values[v].name: a for v, a in ref.items()})
        profile = canonical.loads(ws.engine.fetch(result.outputs["profile"]))
        samples.append({"run_device_ms": result.elapsed_ms, "reference_ms": round(reference_ms, 1),
                        "ratio": result.elapsed_ms / reference_ms, "device_cpu_ms": round(device_cpu_ms, 1),
                        "reference_cpu_ms": round(reference_cpu_ms, 1), "cpu_ratio": device_cpu_ms / reference_cpu_ms,
                        "device_run": result.outputs["device_run"], "min_cosine": cos, "max_abs_error": err,
                        "pass": bool(np.isfinite(cos) and cos >= numerics["min_cosine"]
                                     and err <= numerics["max_abs_error"]),
                        "device_ok": profile["ok"], "total_cycles": profile["total_cycles"],
                        "profile_equals_cost": profile["total_cycles"] == final_cycles})
    return {"target": name, "tiles": target["target"]["tile_count"], "build_s": round(build_s, 1),
            "tiles_used": profile["tiles_used"], "steps": len(profile["steps"]),
            "package_bytes": len(ws.engine.fetch(digests[f"{name}/package"])),
            "simulator_threads": os.environ.get("IPUBUILD_SIMULATOR_THREADS") or "default", "samples": samples}


# the driver -------------------------------------------------------------------------------------
def progress(msg: str) -> None:
    print(f"[simulator_scale] {msg}", file=sys.stderr, flush=True)


def extract(rev: str, work: Path) -> Path:
    """The ``ipubuild/`` package of git revision ``rev``, under ``work``."""
    commit = subprocess.run(["git", "rev-parse", "--verify", f"{rev}^{{commit}}"], cwd=REPO, capture_output=True,
                            text=True)
    if commit.returncode != 0:
        raise SystemExit(f"error: --baseline {rev}: not a git revision of {REPO}")
    root = work / f"code-{commit.stdout.strip()[:12]}"
    if not (root / "ipubuild").is_dir():
        root.mkdir(parents=True, exist_ok=True)
        archive = subprocess.run(["git", "archive", commit.stdout.strip(), "ipubuild"], cwd=REPO,
                                 capture_output=True, check=True)
        subprocess.run(["tar", "-x", "-C", str(root)], input=archive.stdout, check=True)
    return root


def run_worker(code: Path, label: str, target: Path, work: Path, repeats: int, threads: int | None) -> dict:
    tree = work / f"tree-{label}"
    (tree / "targets").mkdir(parents=True, exist_ok=True)
    shutil.copyfile(target, tree / "targets" / target.name)
    log = work / f"{label}-{target.stem}.log"
    # a cache large enough that nothing is evicted between the build and the timed runs
    env = dict(os.environ, PYTHONPATH=str(code), IPUBUILD_CACHE_DIR=str(work / "cache"),
               IPUBUILD_CACHE_SIZE=str(CACHE_SIZE), IPUBUILD_DEVICE_LOCK_DIR=str(work / "locks"),
               PYTHONUNBUFFERED="1")
    if threads:
        env["IPUBUILD_SIMULATOR_THREADS"] = str(threads)
    (work / "locks").mkdir(exist_ok=True)
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", str(tree), f"targets/{target.name}",
           str(repeats)]
    progress(f"{label}: {target.name}: build (once) and {repeats} device/reference repeats; log {log}")
    with open(log, "w") as f:
        proc = subprocess.run(cmd, cwd=tree, env=env, stdout=subprocess.PIPE, stderr=f, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"error: {label} worker on {target.name} failed (exit {proc.returncode}); see {log}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    result["code"], result["log"] = label, str(log)
    return result


def summarize(result: dict) -> dict:
    s = result["samples"]
    med = lambda key: statistics.median(x[key] for x in s)  # noqa: E731
    return {"run_device_ms": med("run_device_ms"), "reference_ms": med("reference_ms"),
            "ratio_median": round(med("ratio"), 2), "ratio_of_medians": round(med("run_device_ms") / med("reference_ms"), 2),
            "cpu_ratio_median": round(med("cpu_ratio"), 2), "device_runs": sorted({x["device_run"] for x in s}),
            "all_pass": all(x["pass"] and x["device_ok"] for x in s),
            "profile_equals_cost": all(x["profile_equals_cost"] for x in s)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", action="append", help="target file (repeatable); default: "
                   + ", ".join(DEFAULT_TARGETS))
    p.add_argument("--repeats", type=int, default=5, help="device/reference repeats per target (default 5)")
    p.add_argument("--baseline", help="also measure the ipubuild/ package of this git revision")
    p.add_argument("--threads", type=int, help="IPUBUILD_SIMULATOR_THREADS for the workers (default: unset)")
    p.add_argument("--work", help="scratch folder for trees and the shared cache (kept; default: a temporary "
                   "folder, removed)")
    p.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "simulator_scale.json"))
    p.add_argument("--worker", nargs=3, metavar=("TREE", "TARGET", "REPEATS"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.repeats < 1:
        p.error("--repeats must be at least 1")
    if args.threads is not None and args.threads < 1:
        p.error("--threads must be at least 1")
    if args.worker:
        tree, target, repeats = args.worker
        print(json.dumps(worker(Path(tree), target, int(repeats))))
        return 0

    targets = [Path(t) if Path(t).is_absolute() else REPO / t for t in (args.target or DEFAULT_TARGETS)]
    for t in targets:
        if not t.is_file():
            raise SystemExit(f"error: --target {t}: no such file")
    work = Path(args.work).resolve() if args.work else Path(tempfile.mkdtemp(prefix="ipubuild-simscale-"))
    work.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    codes = [("current", REPO)]
    if args.baseline:
        codes.insert(0, (f"baseline-{args.baseline}", extract(args.baseline, work)))
    results = []
    try:
        for target in targets:
            for label, code in codes:
                r = run_worker(code, label, target, work, args.repeats, args.threads)
                r["summary"] = summarize(r)
                results.append(r)
    finally:
        if not args.work:
            shutil.rmtree(work, ignore_errors=True)
    report = {"schema": SCHEMA, "when": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "command": " ".join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])]),
              "git_commit": subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True,
                                           text=True).stdout.strip(),
              "git_dirty": bool(subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                                               capture_output=True, text=True).stdout.strip()),
              "nproc": os.cpu_count(), "loadavg_end": list(os.getloadavg()), "repeats": args.repeats,
              "total_s": round(time.perf_counter() - started, 1), "results": results}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"{'target':16} {'code':24} {'tiles':>5} {'used':>5} {'device ms':>10} {'ref ms':>8} "
          f"{'ratio':>6} {'cpu ratio':>9} {'pass':>5} {'cycles=cost':>11}  device_run")
    for r in results:
        s = r["summary"]
        print(f"{r['target']:16} {r['code']:24} {r['tiles']:5} {r['tiles_used']:5} {s['run_device_ms']:10.0f} "
              f"{s['reference_ms']:8.1f} {s['ratio_median']:6.2f} {s['cpu_ratio_median']:9.2f} "
              f"{str(s['all_pass']):>5} {str(s['profile_equals_cost']):>11}  "
              f"{','.join(d[:12] for d in s['device_runs'])}")
    print(f"wrote {out}")
    return 0 if all(r["summary"]["all_pass"] and r["summary"]["profile_equals_cost"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
