"""Building on a Dask cluster (``IPUBUILD_SCHEDULER``), with real processes: ``dask scheduler``
and ``dask worker`` processes on 127.0.0.1 free ports, started by these tests, and whole builds of
the small target of tests/buildtree.py through doit. Skipped, saying so, only when the
``distributed`` extra is not installed (``.ci/run`` installs it).

The same package bit for bit with no cluster, 1, 2 and 3 workers, and the same accepted layouts in
the same order; the work really ran on the workers; a worker killed or restarted while a task runs
on it, a scheduler unreachable at the start or killed mid-build, a worker whose results do not
verify: the same package; a worker running other code: one line and a failed build; a no-op build
with the scheduler set imports no ``distributed``.
"""
from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from buildtree import assert_passed, copy_ipubuild, doit, env, make_tree, package, start

from ipubuild.engine import executors
from ipubuild.errors import UserError

NAME = "small"
HERE = Path(__file__).resolve().parent
DASK = Path(sys.executable).with_name("dask")

try:
    import distributed  # noqa: F401
    import psutil
except ImportError:     # pragma: no cover - the extra is installed by .ci/run
    distributed = None
needs_dask = pytest.mark.skipif(distributed is None or not DASK.exists(), reason=(
    "the distributed extra is not installed (pip install -e '.[distributed]'; .ci/run installs it)"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class DaskCluster:
    """``dask scheduler`` and ``workers`` ``dask worker`` processes (one process, one thread
    each, as the acceptance check starts them) on loopback; workers import ``code``'s ipubuild."""

    def __init__(self, root: Path, code: Path, workers: int, shims: dict[int, str] | None = None):
        self.root, self.code = Path(root), code
        self.root.mkdir(parents=True, exist_ok=True)
        self.port = _free_port()
        self.address = f"tcp://127.0.0.1:{self.port}"
        self.workers: list[subprocess.Popen] = []
        self.scheduler = self._spawn("scheduler", ["scheduler", "--host", "127.0.0.1", "--port", str(self.port),
                                                   "--no-dashboard"])
        for i in range(workers):
            self.add_worker((shims or {}).get(i))
        self.wait_for(workers)

    def _spawn(self, name: str, args: list[str], **extra) -> subprocess.Popen:
        e = env(self.code, PYTHONUNBUFFERED="1", **extra)
        log = open(self.root / f"{name}.log", "a")
        return subprocess.Popen([str(DASK), *args], cwd=self.root, stdout=log, stderr=subprocess.STDOUT,
                                env=e, start_new_session=True)

    def add_worker(self, shim: str | None = None) -> subprocess.Popen:
        args = ["worker", self.address, "--nworkers", "1", "--nthreads", "1", "--host", "127.0.0.1",
                "--no-dashboard"]
        extra = {}
        if shim:
            args += ["--preload", str(HERE / "cluster_shim.py")]
            extra["IPUBUILD_TEST_SHIM"] = shim
        w = self._spawn(f"worker{len(self.workers)}", args, **extra)
        self.workers.append(w)
        return w

    def wait_for(self, n: int, timeout: float = 90) -> None:
        client = distributed.Client(self.address, timeout=timeout, set_as_default=False)
        try:
            client.wait_for_workers(n, timeout=timeout)
        finally:
            client.close()

    def worker_process(self, i: int) -> psutil.Process:
        """The process that runs worker ``i``'s tasks (the child its nanny spawned; the other
        child is multiprocessing's resource tracker)."""
        kids = [k for k in psutil.Process(self.workers[i].pid).children()
                if "spawn_main" in " ".join(k.cmdline()) and k.status() != psutil.STATUS_ZOMBIE]
        assert len(kids) == 1, f"worker {i}: {kids}"
        return kids[0]

    def cpu_seconds(self) -> float:
        """CPU seconds the worker processes (nannies and their children) used so far."""
        total = 0.0
        for w in self.workers:
            try:
                for p in [psutil.Process(w.pid), *psutil.Process(w.pid).children(recursive=True)]:
                    t = p.cpu_times()
                    total += t.user + t.system
            except psutil.NoSuchProcess:
                pass
        return total

    def kill_worker(self, i: int, *, restart: bool = False) -> None:
        """``kill -9`` worker ``i``'s task process; unless ``restart``, its nanny first (gone
        for good), else the nanny starts a new worker process."""
        proc = self.worker_process(i)
        if not restart:
            os.kill(self.workers[i].pid, signal.SIGKILL)
        proc.kill()

    def stop(self) -> None:
        for p in [*self.workers, self.scheduler]:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            p.wait()

    def logs(self) -> str:
        return "\n".join(f"--- {p.name} ---\n{p.read_text()[-2000:]}" for p in sorted(self.root.glob("*.log")))


@pytest.fixture(scope="module")
def reference(code, tmp_path_factory):
    """The package and the accepted layouts of a build with no cluster."""
    tree = make_tree(tmp_path_factory.mktemp("local"))
    run = doit(tree, f"build:{NAME}", environ=env(code))
    assert_passed(run, NAME)
    return package(tree, NAME), accepted(run)


@pytest.fixture(scope="module")
def two(code, tmp_path_factory):
    c = DaskCluster(tmp_path_factory.mktemp("two"), code, 2)
    yield c
    c.stop()


def accepted(run) -> list[str]:
    """The search's accepted improvements and retained incumbents, in order."""
    return re.findall(r"(accepted local layout improvement .*|accepted tile mapping .*|retained incumbent .*)$",
                      run.stderr, re.M)


def build_on(cluster, tree: Path, **extra):
    return doit(tree, f"build:{NAME}", environ=env(cluster.code if cluster else None,
                                                   IPUBUILD_SCHEDULER=cluster.address if cluster else "", **extra))


def build_on_own_cluster(code, tmp_path: Path, workers: int, shims: dict | None = None):
    """(tree, run): a fresh tree built on a cluster of its own (``workers``, shimmed as
    ``DaskCluster`` says), which is stopped after the build."""
    c = DaskCluster(tmp_path / "cluster", code, workers, shims)
    try:
        tree = make_tree(tmp_path / "tree")
        return tree, build_on(c, tree)
    finally:
        c.stop()


def warnings(text: str) -> list[str]:
    return [ln for ln in text.splitlines() if " WARN " in ln]


def trace_events(tree: Path) -> list[dict]:
    return json.loads((tree / "artifacts" / NAME / "build.trace.json").read_text())["traceEvents"]


# --- settings --------------------------------------------------------------------------------------

def test_no_scheduler_means_here(monkeypatch):
    monkeypatch.delenv("IPUBUILD_SCHEDULER", raising=False)
    assert executors.scheduler() is None and executors.cluster() is None
    monkeypatch.setenv("IPUBUILD_SCHEDULER", "  ")
    assert executors.scheduler() is None


@pytest.mark.parametrize("value, want", [("tcp://10.0.0.5:8786", "tcp://10.0.0.5:8786"),
                                         ("sched.example:8786", "tcp://sched.example:8786"),
                                         ("tls://[::1]:8786", "tls://[::1]:8786")])
def test_scheduler_addresses(monkeypatch, value, want):
    monkeypatch.setenv("IPUBUILD_SCHEDULER", value)
    assert executors.scheduler() == want


@pytest.mark.parametrize("value", ["sched.example", "http://x:1/path", "tcp://host:port", "a b:1"])
def test_a_bad_scheduler_address_is_one_line(monkeypatch, value):
    monkeypatch.setenv("IPUBUILD_SCHEDULER", value)
    with pytest.raises(UserError, match=r"^IPUBUILD_SCHEDULER: expected a scheduler address such as tcp://host:8786"):
        executors.scheduler()


def test_the_cluster_module_stays_out_of_fingerprints_and_light_paths():
    from ipubuild.engine.fingerprint import closure
    for module in ("ipubuild.compiler.planning.phases", "ipubuild.compiler.kernels", "ipubuild.compiler.search"):
        assert "ipubuild.remote.cluster" not in closure(module)
    code = ("import sys; import ipubuild.build, ipubuild.search, ipubuild.engine.executors; "
            "print([m for m in ('distributed', 'dask', 'ipubuild.remote.cluster') if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env=env(IPUBUILD_SCHEDULER="tcp://127.0.0.1:1"))
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


@needs_dask
def test_a_bad_setting_fails_the_build_in_one_line(code, reference, tmp_path):
    tree = make_tree(tmp_path / "tree")
    run = doit(tree, f"build:{NAME}", environ=env(code, IPUBUILD_SCHEDULER="nowhere"))
    assert run.returncode != 0 and "Traceback" not in run.output
    assert run.error_lines == ["error: IPUBUILD_SCHEDULER: expected a scheduler address such as tcp://host:8786, "
                               "got 'nowhere'"], run.tail()


# --- builds on a cluster -----------------------------------------------------------------------------

@needs_dask
def test_the_same_package_on_two_workers_and_they_did_the_work(two, reference, tmp_path):
    want, layouts = reference
    tree = make_tree(tmp_path / "tree")
    cpu0 = two.cpu_seconds()
    run = build_on(two, tree)
    assert_passed(run, NAME)
    assert package(tree, NAME) == want
    assert accepted(run) == layouts
    assert warnings(run.stderr) == [], run.tail()
    # every kind of work went to the cluster, and the workers' processes spent the CPU
    for what in ("compile_kernel", "build_tile_image"):
        assert re.search(rf"ran on the cluster work={what} calls=\d+ here=0 ", run.stderr), run.tail()
    on_workers = re.findall(r"evaluated local candidate .* worker=(tcp://\S+)", run.stderr)
    assert on_workers and not re.search(r"evaluated local candidate (?!.*worker=)", run.stderr)
    assert two.cpu_seconds() - cpu0 > 0.5
    events = [e for e in trace_events(tree) if e["name"].startswith("worker:")]
    assert {e["name"] for e in events} == {"worker:compile_kernel", "worker:compile_counted_kernel",
                                           "worker:build_tile_image", "worker:candidate"}
    assert sum(float(e["args"]["cpu_seconds"]) for e in events) > 0.2
    # a rebuild is a no-op that does not even import distributed
    assert _noop_imports(tree, two) == []


def _noop_imports(tree: Path, cluster) -> list[str]:
    """The ``distributed``/``dask`` modules a no-op ``doit build`` imports (``-X importtime``)."""
    p = subprocess.run([sys.executable, "-X", "importtime", "-m", "doit", f"build:{NAME}"], cwd=tree,
                       capture_output=True, text=True, env=env(cluster.code, IPUBUILD_SCHEDULER=cluster.address),
                       timeout=120)
    assert p.returncode == 0 and "build:" in p.stdout, p.stdout + p.stderr
    assert not re.findall(r"^\.  (?!build:)", p.stdout, re.M), p.stdout      # nothing but build: ran
    return sorted({m for m in re.findall(r"\|\s+(\S+)\s*$", p.stderr, re.M)
                   if m.split(".")[0] in ("distributed", "dask") or m == "ipubuild.remote.cluster"})


@needs_dask
@pytest.mark.parametrize("workers", [1, 3])
def test_the_same_package_and_layouts_on_one_and_three_workers(code, reference, workers, tmp_path):
    want, layouts = reference
    tree, run = build_on_own_cluster(code, tmp_path, workers)
    assert_passed(run, NAME)
    assert package(tree, NAME) == want and accepted(run) == layouts
    assert f"workers={workers} threads={workers}" in run.stderr


# --- faults -------------------------------------------------------------------------------------------

def _when_running(folder: Path, p: subprocess.Popen, log: Path, timeout: float = 120) -> None:
    """Wait until a slowed worker has a candidate in flight (its marker file appears)."""
    deadline = time.monotonic() + timeout
    while not list(folder.glob("running-*")):
        assert p.poll() is None, f"the build ended before a candidate ran on the slow worker\n{log.read_text()[-3000:]}"
        assert time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.05)


@needs_dask
@pytest.mark.parametrize("restart", [False, True], ids=["killed", "restarted"])
def test_a_worker_killed_mid_search_changes_only_time(code, reference, restart, tmp_path):
    want, layouts = reference
    marks = tmp_path / "marks"
    marks.mkdir()
    c = DaskCluster(tmp_path / "cluster", code, 2, shims={0: f"slow:{marks}"})
    try:
        tree = make_tree(tmp_path / "tree")
        log = tmp_path / "build.log"
        p = start(tree, f"build:{NAME}", log=log, environ=env(code, IPUBUILD_SCHEDULER=c.address))
        _when_running(marks, p, log)
        victim = c.worker_process(0).pid
        c.kill_worker(0, restart=restart)
        rc = p.wait(timeout=300)
        if restart:        # the nanny started a new worker process, which joined the cluster
            c.wait_for(2)
            assert c.worker_process(0).pid != victim
    finally:
        c.stop()
    out = log.read_text()
    assert rc == 0 and "numericalTest=PASS" in out and "Traceback" not in out, out[-3000:] + c.logs()
    assert package(tree, NAME) == want
    assert accepted_text(out) == layouts
    assert not [w for w in warnings(out) if "cluster" in w], out      # Dask re-ran the lost task


def accepted_text(text: str) -> list[str]:
    return re.findall(r"(accepted local layout improvement .*|accepted tile mapping .*|retained incumbent .*)$",
                      text, re.M)


@needs_dask
def test_a_scheduler_lost_mid_build_falls_back_here(code, reference, tmp_path):
    want, layouts = reference
    marks = tmp_path / "marks"
    marks.mkdir()
    c = DaskCluster(tmp_path / "cluster", code, 1, shims={0: f"slow:{marks}"})
    try:
        tree = make_tree(tmp_path / "tree")
        log = tmp_path / "build.log"
        t0 = time.monotonic()
        p = start(tree, f"build:{NAME}", log=log, environ=env(code, IPUBUILD_SCHEDULER=c.address))
        _when_running(marks, p, log)
        os.killpg(c.scheduler.pid, signal.SIGKILL)
        rc = p.wait(timeout=300)
        elapsed = time.monotonic() - t0
    finally:
        c.stop()
    out = log.read_text()
    assert rc == 0 and "numericalTest=PASS" in out and "Traceback" not in out, out[-3000:]
    assert package(tree, NAME) == want and accepted_text(out) == layouts
    lost = [w for w in warnings(out) if "cluster" in w]
    assert len(lost) == 1 and "lost the cluster; running the rest of the build here" in lost[0], lost
    assert elapsed < 100, elapsed       # bounded: no waiting for the stall timeout


@needs_dask
def test_an_unreachable_scheduler_is_one_warning_and_a_local_build(code, reference, tmp_path):
    want, _ = reference
    tree = make_tree(tmp_path / "tree")
    address = f"tcp://127.0.0.1:{_free_port()}"
    t0 = time.monotonic()
    run = doit(tree, f"build:{NAME}", environ=env(code, IPUBUILD_SCHEDULER=address,
                                                   IPUBUILD_SCHEDULER_CONNECT_TIMEOUT="2"))
    assert_passed(run, NAME)
    assert package(tree, NAME) == want
    lines = [w for w in warnings(run.stderr) if "cluster" in w]
    assert len(lines) == 1 and "cluster scheduler unavailable; building here" in lines[0], lines
    assert address in lines[0]
    assert time.monotonic() - t0 < 90


@needs_dask
def test_results_that_do_not_verify_never_enter_the_store(code, reference, tmp_path):
    want, _ = reference
    tree, run = build_on_own_cluster(code, tmp_path, 1, shims={0: "lie"})
    assert_passed(run, NAME)
    assert package(tree, NAME) == want
    refused = [w for w in warnings(run.stderr) if "do not verify" in w]
    assert refused and all("running the call here" in w for w in refused)
    assert re.search(r"ran on the cluster work=build_tile_image calls=(\d+) here=\1 ", run.stderr), run.tail()
    # and the store: every blob verifies and every action record names blobs it holds
    from test_reliability import store_problems
    assert store_problems(tree) == []


@needs_dask
def test_candidates_a_worker_lies_about_are_evaluated_here(code, reference, tmp_path):
    """A worker claiming every candidate 1000 cycles cheaper than it is: its claims do not match
    the cost its own artifacts give, so each is evaluated here, and the search is a local one's."""
    want, layouts = reference
    tree, run = build_on_own_cluster(code, tmp_path, 1, shims={0: "lie-candidates"})
    assert_passed(run, NAME)
    assert package(tree, NAME) == want and accepted(run) == layouts
    refused = [w for w in warnings(run.stderr) if "candidate that does not verify" in w]
    assert refused and all("evaluating it here" in w for w in refused), run.tail()


@needs_dask
@pytest.mark.parametrize("module", ["compiler/planning/phases.py", "compiler/search.py"])   # search.py: candidates' code
def test_a_worker_running_other_code_is_refused_in_one_line(code, reference, tmp_path, module):
    other = tmp_path / "other"
    copy_ipubuild(other, code)
    phases = other / "ipubuild" / module
    phases.write_text(phases.read_text() + "\n\nOTHER = 1\n")     # a code change: other action keys
    c = DaskCluster(tmp_path / "cluster", other, 1)
    try:
        tree = make_tree(tmp_path / "tree")
        run = doit(tree, f"build:{NAME}", environ=env(code, IPUBUILD_SCHEDULER=c.address))
    finally:
        c.stop()
    assert run.returncode != 0 and "Traceback" not in run.output, run.tail()
    assert len(run.error_lines) == 1, run.tail()
    assert re.fullmatch(r"error: IPUBUILD_SCHEDULER: worker tcp://127\.0\.0\.1:\d+ runs other ipubuild code than "
                        r"this build \(phase \w+\); run the workers with the same ipubuild and plugins, or unset "
                        r"IPUBUILD_SCHEDULER", run.error_lines[0]), run.error_lines
    # the cache is intact: without the cluster the tree builds
    again = doit(tree, f"build:{NAME}", environ=env(code))
    assert_passed(again, NAME)
    assert package(tree, NAME) == reference[0]


# --- the benchmark's arithmetic ----------------------------------------------------------------------

def test_the_benchmark_reads_the_share_and_the_prediction_from_a_trace():
    import importlib.util
    spec = importlib.util.spec_from_file_location("bench_cluster", HERE.parent / "benchmarks" / "cluster.py")
    bc = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bc)

    def ev(name, ts, dur, **args):
        return {"name": name, "ph": "X", "ts": ts * 1e6, "dur": dur * 1e6, "pid": 1, "tid": 1, "args": args}
    w = dict(worker="tcp://w", cpu_seconds=1.0, bytes_sent=10, bytes_returned=20)
    events = [ev("doit build:t", 0, 20),
              ev("build", 1, 9), ev("plan_package", 1, 9),
              ev("build", 10, 1), ev("plan_package", 10, 1), ev("place_storage", 10, 0.5),
              ev("cluster", 2, 6, work="candidates"),                   # 3 candidates: 4 + 4 + 2 s of work
              ev("worker:candidate", 2, 4, seconds=4, **w), ev("worker:candidate", 3, 4, seconds=4, **w),
              ev("worker:candidate", 6, 2, seconds=2, **w),
              ev("build", 12, 4), ev("build_tile_images", 12, 4),
              ev("cluster", 12, 2, work="build_tile_image"),            # 2 chunks: 1 + 1 s
              ev("worker:build_tile_image", 12, 1, seconds=1, **w), ev("worker:build_tile_image", 13, 1, seconds=1, **w)]
    f = bc.trace_figures(events)
    assert f["build_s"] == 20 and f["dispatched_s"] == 8 and f["serial_s"] == 12 and f["worker_s"] == 12
    assert f["share"] == 0.5
    # each dispatch lasts at least its longest task: 12 + max(10/16, 4) + max(2/16, 1)
    assert f["predicted_s"]["16"] == 17 and f["limit_s"] == 17 and f["amdahl_s"]["16"] == 12 + 12 / 16
    assert f["by_kind"]["candidate"]["tasks"] == 3 and f["by_kind"]["candidate"]["dispatch_wall_s"] == 6
    assert f["by_kind"]["build_tile_image"]["bytes_returned"] == 40
    assert dict(f["serial_phases"]) == {"plan_package": 3.0, "build_tile_images": 2.0, "place_storage": 0.5}


def test_a_plain_tcp_scheduler_off_this_machine_is_warned_once(monkeypatch):
    from ipubuild.engine import executors
    from ipubuild.log import log
    warned = []
    monkeypatch.setattr(log, "warning", lambda message, **kv: warned.append(message))
    monkeypatch.setattr(executors, "_warned", set())
    for address in ("tcp://127.0.0.1:8786", "localhost:8786", "tls://10.0.0.7:8786", "tcp://[::1]:8786"):
        monkeypatch.setenv("IPUBUILD_SCHEDULER", address)
        executors.scheduler()
    assert warned == []
    monkeypatch.setenv("IPUBUILD_SCHEDULER", "tcp://10.0.0.7:8786")
    executors.scheduler()
    executors.scheduler()
    assert len(warned) == 1 and "tcp://10.0.0.7:8786" in warned[0] and "tls://" in warned[0]
