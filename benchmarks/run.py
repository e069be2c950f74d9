#!/usr/bin/env python3
"""ipubuild's performance harness.

    python benchmarks/run.py [--repeats N] [--quick] [--out benchmarks/results/latest.json]

Copies the repository's tracked files (``git ls-files``) into a scratch directory, then times
``python -m doit build:<target>`` there, each build a subprocess (wall time by
``time.perf_counter``) with its log parsed for the phase timings, the search figures and the
numerical verdict. Measures, on ``targets/vit_fp8.toml``: a clean build (cold cache), a no-op
rebuild and, alternating with it, ``python -c "import doit"`` (the floor of any doit run), a
warm-cache rebuild (artifacts and doit's database deleted, cache kept), a kernel body edit and a
comment-only edit of ``ipubuild/kernels/matmul.c``; the layout search with 1 and 2 workers (each
candidate's exact evaluation time, and the candidate throughput); the simulator's run time
against the host reference's; and, unless ``--quick``, a clean build (wall and peak memory), a
no-op and a kernel edit of ``targets/vit_b16_fp8.toml`` (ViT-B/16 on 1472 tiles). Every figure is
a median of repeats and every ratio is taken between figures of this one run (the machine is
shared and noisy: compare ratios, not absolute times, across runs).

Writes every raw sample, the medians and the ratios as JSON (``--out``) and prints a table.
A build that fails, or that does not end with ``numericalTest=PASS``, stops the harness with a
non-zero exit and a message naming the build; its log is saved next to the JSON.
See benchmarks/README.md.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))     # its sibling modules, however it is loaded
from pss import TreeSampler  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
MAIN_TARGET = "vit_fp8"
SCALE_TARGET = "vit_b16_fp8"
KERNEL = Path("ipubuild/kernels/matmul.c")
SCHEMA = 3                 # 3: peak memory is the process tree's PSS (peak_pss_mib), CPU seconds per build
FLOOR_PAIRS = 5            # no-op builds alternating with `python -c "import doit"`

# log parsing ------------------------------------------------------------------------------------
_EXECUTED = re.compile(r"^\.  (\S+)\s*$", re.M)
_UP_TO_DATE = re.compile(r"^-- (\S+)\s*$", re.M)
_PHASE = re.compile(r"^(?P<prefix>.*?)package build phase finished phase=\"(?P<phase>[^\"]+)\" "
                    r"elapsed_ms=(?P<ms>\d+(?:\.\d+)?) success=(?P<success>\w+)(?P<rest>.*)$", re.M)
_KV = re.compile(r"(\w+)=(\"[^\"]*\"|\S+)")
_MEASURED = re.compile(r"measured local search round (?P<kv>.*)$", re.M)
_SCREENED = re.compile(r"screened local search round (?P<kv>.*)$", re.M)
_INCUMBENT = re.compile(r"validated search incumbent cycles=(?P<cycles>\d+) resuming=(?P<resuming>\w+)")
_ACCEPTED = re.compile(r"accepted local layout improvement attempt=(?P<attempt>\d+) before=(?P<before>\d+) "
                       r"after=(?P<after>\d+)")
_FINAL = re.compile(r"^final_cycles=(?P<cycles>\d+)", re.M)
_BOUNDS = re.compile(r"^final_cycles=(?P<final_cycles>\d+) final_exchange=(?P<final_exchange>\d+) "
                     r"lower_bound=(?P<lower_bound>\d+)(?: peak_bound=(?P<peak_bound>\d+))?", re.M)
_COSINE = re.compile(r"^referenceMinimumCosineSimilarity=(?P<v>\S+)", re.M)
_VERDICT = re.compile(r"^referenceMaximumAbsoluteError=(?P<err>\S+) numericalTest=(?P<verdict>\w+)", re.M)
_DEVICE = re.compile(r"deviceTest=(?P<v>\w+)")
_COMPILED = re.compile(r"compiled kernel variant variant=(?P<variant>\S+) elapsed_ms=(?P<ms>\d+)")
_CANDIDATE = re.compile(r"evaluated local candidate attempt=\d+ proposal=\S+ cycles=\S+ elapsed_ms=(?P<ms>\d+)")


def _number(text: str):
    text = text.strip('"')
    try:
        return int(text)
    except ValueError:
        try:
            return float(text)
        except ValueError:
            return text


def parse_kv(text: str) -> dict:
    """``a=1 b=2.5 c="x"`` as a dict of numbers (or strings)."""
    return {k: _number(v) for k, v in _KV.findall(text)}


def parse_tasks(log: str) -> dict:
    """doit's task lines: ``.  task`` (executed) and ``-- task`` (up to date), in log order."""
    return {"executed": _EXECUTED.findall(log), "up_to_date": _UP_TO_DATE.findall(log)}


def parse_phases(log: str) -> list[dict]:
    """Every ``package build phase finished`` line, with the doit task it ran under (the last
    ``.  <task>`` line before it). ``own`` marks the task's own phase: the last such line of the
    task. The other lines under a task are phases the layout search runs inside ``plan_package``
    to evaluate candidates. Text without task lines counts every line as its own."""
    out, current = [], None
    for line in log.splitlines():
        t = _EXECUTED.match(line)
        if t:
            current = t[1]
            continue
        m = _PHASE.match(line)
        if not m:
            continue
        ms = m["ms"]
        out.append({"phase": m["phase"], "elapsed_ms": float(ms) if "." in ms else int(ms),
                    "success": m["success"] == "true", "cached": "cached=true" in m["rest"],
                    "task": current, "own": current is None})
    last: dict = {}
    for i, p in enumerate(out):
        if p["task"] is not None:
            last[p["task"]] = i
    for i in last.values():
        out[i]["own"] = True
    return out


def phase_ms(phases: list[dict], name: str) -> list:
    """The elapsed_ms of the tasks' own runs of phase ``name``."""
    return [p["elapsed_ms"] for p in phases if p["phase"] == name and p["own"]]


def parse_search(log: str) -> dict:
    """The layout search's figures: per-round screening and measurement, the validated initial
    incumbent, the accepted improvements and the search's final cycles."""
    screened = [parse_kv(m["kv"]) for m in _SCREENED.finditer(log)]
    measured = [parse_kv(m["kv"]) for m in _MEASURED.finditer(log)]
    inc = _INCUMBENT.search(log)
    accepted = [{k: int(v) for k, v in m.groupdict().items()} for m in _ACCEPTED.finditer(log)]
    initial = int(inc["cycles"]) if inc else None
    final = accepted[-1]["after"] if accepted else initial
    return {"screened": screened, "measured": measured, "rounds": len(measured),
            "initial_cycles": initial, "resuming": (inc["resuming"] == "true") if inc else None,
            "accepted": accepted, "final_cycles": final, "gain_pct": gain_pct(initial, final)}


def parse_result(log: str) -> dict:
    """The build's closing lines."""
    fin, cos, ver, dev = _FINAL.search(log), _COSINE.search(log), _VERDICT.search(log), _DEVICE.search(log)
    return {"final_cycles": int(fin["cycles"]) if fin else None,
            "min_cosine": float(cos["v"]) if cos else None,
            "max_abs_error": float(ver["err"]) if ver else None,
            "numerical_test": ver["verdict"] if ver else None,
            "device_test": dev["v"] if dev else None}


def parse_bounds(log: str) -> dict:
    """The program's cycles against its bounds, from the build's closing line: ``lower_bound``
    (this program's: per step max(balanced compute, balanced exchange) + sync) and
    ``peak_bound`` (the graph's work at the machine's peak rate over all tiles, plus one sync)."""
    m = _BOUNDS.search(log)
    out = {k: (int(m[k]) if m and m[k] else None) for k in ("final_cycles", "final_exchange", "lower_bound", "peak_bound")}
    out["over_lower_bound"] = ratio(out["final_cycles"], out["lower_bound"])
    out["over_peak_bound"] = ratio(out["final_cycles"], out["peak_bound"])
    return out


def gain_pct(initial, final):
    if not initial or final is None:
        return None
    return round(100.0 * (initial - final) / initial, 3)


# statistics -------------------------------------------------------------------------------------
def median(values):
    """Median of the values that are not None (None if there are none)."""
    xs = [v for v in values if v is not None]
    return statistics.median(xs) if xs else None


def ratio(num, den):
    if num is None or den is None or den == 0:
        return None
    return num / den


def paired_ratios(nums, dens) -> list:
    """Per-repeat ratios of two equally long sample lists (repeat i over repeat i)."""
    return [ratio(a, b) for a, b in zip(nums, dens)]


def summarize(samples) -> dict:
    xs = [v for v in samples if v is not None]
    return {"n": len(xs), "median": median(xs), "min": min(xs) if xs else None,
            "max": max(xs) if xs else None, "samples": list(samples)}


def ratio_entry(nums, dens, what: str) -> dict:
    """A ratio as the median of per-repeat ratios, plus the ratio of the medians."""
    per = paired_ratios(nums, dens)
    return {"what": what, "median": median(per), "of_medians": ratio(median(nums), median(dens)),
            "samples": per}


# the scratch tree and the builds ----------------------------------------------------------------
class BuildFailed(Exception):
    pass


def progress(message: str) -> None:
    print(f"[bench] {message}", file=sys.stderr, flush=True)


def make_scratch(repo: Path, dest: Path) -> Path:
    """Copy ``git ls-files`` of ``repo`` (their working-tree contents) into ``dest/tree``."""
    files = subprocess.run(["git", "ls-files", "-z"], cwd=repo, check=True, capture_output=True).stdout
    tree = dest / "tree"
    tree.mkdir(parents=True)
    for rel in filter(None, files.decode().split("\0")):
        src = repo / rel
        if not src.is_file():   # deleted in the working tree, or a submodule
            continue
        (tree / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, tree / rel)
    # the bytecode a user's tree has after its first build (and `pip install` writes for an
    # installed package): with PYTHONDONTWRITEBYTECODE set, as on the CI machines, Python never
    # writes it, and every timed build compiled ipubuild's ~80 modules again (0.35 s a build)
    subprocess.run([sys.executable, "-m", "compileall", "-q", str(tree / "ipubuild")], check=True,
                   stdout=subprocess.DEVNULL)
    return tree


class Bench:
    def __init__(self, tree: Path, logs: Path, failed_dir: Path):
        self.tree, self.logs, self.failed_dir = tree, logs, failed_dir
        self.count = 0
        env = dict(os.environ)
        env.pop("IPUBUILD_CACHE_DIR", None)
        env["PYTHONUNBUFFERED"] = "1"           # keeps doit's task lines and the logs in order
        env.update(IPUBUILD_CONSOLE="tasks", IPUBUILD_LOG="debug")   # which the harness reads
        env["PYTHONPATH"] = os.pathsep.join([str(tree)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
        # a private device lock: builds of other trees on this machine must not add waits
        env["IPUBUILD_DEVICE_LOCK_DIR"] = str(logs)
        # the classic console (doit's task lines and the full structured log), which this parses
        env.update(IPUBUILD_CONSOLE="tasks", IPUBUILD_LOG="debug")
        self.env = env
        # the doit command a user types, from the interpreter running this harness
        script = Path(sys.executable).with_name("doit")
        self.doit = [str(script)] if script.exists() else [sys.executable, "-m", "doit"]

    # tree states
    def clean_cache(self) -> None:
        for name in (".ipubuild", "artifacts"):
            shutil.rmtree(self.tree / name, ignore_errors=True)
        self.remove_doit_db()

    def remove_doit_db(self) -> None:
        for p in self.tree.glob(".doit.db*"):
            p.unlink()

    def remove_artifacts(self) -> None:
        shutil.rmtree(self.tree / "artifacts", ignore_errors=True)

    def build(self, target: str, label: str) -> dict:
        """Run ``python -m doit build:<target>`` in the scratch tree; time it, parse its log."""
        self.count += 1
        cmd = [*self.doit, f"build:{target}"]
        log_path = self.logs / f"{self.count:03d}-{re.sub(r'[^A-Za-z0-9_.-]+', '_', label)}.log"
        wall, returncode, peak_kib = _timed(cmd, self.tree, self.env, log_path)
        proc = subprocess.CompletedProcess(cmd, returncode)
        log = log_path.read_text(errors="replace")
        result = parse_result(log)
        if proc.returncode != 0 or result["numerical_test"] != "PASS":
            saved = self.failed_dir / f"failed-{log_path.name}"
            self.failed_dir.mkdir(parents=True, exist_ok=True)
            shutil.copy(log_path, saved)
            tail = "\n".join(log.splitlines()[-15:])
            why = (f"exited with status {proc.returncode}" if proc.returncode != 0
                   else f"did not end with numericalTest=PASS (got {result['numerical_test']})")
            raise BuildFailed(f"benchmark build failed: {label}: `{' '.join(cmd[1:])}` in {self.tree} {why}.\n"
                              f"last lines of its log:\n{tail}\nfull log: {saved}")
        phases = parse_phases(log)
        tasks = parse_tasks(log)
        progress(f"  {label}: {wall:.2f} s, {len(tasks['executed'])} task(s) executed")
        return {"label": label, "wall_s": round(wall, 4), "returncode": proc.returncode, **result,
                "peak_pss_mib": None if peak_kib is None else round(peak_kib / 1024, 1),
                "cpu_s": _timed.last["cpu_s"], "largest_process_rss_mib": round(_timed.last["max_rss_kib"] / 1024, 1),
                "compiled_ms": sum(int(m["ms"]) for m in _COMPILED.finditer(log)),
                "compiled": [m["variant"] for m in _COMPILED.finditer(log)],
                "candidate_ms": [int(m["ms"]) for m in _CANDIDATE.finditer(log)],
                "executed": tasks["executed"], "executed_count": len(tasks["executed"]),
                "up_to_date_count": len(tasks["up_to_date"]),
                "cached_phases": sum(1 for p in phases if p["cached"] and p["own"]),
                "uncached_phases": [p["task"] for p in phases if p["own"] and not p["cached"]],
                "run_device_ms": _one(phase_ms(phases, "run_device")),
                "measure_kernels_ms": _one(phase_ms(phases, "measure_kernels")),
                "evaluate_reference_ms": _one(phase_ms(phases, "evaluate_reference")),
                "plan_package_ms": _one(phase_ms(phases, "plan_package")),
                "search": parse_search(log), "bounds": parse_bounds(log), "log": log_path.name}


    def floor(self) -> float:
        """Wall seconds of ``python -c "import doit"`` (the cost of starting any doit run)."""
        log_path = self.logs / "import-doit.log"
        return _timed([sys.executable, "-c", "import doit"], self.tree, self.env, log_path)[0]


def _timed(cmd, cwd, env, log_path) -> tuple[float, int, int | None]:
    """(wall seconds, exit status, peak memory KiB of the whole process tree: the sum of the PSS
    of the process and all its descendants, sampled by ``pss.TreeSampler``; None where /proc
    lacks what it reads). ``_timed.last`` keeps the run's CPU seconds (user + system, of the
    process and every descendant it waited for: ``wait4``'s usage) and the largest single
    process's ``ru_maxrss``."""
    with open(log_path, "wb") as f:
        t0 = time.perf_counter()
        p = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=f, stderr=subprocess.STDOUT)
        with TreeSampler(p.pid) as sampler:
            _, status, usage = os.wait4(p.pid, 0)
        wall = time.perf_counter() - t0
    p.returncode = os.waitstatus_to_exitcode(status)
    _timed.last = {"cpu_s": round(usage.ru_utime + usage.ru_stime, 3), "max_rss_kib": usage.ru_maxrss,
                   "pss_samples": sampler.samples}
    return wall, p.returncode, sampler.peak_kib


_timed.last = {}


def _one(values):
    return values[-1] if values else None


def set_search_workers(path: Path, workers: int) -> None:
    """Set ``workers`` in the ``[search]`` table of a target file (adding it if absent)."""
    lines = path.read_text().splitlines(keepends=True)
    section, done, out = None, False, []
    for line in lines:
        s = line.strip()
        if s.startswith("[") and s.endswith("]"):
            if section == "search" and not done:
                out.append(f"workers = {workers}\n")
                done = True
            section = s.strip("[]").strip()
        elif section == "search" and re.match(r"workers\s*=", s):
            line, done = f"workers = {workers}\n", True
        out.append(line)
    if not done:
        if section != "search":
            out.append("\n[search]\n")
        out.append(f"workers = {workers}\n")
    path.write_text("".join(out))


# expectations: what a no-op or an edit build should execute ------------------------------------
def unexpected_tasks(kind: str, executed: list[str], target: str) -> list[str]:
    """Tasks executed that the README says this kind of build should not run."""
    def ok(task: str) -> bool:
        if kind == "noop":
            return False                       # not even build: (up to date when nothing ran)
        if task == f"build:{target}":
            return True
        if kind == "comment_edit":
            return task in (f"compile_kernels:{target}", f"compile_kernels_counted:{target}")
        if kind == "kernel_edit":
            return task in {f"{p}:{target}" for p in ("compile_kernels", "compile_kernels_counted", "link_kernels",
                                                       "build_tile_images",
                                                       "write_package", "run_device", "measure_kernels",
                                                       "check_numerics", "report_profile")}
        return True
    return [t for t in executed if not ok(t)]


# machine information ----------------------------------------------------------------------------
def _first_line(cmd, cwd=None) -> str | None:
    try:
        out = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    text = (out.stdout or out.stderr).strip()
    return text.splitlines()[0] if text else None


def machine_info() -> dict:
    cc = os.environ.get("IPUBUILD_CC") or os.environ.get("CC") or "cc"
    try:
        affinity = len(os.sched_getaffinity(0))
    except AttributeError:
        affinity = None
    return {"nproc": _first_line(["nproc"]) or affinity, "cpu_count": os.cpu_count(),
            "python": sys.version.split()[0], "python_executable": sys.executable,
            "platform": platform.platform(), "cc": cc, "cc_version": _first_line([cc, "--version"]),
            "git_commit": _first_line(["git", "rev-parse", "HEAD"], cwd=REPO),
            "git_dirty": bool(subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                                             capture_output=True, text=True).stdout.strip()),
            "loadavg_start": list(os.getloadavg())}


# the measurements -------------------------------------------------------------------------------
def run(args) -> dict:
    repeats = 1 if args.quick else (args.repeats or 3)
    scale_repeats = args.repeats or 1
    started = time.perf_counter()
    info = machine_info()
    out_path = Path(args.out)
    tmp = Path(tempfile.mkdtemp(prefix="ipubuild-bench-"))
    try:
        tree = make_scratch(REPO, tmp)
        logs = tmp / "logs"
        logs.mkdir()
        b = Bench(tree, logs, out_path.parent)
        target_file = tree / "targets" / f"{MAIN_TARGET}.toml"
        target_text = target_file.read_text()
        kernel_file = tree / KERNEL
        kernel_text = kernel_file.read_text()
        progress(f"scratch tree {tree} ({repeats} repeat(s){'' if args.quick else f', scale {scale_repeats}'})")

        raw: dict[str, list] = {k: [] for k in ("clean", "noop", "warm", "kernel_edit", "comment_edit")}
        floor: dict[str, list] = {"noop": [], "import_doit": []}
        for i in range(1, repeats + 1):
            kernel_file.write_text(kernel_text)   # every repeat edits the same source
            b.clean_cache()
            progress(f"clean build {i}/{repeats} ...")
            raw["clean"].append(b.build(MAIN_TARGET, f"clean {i}"))
            progress(f"no-op rebuild {i}/{repeats} ...")
            raw["noop"].append(b.build(MAIN_TARGET, f"noop {i}"))
            if i == 1:
                progress(f"{FLOOR_PAIRS} no-op builds alternating with `python -c \"import doit\"` ...")
                for j in range(FLOOR_PAIRS):
                    floor["noop"].append(b.build(MAIN_TARGET, f"noop vs import {j + 1}")["wall_s"])
                    floor["import_doit"].append(round(b.floor(), 4))
            b.remove_artifacts()
            b.remove_doit_db()
            progress(f"warm-cache rebuild {i}/{repeats} ...")
            raw["warm"].append(b.build(MAIN_TARGET, f"warm {i}"))
            with open(kernel_file, "a") as f:
                f.write(f"\nint ipubuild_bench_probe_{i}(int x) {{ return 3 * x + {i}; }}\n")
            progress(f"kernel body edit rebuild {i}/{repeats} ...")
            raw["kernel_edit"].append(b.build(MAIN_TARGET, f"kernel edit {i}"))
            with open(kernel_file, "a") as f:
                f.write(f"/* bench {i} */\n")
            progress(f"comment-only edit rebuild {i}/{repeats} ...")
            raw["comment_edit"].append(b.build(MAIN_TARGET, f"comment edit {i}"))
        kernel_file.write_text(kernel_text)

        search: dict[str, list] = {}
        for workers in (1, 2):
            set_search_workers(target_file, workers)
            search[str(workers)] = []
            for i in range(1, repeats + 1):
                b.clean_cache()
                progress(f"search workers={workers} clean build {i}/{repeats} ...")
                search[str(workers)].append(b.build(MAIN_TARGET, f"search w{workers} {i}"))
        target_file.write_text(target_text)

        scale: dict[str, list] = {"clean": [], "noop": [], "kernel_edit": []}
        if not args.quick:
            for i in range(1, scale_repeats + 1):
                kernel_file.write_text(kernel_text)
                b.clean_cache()
                progress(f"scale clean build {i}/{scale_repeats} ({SCALE_TARGET}, many minutes) ...")
                scale["clean"].append(b.build(SCALE_TARGET, f"scale clean {i}"))
                progress(f"scale no-op rebuild {i}/{scale_repeats} ...")
                scale["noop"].append(b.build(SCALE_TARGET, f"scale noop {i}"))
                with open(kernel_file, "a") as f:
                    f.write(f"\nint ipubuild_bench_scale_probe_{i}(int x) {{ return 5 * x + {i}; }}\n")
                progress(f"scale kernel body edit {i}/{scale_repeats} ...")
                scale["kernel_edit"].append(b.build(SCALE_TARGET, f"scale kernel edit {i}"))
            kernel_file.write_text(kernel_text)
        b.clean_cache()
    finally:
        if not args.keep_scratch:
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            progress(f"kept scratch tree and logs in {tmp}")

    info["loadavg_end"] = list(os.getloadavg())
    return assemble(info, args, repeats, scale_repeats, raw, floor, search, scale,
                    time.perf_counter() - started, str(tmp) if args.keep_scratch else None)


def _wall(samples):
    return [s["wall_s"] for s in samples]


def search_summary(samples: list[dict]) -> dict:
    rounds = [r for s in samples for r in s["search"]["measured"]]
    hit_by_round: dict[int, list] = {}
    prop_by_round: dict[int, list] = {}
    for r in rounds:
        hit_by_round.setdefault(r.get("round"), []).append(r.get("cache_hit_rate"))
        prop_by_round.setdefault(r.get("round"), []).append(r.get("proposals_per_s"))
    return {
        "runs": len(samples),
        "rounds": median([s["search"]["rounds"] for s in samples]),
        "proposals_per_s": median([r.get("proposals_per_s") for r in rounds]),
        "evaluations_per_s": median([r.get("evaluations_per_s") for r in rounds]),
        "proposals_per_s_by_round": {str(k): median(v) for k, v in sorted(prop_by_round.items())},
        "cache_hit_rate_by_round": {str(k): median(v) for k, v in sorted(hit_by_round.items())},
        "initial_cycles": median([s["search"]["initial_cycles"] for s in samples]),
        "final_cycles": median([s["search"]["final_cycles"] for s in samples]),
        "gain_pct": median([s["search"]["gain_pct"] for s in samples]),
        "search_ms": median([s["plan_package_ms"] for s in samples]),
        "candidate_ms": median([ms for s in samples for ms in s["candidate_ms"]]),
        "candidates": sum(len(s["candidate_ms"]) for s in samples),
        **{k: median([s.get("bounds", {}).get(k) for s in samples])
           for k in ("lower_bound", "peak_bound", "over_lower_bound", "over_peak_bound")},
        "build_wall_s": median(_wall(samples)),
        "deterministic": len({(s["search"]["initial_cycles"], s["search"]["final_cycles"]) for s in samples}) <= 1,
    }


def assemble(info, args, repeats, scale_repeats, raw, floor, search, scale, total_s, scratch) -> dict:
    clean, noop, warm, kedit, cedit = (raw[k] for k in ("clean", "noop", "warm", "kernel_edit", "comment_edit"))
    builds = {k: summarize(_wall(v)) for k, v in raw.items()}
    kernel_cost = [ratio_sum(s["compiled_ms"], s["run_device_ms"]) for s in kedit]
    device = {"run_device_ms": summarize([s["run_device_ms"] for s in clean]),
              "measure_kernels_ms": summarize([s.get("measure_kernels_ms") for s in clean]),
              "evaluate_reference_ms": summarize([s["evaluate_reference_ms"] for s in clean])}
    ratios = {
        "noop/clean": ratio_entry(_wall(noop), _wall(clean), "no-op rebuild wall / clean build wall"),
        "warm/clean": ratio_entry(_wall(warm), _wall(clean), "warm-cache rebuild wall / clean build wall"),
        "noop/import_doit": ratio_entry(
            floor["noop"], floor["import_doit"],
            "no-op rebuild wall / `python -c \"import doit\"` wall, alternating pairs (goal <= 1.5)"),
        "kernel_edit/(compile+device)": ratio_entry(
            [w * 1000.0 for w in _wall(kedit)], kernel_cost,
            "kernel edit rebuild wall / (the edited variant's compile ms + its run_device ms), from the edit "
            "build's log (goal <= 1.5)"),
        "simulator/reference": ratio_entry(
            [s["run_device_ms"] for s in clean], [s["evaluate_reference_ms"] for s in clean],
            "run_device ms / evaluate_reference ms, from the clean build's log"),
    }
    w1, w2 = search.get("1", []), search.get("2", [])
    rates = {w: median([r.get("evaluations_per_s") for s in v for r in s["search"]["measured"]])
             for w, v in (("1", w1), ("2", w2))}
    ratios["search workers=2/workers=1"] = {
        "what": "candidate evaluations per second with 2 workers / with 1 (medians over rounds; goal >= 1.6)",
        "median": ratio(rates["2"], rates["1"]), "of_medians": ratio(rates["2"], rates["1"]), "samples": []}
    if scale["clean"]:
        builds["scale_clean"] = summarize(_wall(scale["clean"]))
        builds["scale_noop"] = summarize(_wall(scale["noop"]))
        builds["scale_kernel_edit"] = summarize(_wall(scale["kernel_edit"]))
        ratios["scale noop/clean"] = ratio_entry(_wall(scale["noop"]), _wall(scale["clean"]),
                                                 f"{SCALE_TARGET} no-op wall / clean wall")
        ratios["scale simulator/reference"] = ratio_entry(
            [s["run_device_ms"] for s in scale["clean"]], [s["evaluate_reference_ms"] for s in scale["clean"]],
            f"{SCALE_TARGET}: run_device ms / evaluate_reference ms (goal <= 2)")
        ratios["scale clean/clean"] = ratio_entry(
            _wall(scale["clean"]), _wall(clean), f"{SCALE_TARGET} clean wall / {MAIN_TARGET} clean wall (goal <= 15)")
        ratios["scale kernel_edit/(compile+device)"] = ratio_entry(
            [w * 1000.0 for w in _wall(scale["kernel_edit"])],
            [ratio_sum(s["compiled_ms"], s["run_device_ms"]) for s in scale["kernel_edit"]],
            f"{SCALE_TARGET}: kernel edit wall / (compile ms + run_device ms)")
    observations = []
    for kind, samples in (("noop", noop), ("kernel_edit", kedit), ("comment_edit", cedit),
                          ("scale_noop", scale["noop"]), ("scale_kernel_edit", scale["kernel_edit"])):
        target = SCALE_TARGET if kind.startswith("scale") else MAIN_TARGET
        for s in samples:
            extra = unexpected_tasks(kind.removeprefix("scale_"), s["executed"], target)
            if extra:
                observations.append({"build": s["label"], "unexpected_executed": extra})
    for s in warm:
        if s["uncached_phases"]:
            observations.append({"build": s["label"], "note": "warm-cache rebuild ran phases that were not cache hits: "
                                 + " ".join(s["uncached_phases"])})
    for s in clean + [x for v in search.values() for x in v]:
        if s["search"]["resuming"]:
            observations.append({"build": s["label"], "note": "search resumed from saved state in a clean build"})
    return {
        "schema": SCHEMA,
        "when": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join([Path(sys.argv[0]).as_posix()] + sys.argv[1:]),
        "quick": bool(args.quick), "repeats": repeats, "scale_repeats": scale_repeats if scale["clean"] else 0,
        "total_s": round(total_s, 1), "machine": info, "scratch": scratch,
        "medians": {**{k: v["median"] for k, v in builds.items()},
                    "kernel_edit_compile_ms": median([s["compiled_ms"] for s in kedit]),
                    "kernel_edit_device_ms": median([s["run_device_ms"] for s in kedit]),
                    "comment_edit_compile_ms": median([s["compiled_ms"] for s in cedit]),
                    "run_device_ms": device["run_device_ms"]["median"],
                    "evaluate_reference_ms": device["evaluate_reference_ms"]["median"],
                    "noop_floor_s": median(floor["noop"]), "import_doit_s": median(floor["import_doit"]),
                    "candidate_ms": median([ms for v in search.values() for s in v for ms in s["candidate_ms"]]),
                    "scale_candidate_ms": median([ms for s in scale["clean"] for ms in s["candidate_ms"]]),
                    "scale_peak_pss_mib": median([s["peak_pss_mib"] for s in scale["clean"]]),
                    "scale_run_device_ms": median([s["run_device_ms"] for s in scale["clean"]]),
                    "scale_evaluate_reference_ms": median([s["evaluate_reference_ms"] for s in scale["clean"]])},
        "builds": builds,
        "device_vs_reference": device,
        "search": {w: search_summary(v) for w, v in search.items()},
        "ratios": ratios,
        "observations": observations,
        "raw": {**raw, "floor": floor, "search": search, "scale": scale},
    }


def goals(res: dict) -> list[str]:
    """Issue 26's figures side by side: each as measured in this run, and its goal (ratios of
    this run's own figures). Peak memory is the sum of PSS over the build's process tree
    (``pss.TreeSampler``), as the issue asks."""
    md, r = res["medians"], res["ratios"]
    rows = [("ViT-B/16 candidate exact evaluation, median ms", md.get("scale_candidate_ms"), "<= 5000", "{:.0f}"),
            ("ViT-B/16 clean / vit_fp8 clean", r.get("scale clean/clean", {}).get("median"), "<= 15", "{:.1f}"),
            ("ViT-B/16 peak memory MiB (process tree PSS)", md.get("scale_peak_pss_mib"), "<= 2560", "{:.0f}"),
            ("simulator / reference, vit_fp8", r.get("simulator/reference", {}).get("median"), "<= 2", "{:.2f}"),
            ("simulator / reference, ViT-B/16", r.get("scale simulator/reference", {}).get("median"), "<= 2", "{:.2f}"),
            ("vit_fp8 candidate, median ms", md.get("candidate_ms"), "<= 30", "{:.0f}"),
            ("kernel edit / (compile + device), vit_fp8", r.get("kernel_edit/(compile+device)", {}).get("median"),
             "<= 1.5", "{:.2f}"),
            ("no-op vit_fp8 / import doit", r.get("noop/import_doit", {}).get("median"), "<= 1.2", "{:.2f}")]
    return [f"{name:<46} {_f(value, fmt):>10}   goal {goal}" for name, value, goal, fmt in rows]


def ratio_sum(a, b):
    return None if a is None or b is None else a + b


# the table --------------------------------------------------------------------------------------
def _f(v, fmt="{:.3f}") -> str:
    if v is None:
        return "-"
    if isinstance(v, str):
        return v
    return fmt.format(v)


def table(res: dict) -> str:
    m = res["machine"]
    lines = [f"ipubuild benchmarks  {res['when']}  commit {str(m['git_commit'])[:10]}{' (dirty)' if m['git_dirty'] else ''}"
             f"  nproc {m['nproc']}  python {m['python']}  {m['cc_version']}",
             f"repeats {res['repeats']}  (medians; ratios are medians of per-repeat ratios)", ""]
    names = {"clean": f"clean build ({MAIN_TARGET})", "noop": "no-op rebuild", "warm": "warm-cache rebuild",
             "kernel_edit": "kernel body edit", "comment_edit": "comment-only edit",
             "scale_clean": f"scale clean ({SCALE_TARGET})", "scale_noop": "scale no-op",
             "scale_kernel_edit": "scale kernel body edit"}
    lines.append(f"{'build':<30} {'n':>3} {'median s':>10} {'min s':>10} {'max s':>10}")
    for k, v in res["builds"].items():
        lines.append(f"{names.get(k, k):<30} {v['n']:>3} {_f(v['median']):>10} {_f(v['min']):>10} {_f(v['max']):>10}")
    md = res["medians"]
    lines += ["", f"{'no-op / import doit (s)':<36} {_f(md['noop_floor_s']):>10} {_f(md['import_doit_s']):>10}",
              f"{'candidate evaluation ms (median)':<36} {_f(md['candidate_ms'], '{:.0f}'):>10}",
              f"{'scale: candidate evaluation ms':<36} {_f(md.get('scale_candidate_ms'), '{:.0f}'):>10}",
              f"{'kernel edit: compile ms':<36} {_f(md['kernel_edit_compile_ms'], '{:.0f}'):>10}",
              f"{'kernel edit: run_device ms':<36} {_f(md['kernel_edit_device_ms'], '{:.0f}'):>10}",
              f"{'comment edit: compile ms':<36} {_f(md['comment_edit_compile_ms'], '{:.0f}'):>10}",
              f"{'scale: peak memory MiB (tree PSS)':<36} {_f(md['scale_peak_pss_mib'], '{:.0f}'):>10}",
              f"{'scale: run_device / reference ms':<36} {_f(md['scale_run_device_ms'], '{:.0f}'):>10} "
              f"{_f(md['scale_evaluate_reference_ms'], '{:.0f}'):>10}",
              f"{'clean: run_device ms (simulator)':<36} {_f(md['run_device_ms'], '{:.0f}'):>10}",
              f"{'clean: evaluate_reference ms (host)':<36} {_f(md['evaluate_reference_ms'], '{:.0f}'):>10}", ""]
    lines.append(f"{'search':<11} {'rounds':>6} {'prop/s':>9} {'eval/s':>7} {'cand ms':>7} {'hit rate by round':<20} "
                 f"{'prop/s by round':<20} "
                 f"{'initial':>8} {'final':>8} {'gain %':>7} {'search ms':>9} {'lower bd':>8} {'x':>5} "
                 f"{'peak bd':>8} {'x':>5}")
    for w, s in res["search"].items():
        hits = " ".join(_f(v, "{:.2f}") for v in s["cache_hit_rate_by_round"].values()) or "-"
        props = " ".join(_f(v, "{:.0f}") for v in s["proposals_per_s_by_round"].values()) or "-"
        lines.append(f"{'workers=' + w:<11} {_f(s['rounds'], '{:g}'):>6} {_f(s['proposals_per_s'], '{:.0f}'):>9} "
                     f"{_f(s['evaluations_per_s'], '{:.2f}'):>7} {_f(s['candidate_ms'], '{:.0f}'):>7} "
                     f"{hits:<20} {props:<20} {_f(s['initial_cycles'], '{:.0f}'):>8} "
                     f"{_f(s['final_cycles'], '{:.0f}'):>8} {_f(s['gain_pct'], '{:.2f}'):>7} "
                     f"{_f(s['search_ms'], '{:.0f}'):>9} {_f(s.get('lower_bound'), '{:.0f}'):>8} "
                     f"{_f(s.get('over_lower_bound'), '{:.2f}'):>5} {_f(s.get('peak_bound'), '{:.0f}'):>8} "
                     f"{_f(s.get('over_peak_bound'), '{:.2f}'):>5}")
    lines += ["", f"{'ratio':<30} {'median':>8} {'of medians':>11}  per repeat"]
    for k, r in res["ratios"].items():
        per = " ".join(_f(x) for x in r["samples"])
        lines.append(f"{k:<30} {_f(r['median']):>8} {_f(r['of_medians']):>11}  {per}")
    lines += ["", "issue 26's figures (measured here / goal):"] + [f"  {line}" for line in goals(res)]
    if res["observations"]:
        lines += ["", "observations:"]
        for o in res["observations"]:
            lines.append(f"  {o['build']}: " + (f"executed unexpectedly: {' '.join(o['unexpected_executed'])}"
                                                if "unexpected_executed" in o else o["note"]))
    lines += ["", f"total {res['total_s']} s; load average {m['loadavg_start'][0]:.2f} -> {m['loadavg_end'][0]:.2f}"]
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="ipubuild's performance harness (see benchmarks/README.md)")
    p.add_argument("--repeats", type=int, default=None,
                   help="repeats of each measurement (default 3; also the scale builds' repeats, default 1)")
    p.add_argument("--quick", action="store_true", help="one repeat of everything, no scale builds")
    p.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "latest.json"), help="JSON output path")
    p.add_argument("--keep-scratch", action="store_true", help="keep the scratch tree and build logs")
    args = p.parse_args(argv)
    if args.repeats is not None and args.repeats < 1:
        p.error("--repeats must be at least 1")
    try:
        res = run(args)
    except BuildFailed as exc:
        print(f"[bench] error: {exc}", file=sys.stderr)
        return 1
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(json.dumps(res, indent=1) + "\n")
    tmp.replace(out)
    print(table(res))
    progress(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
