#!/usr/bin/env python3
"""Building on a Dask cluster: clean builds here and on a loopback cluster, and what scales.

    python benchmarks/cluster.py [--repeats N] [--workers 2] [--targets vit_fp8 vit_b16_fp8 vit12_1472]
                                 [--out benchmarks/results/cluster.json]

Needs the distributed extra (``pip install -e '.[distributed]'``). Copies the repository's tracked
files into a scratch tree (as ``benchmarks/run.py`` does), starts ``dask scheduler`` and
``--workers`` ``dask worker`` processes (one process, one thread each) on 127.0.0.1 free ports,
importing the scratch tree's ipubuild — a fresh cluster for every build, since a worker's store
keeps its results — and times, per target, clean builds (``python -m doit build:<target>``, cold
cache) with no cluster and with ``IPUBUILD_SCHEDULER`` set, alternating.
A target not in ``targets/`` is taken from ``benchmarks/targets/`` if it is there, else recorded
as missing.

From each cluster build's trace (``artifacts/<target>/build.trace.json``) it takes the build's
wall time ``T``, the time the client spent in dispatches to the cluster ``D`` (``cluster``
events), and every task's time on its worker (``worker:*`` events: wall and CPU seconds, blob
bytes sent and returned). The client's own work is ``S = T - D``; the workers' is ``W``; the
share of the build's work that ran on workers — the part that would scale with more machines —
is ``W / (S + W)``. With N workers, ``T(N) = S + sum over dispatches of max(W_d / N, longest
task of d)`` (Amdahl's law, with each dispatch no shorter than its longest task: a search round
has only ``shortlist`` candidates). Candidate throughput comes from the search's ``measured
local search round`` lines. Every build must pass and all packages of a target must be
identical; the harness stops otherwise. Writes JSON and prints a table.
"""
from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("bench_run", REPO / "benchmarks" / "run.py")
bench = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = bench
_spec.loader.exec_module(bench)

SCHEMA = 1
DEFAULT_TARGETS = ("vit_fp8", "vit_b16_fp8")


# the trace ---------------------------------------------------------------------------------------
def trace_figures(events: list[dict]) -> dict:
    """The cluster figures of one build's trace events (see the module's docstring)."""
    root = max(events, key=lambda e: e["dur"])
    total = root["dur"] / 1e6
    dispatches = sorted((e for e in events if e["name"] == "cluster"), key=lambda e: e["ts"])
    tasks = [e for e in events if e["name"].startswith("worker:")]
    per_dispatch = []
    for d in dispatches:
        inside = [t for t in tasks if d["ts"] <= t["ts"] + t["dur"] <= d["ts"] + d["dur"] + 1]
        per_dispatch.append({"work": d["args"].get("work"), "wall_s": d["dur"] / 1e6, "tasks": len(inside),
                             "worker_s": sum(float(t["args"]["seconds"]) for t in inside),
                             "longest_s": max((float(t["args"]["seconds"]) for t in inside), default=0.0)})
    dispatched = sum(d["dur"] for d in dispatches) / 1e6
    serial = total - dispatched
    worker = sum(float(t["args"]["seconds"]) for t in tasks)
    by_kind: dict[str, dict] = {}
    for t in tasks:
        k = by_kind.setdefault(t["name"].removeprefix("worker:"), {"tasks": 0, "worker_s": 0.0, "cpu_s": 0.0,
                                                                    "bytes_sent": 0, "bytes_returned": 0})
        k["tasks"] += 1
        k["worker_s"] += float(t["args"]["seconds"])
        k["cpu_s"] += float(t["args"]["cpu_seconds"])
        k["bytes_sent"] += int(t["args"].get("bytes_sent", 0))
        k["bytes_returned"] += int(t["args"].get("bytes_returned", 0))
    for d in per_dispatch:
        k = by_kind.get({"candidates": "candidate"}.get(d["work"], d["work"]))
        if k is not None:
            k["dispatch_wall_s"] = k.get("dispatch_wall_s", 0.0) + d["wall_s"]

    def predicted(n: int) -> float:
        return serial + sum(max(d["worker_s"] / n, d["longest_s"]) for d in per_dispatch)
    return {"build_s": total, "dispatched_s": dispatched, "serial_s": serial, "worker_s": worker,
            "worker_cpu_s": sum(float(t["args"]["cpu_seconds"]) for t in tasks),
            "share": worker / (serial + worker) if serial + worker else None,
            "dispatches": len(dispatches), "by_kind": by_kind,
            "predicted_s": {str(n): predicted(n) for n in (1, 2, 16, 64)},
            "amdahl_s": {str(n): serial + worker / n for n in (16, 64)},
            "limit_s": serial + sum(d["longest_s"] for d in per_dispatch),
            "serial_phases": serial_phases(events, dispatches)}


def serial_phases(events: list[dict], dispatches: list[dict]) -> list[list]:
    """The build's own phases by the client time they took outside cluster dispatches, largest
    first (``[phase, seconds]``: what stays when workers are many). A step's phase is the
    innermost span opened with its ``build`` span (steps after ``plan_package`` carry its span
    too)."""
    skip = ("cluster", "build", "local_candidate")
    out: dict[str, float] = {}
    for b in (e for e in events if e["name"] == "build"):
        opened = [e for e in events if e["name"] not in skip and not e["name"].startswith("worker:")
                  and b["ts"] <= e["ts"] <= b["ts"] + 5000 and e["ts"] + e["dur"] <= b["ts"] + b["dur"] + 1]
        if not opened:
            continue
        p = min(opened, key=lambda e: e["dur"])
        inside = sum(d["dur"] for d in dispatches if p["ts"] <= d["ts"] <= p["ts"] + p["dur"])
        out[p["name"]] = out.get(p["name"], 0.0) + (p["dur"] - inside) / 1e6
    return sorted(([k, round(v, 3)] for k, v in out.items()), key=lambda x: -x[1])[:8]


# the cluster ------------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LoopbackCluster:
    """``dask scheduler`` and ``workers`` ``dask worker`` processes on 127.0.0.1."""

    def __init__(self, tree: Path, logs: Path, workers: int):
        dask = Path(sys.executable).with_name("dask")
        if not dask.exists():
            raise SystemExit("no `dask` command beside this Python: pip install -e '.[distributed]'")
        self.address = f"tcp://127.0.0.1:{_free_port()}"
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tree)] + ([os.environ["PYTHONPATH"]]
                                                                         if os.environ.get("PYTHONPATH") else [])))
        self.procs = []
        port = self.address.rsplit(":", 1)[1]
        self.procs.append(self._spawn([str(dask), "scheduler", "--host", "127.0.0.1", "--port", port,
                                       "--no-dashboard"], logs / f"scheduler-{port}.log", env))
        for i in range(workers):
            self.procs.append(self._spawn([str(dask), "worker", self.address, "--nworkers", "1", "--nthreads", "1",
                                           "--host", "127.0.0.1", "--no-dashboard"], logs / f"worker-{port}-{i}.log", env))
        import distributed
        client = distributed.Client(self.address, timeout=60, set_as_default=False)
        try:
            client.wait_for_workers(workers, timeout=120)
        finally:
            client.close()

    @staticmethod
    def _spawn(cmd, log: Path, env) -> subprocess.Popen:
        return subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT, env=env, start_new_session=True)

    def stop(self) -> None:
        for p in self.procs:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait()


# the measurements -------------------------------------------------------------------------------
def target_file(tree: Path, name: str) -> bool:
    """Make sure ``targets/<name>.toml`` is in the scratch tree (from benchmarks/targets/)."""
    if (tree / "targets" / f"{name}.toml").exists():
        return True
    extra = tree / "benchmarks" / "targets" / f"{name}.toml"
    if extra.exists():
        shutil.copy(extra, tree / "targets" / extra.name)
        return True
    return False


def build(b, target: str, label: str, workers: int) -> dict:
    """A clean build: here (``workers`` 0) or on a fresh loopback cluster of ``workers`` (a
    worker's own store keeps its results for its life: a second build on it is not clean)."""
    b.clean_cache()
    cluster = None
    b.env.pop("IPUBUILD_SCHEDULER", None)
    try:
        if workers:
            cluster = LoopbackCluster(b.tree, b.logs, workers)
            b.env["IPUBUILD_SCHEDULER"] = cluster.address
        r = b.build(target, label)
    finally:
        if cluster is not None:
            cluster.stop()
    log = (b.logs / r["log"]).read_text(errors="replace")
    r["package_sha256"] = bench_sha256(b.tree / "artifacts" / target / f"{target}.ipuexe")
    r["warnings"] = [ln.split(": ", 1)[-1][:200] for ln in log.splitlines() if " WARN " in ln]
    if workers:
        r["trace"] = trace_figures(json.loads((b.tree / "artifacts" / target / "build.trace.json")
                                              .read_text())["traceEvents"])
    return r


def bench_sha256(path: Path) -> str:
    import hashlib
    return hashlib.sha256(path.read_bytes()).hexdigest()


def run(args) -> dict:
    started = time.perf_counter()
    info = bench.machine_info()
    tmp = Path(tempfile.mkdtemp(prefix="ipubuild-cluster-bench-"))
    results: dict[str, dict] = {}
    try:
        tree = bench.make_scratch(REPO, tmp)
        logs = tmp / "logs"
        logs.mkdir()
        b = bench.Bench(tree, logs, Path(args.out).parent)
        bench.progress(f"loopback clusters of {args.workers} workers; scratch tree {tree}")
        for t in args.targets:
            copied = not (tree / "targets" / f"{t}.toml").exists()
            if not target_file(tree, t):
                bench.progress(f"{t}: no targets/{t}.toml nor benchmarks/targets/{t}.toml: skipped")
                results[t] = {"missing": f"no targets/{t}.toml in this tree"}
                continue
            here, there = [], []
            for i in range(1, args.repeats + 1):
                bench.progress(f"{t}: clean build here {i}/{args.repeats} ...")
                here.append(build(b, t, f"{t} here {i}", 0))
                bench.progress(f"{t}: clean build on the cluster {i}/{args.repeats} ...")
                there.append(build(b, t, f"{t} cluster {i}", args.workers))
            packages = {r["package_sha256"] for r in here + there}
            if len(packages) != 1:
                raise bench.BuildFailed(f"{t}: the packages differ between builds here and on the cluster: {packages}")
            results[t] = summarize(here, there)
            if copied:          # loaded (not built) by every later build: taken out again
                (tree / "targets" / f"{t}.toml").unlink()
    finally:
        if not args.keep_scratch:
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            bench.progress(f"kept scratch tree and logs in {tmp}")
    info["loadavg_end"] = list(os.getloadavg())
    return {"schema": SCHEMA, "when": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": " ".join([Path(sys.argv[0]).as_posix()] + sys.argv[1:]), "repeats": args.repeats,
            "workers": args.workers, "total_s": round(time.perf_counter() - started, 1), "machine": info,
            "targets": results}


def summarize(here: list[dict], there: list[dict]) -> dict:
    med = bench.median
    traces = [r["trace"] for r in there]
    kinds = sorted({k for tr in traces for k in tr["by_kind"]})

    def kind(k, field):
        return med([tr["by_kind"].get(k, {}).get(field) for tr in traces])
    rate = lambda rs: med([m.get("evaluations_per_s") for r in rs for m in r["search"]["measured"]])  # noqa: E731
    return {
        "clean_here_s": bench.summarize([r["wall_s"] for r in here]),
        "clean_cluster_s": bench.summarize([r["wall_s"] for r in there]),
        "cluster/here": bench.ratio_entry([r["wall_s"] for r in there], [r["wall_s"] for r in here],
                                          "clean build wall on the cluster / here"),
        "evaluations_per_s": {"here": rate(here), "cluster": rate(there)},
        "candidates": med([len(r["candidate_ms"]) for r in there]),
        "package_sha256": there[0]["package_sha256"],
        "search_final_cycles": {"here": med([r["search"]["final_cycles"] for r in here]),
                                "cluster": med([r["search"]["final_cycles"] for r in there])},
        "warnings": sorted({w for r in here + there for w in r["warnings"]}),
        "trace": {f: med([tr[f] for tr in traces]) for f in ("build_s", "dispatched_s", "serial_s", "worker_s",
                                                            "worker_cpu_s", "share", "limit_s")},
        "predicted_s": {n: med([tr["predicted_s"][n] for tr in traces]) for n in ("1", "2", "16", "64")},
        "amdahl_s": {n: med([tr["amdahl_s"][n] for tr in traces]) for n in ("16", "64")},
        "by_kind": {k: {f: kind(k, f) for f in ("tasks", "worker_s", "cpu_s", "dispatch_wall_s", "bytes_sent",
                                                "bytes_returned")} for k in kinds},
        "serial_phases": traces[0]["serial_phases"],
        "raw": {"here": here, "cluster": there},
    }


def table(res: dict) -> str:
    f = bench._f
    lines = [f"cluster benchmark {res['when']}  {res['workers']} loopback workers  repeats {res['repeats']}  "
             f"nproc {res['machine']['nproc']}", ""]
    for t, r in res["targets"].items():
        if "missing" in r:
            lines += [f"{t}: {r['missing']}", ""]
            continue
        tr = r["trace"]
        lines += [f"{t}: clean here {f(r['clean_here_s']['median'])} s, on the cluster {f(r['clean_cluster_s']['median'])} s "
                  f"(ratio {f(r['cluster/here']['median'])}); candidates/s here {f(r['evaluations_per_s']['here'], '{:.2f}')}, "
                  f"cluster {f(r['evaluations_per_s']['cluster'], '{:.2f}')}",
                  f"  trace: build {f(tr['build_s'])} s = client {f(tr['serial_s'])} s + dispatches {f(tr['dispatched_s'])} s; "
                  f"worker time {f(tr['worker_s'])} s (CPU {f(tr['worker_cpu_s'])} s); share on workers {f(tr['share'])}",
                  f"  predicted clean build: 16 workers {f(r['predicted_s']['16'])} s, 64 workers {f(r['predicted_s']['64'])} s "
                  f"(plain Amdahl {f(r['amdahl_s']['16'])} / {f(r['amdahl_s']['64'])} s); limit {f(tr['limit_s'])} s",
                  f"  {'work':<18} {'tasks':>6} {'worker s':>9} {'cpu s':>8} {'dispatch s':>10} {'MB sent':>8} {'MB back':>8}"]
        for k, v in r["by_kind"].items():
            lines.append(f"  {k:<18} {f(v['tasks'], '{:g}'):>6} {f(v['worker_s']):>9} {f(v['cpu_s']):>8} "
                         f"{f(v['dispatch_wall_s']):>10} {f(v['bytes_sent'] / 1e6 if v['bytes_sent'] is not None else None, '{:.2f}'):>8} "
                         f"{f(v['bytes_returned'] / 1e6 if v['bytes_returned'] is not None else None, '{:.2f}'):>8}")
        lines += ["  client time outside dispatches, largest phases: "
                  + ", ".join(f"{p} {s:.2f} s" for p, s in r["serial_phases"][:5]), ""]
    lines.append(f"total {res['total_s']} s")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="clean builds here and on a loopback Dask cluster (benchmarks/README.md)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--targets", nargs="+", default=list(DEFAULT_TARGETS))
    p.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "cluster.json"))
    p.add_argument("--keep-scratch", action="store_true")
    args = p.parse_args(argv)
    try:
        res = run(args)
    except bench.BuildFailed as exc:
        print(f"[bench] error: {exc}", file=sys.stderr)
        return 1
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(json.dumps(res, indent=1) + "\n")
    tmp.replace(out)
    print(table(res))
    bench.progress(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
