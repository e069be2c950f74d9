"""Running a build's independent work on a Dask cluster (``$IPUBUILD_SCHEDULER``).

The client side (``Cluster``) sends phase calls (tile images, kernel compiles) and search
candidates to the scheduler as Dask tasks and takes their results back in submission order. A
task carries everything it needs — the phase name, its input digests *and their bytes*, the
configuration and the action key this build expects — so workers share no filesystem and no
cache with the client: Dask moves the bytes (through the scheduler, which keeps each task's
payload until it has run: a task whose worker dies is simply run again elsewhere). A worker runs
the call through an ``Engine`` over a store of its own (a temporary folder, kept for the
worker's life, so identical sub-phases of later tasks are hits there) and returns the output
digests and bytes; the client checks the action key and every blob's sha256 before anything
enters its store, and records it exactly as a local run would (outputs, provenance, action).

A worker refuses a call whose action key it computes differently — other ipubuild code, plugins,
Python toolchain, or (for a compile) another C compiler — and the build stops with one line
naming the worker and what differs: such a cluster would silently do nothing useful. A call that
fails on a worker with a user error (a compile error, say) is run again here, so that its error
reads exactly as in a local build.

Faults cost time, never the result, and never hang: connecting is bounded
(``$IPUBUILD_SCHEDULER_CONNECT_TIMEOUT``, 5 s); a scheduler that cannot be reached, has no
worker, is lost, or lets ``$IPUBUILD_SCHEDULER_TIMEOUT`` (120 s) pass with no task finishing
costs one warning, and what is left runs here for the rest of the process. Workers killed or
restarted mid-build are Dask's business: it runs their tasks again on the others.

This module imports ``distributed``; ``ipubuild.executors`` imports it by name, only when a
scheduler is set and there is work to send. It only moves work whose results it verifies, so it
stays out of the phases' code fingerprints.
"""
from __future__ import annotations

import atexit
import os
import resource
import shutil
import tempfile
import threading
import time
import uuid
from pathlib import Path

from ..engine import canonical
from ..engine.engine import PHASES, Engine, MissingBlob, Result, config_subset, toolchain
from ..engine.errors import UserError
from ..engine.log import log, record, span

WORKER_CACHE_BYTES = 2 * 2**30       # a worker's own store, trimmed after every task
TICK = 0.5                           # seconds between liveness checks while waiting
CHUNK_CALLS = 16                     # phase calls per task at most
CHUNK_BYTES = 16 * 2**20             # input bytes per task at most (beyond one call's)


def _seconds(var: str, default: float) -> float:
    raw = os.environ.get(var, "").strip()
    try:
        value = float(raw) if raw else default
    except ValueError:
        raise UserError(var, f"expected a number of seconds, got {raw!r}") from None
    if value <= 0:
        raise UserError(var, f"expected a positive number of seconds, got {raw!r}")
    return value


def connect_timeout() -> float:
    return _seconds("IPUBUILD_SCHEDULER_CONNECT_TIMEOUT", 5.0)


def stall_timeout() -> float:
    return _seconds("IPUBUILD_SCHEDULER_TIMEOUT", 120.0)


class Lost(Exception):
    """The cluster cannot be used any more (unreachable, lost, no workers, stalled)."""


class Mismatch(Exception):
    """A worker would compute other action keys than this build."""


# the process's connection ------------------------------------------------------------------------
_state: dict = {"pid": None, "cluster": None, "down": None}
_state_lock = threading.Lock()


def connect(address: str) -> "Cluster | None":
    """This process's cluster at ``address``: connected on first use; None (after one warning)
    if it cannot be reached or was lost earlier in this process."""
    with _state_lock:
        if _state["pid"] != os.getpid():      # a forked child never uses its parent's client
            _state.update(pid=os.getpid(), cluster=None, down=None)
        if _state["down"] is not None or _state["cluster"] is not None:
            return _state["cluster"]
        try:
            _state["cluster"] = Cluster(address)
        except Lost as exc:
            _state["down"] = str(exc)
            log.warning("cluster scheduler unavailable; building here", scheduler=address, why=f'"{exc}"')
        return _state["cluster"]


def _give_up(cluster: "Cluster", why: str) -> None:
    """Stop using the cluster for the rest of the process (one warning)."""
    with _state_lock:
        if _state["cluster"] is cluster:
            _state.update(cluster=None, down=why)
    log.warning("lost the cluster; running the rest of the build here", scheduler=cluster.address,
                why=f'"{why}"')
    cluster.close()


class Cluster:
    """A connection to a Dask scheduler, and the work ipubuild sends to it."""

    def __init__(self, address: str):
        import logging

        import distributed
        # a lost scheduler is reported in one warning line, not in distributed's tracebacks
        for name in ["distributed", *logging.root.manager.loggerDict]:
            if name.split(".")[0] == "distributed":
                logging.getLogger(name).setLevel(logging.CRITICAL)
        self.distributed, self.address = distributed, address
        self.timeout, self.stall = connect_timeout(), stall_timeout()
        try:
            self.client = distributed.Client(address, timeout=self.timeout, set_as_default=False,
                                             name=f"ipubuild-{os.getpid()}")
        except Exception as exc:  # noqa: BLE001 - OSError, TimeoutError, a bad address: all mean "not here"
            raise Lost(f"cannot connect within {self.timeout:g} s ({type(exc).__name__}: {exc})") from None
        try:
            self.client.wait_for_workers(1, timeout=self.timeout)
        except Exception:  # noqa: BLE001
            self.close()
            raise Lost(f"has no workers (waited {self.timeout:g} s)") from None
        self._threads, self._asked, self._no_workers = self._nthreads(), time.monotonic(), None
        self._warming: list = []
        atexit.register(self.close)
        log.info("connected to the cluster", scheduler=address, workers=len(self._threads),
                 threads=sum(self._threads.values()))

    def close(self) -> None:
        client, self.client = getattr(self, "client", None), None
        if client is not None:
            try:
                client.close(timeout=2)
            except Exception:  # noqa: BLE001 - closing a lost connection may fail; nothing is left to do
                pass

    # phase calls -------------------------------------------------------------------------------
    def run_phases(self, engine, calls: list[tuple]) -> list[Result]:
        """``executors.run_phases`` on the cluster: hits answered here, the rest sent in chunks;
        what cannot run there (lost cluster, a failing call, a bad blob) runs here."""
        results: list = [None] * len(calls)
        todo = []
        for i, (name, inputs, config) in enumerate(calls):
            key = engine.action_key(PHASES[name], inputs, config)
            if engine.store.get_action(key) is not None:
                results[i] = engine.run(name, inputs, config)        # a hit: nothing to send
            else:
                todo.append((i, key))
        chunks = self._chunks(engine, calls, todo)
        what = calls[todo[0][0]][0] if todo else ""

        def take(c: int, ok: bool, value) -> None:
            if not ok:
                log.info("a cluster task failed; running its calls here", work=what, error=_short(value))
                return
            for (i, key), got in zip(chunks[c]["index"], value["results"]):
                name, inputs, config = calls[i]
                if "mismatch" in got:
                    raise Mismatch(self._mismatch(engine, PHASES[name], config, value["worker"], got["mismatch"]))
                if "error" in got:
                    continue                         # run here: its error then reads as a local build's
                if got.get("key") != key or not _verified(PHASES[name], got):
                    log.warning("a cluster worker returned results that do not verify; running the call here",
                                worker=value["worker"], phase=name)
                    continue
                _record(engine, name, inputs, config, key, got)
                results[i] = Result(dict(got["outputs"]), False, int(got["seconds"] * 1000), key)
            _trace(f"worker:{what}", value, sum(map(len, chunks[c]["payload"]["blobs"].values())),
                   sum(len(b) for got in value["results"] for b in got.get("blobs", {}).values()))

        if chunks:
            with span("cluster", work=what, calls=len(todo), tasks=len(chunks)):
                self._map(_run_calls, [c["payload"] for c in chunks], take, what)
            log.info("ran on the cluster", work=what, calls=len(todo),
                     here=sum(r is None for r in results), tasks=len(chunks))
        failure = None
        for i, (name, inputs, config) in enumerate(calls):
            if results[i] is None:
                try:
                    results[i] = engine.run(name, inputs, config)
                except (UserError, MissingBlob) as exc:
                    failure = failure or exc
        if failure is not None:
            raise failure
        return results

    def _chunks(self, engine, calls, todo) -> list[dict]:
        """The calls to send, a few per task (about two tasks per worker thread, so that the
        cluster stays busy and tasks amortise their overhead), each with its input blobs."""
        if not todo:
            return []
        per = max(1, min(CHUNK_CALLS, -(-len(todo) // (2 * max(1, sum(self._threads.values()))))))
        out, chunk, size = [], None, 0
        for i, key in todo:
            name, inputs, config = calls[i]
            blobs = {d: engine.fetch(d) for d in sorted(set(inputs.values()))}
            n = sum(len(b) for b in blobs.values())
            if chunk is None or len(chunk["index"]) >= per or size + n > CHUNK_BYTES:
                chunk, size = {"index": [], "payload": {"calls": [], "blobs": {}}}, 0
                out.append(chunk)
            chunk["index"].append((i, key))
            chunk["payload"]["calls"].append({"phase": name, "inputs": inputs, "config": config, "key": key})
            chunk["payload"]["blobs"].update(blobs)
            size += n
        return out

    # search candidates --------------------------------------------------------------------------
    def prepare_candidates(self, engine, base: dict, config: dict) -> None:
        """``executors.prepare_candidates``: one task on each worker, not waited for (its
        future is kept until the candidates are sent, so that Dask does not cancel it)."""
        payload = self._candidate_payload(engine, base, config)
        try:
            self._warming = [self.client.submit(_prepare, payload, key=f"ipubuild-prepare-{uuid.uuid4().hex}",
                                                workers=[w], allow_other_workers=False, pure=False)
                             for w in sorted(self._threads)]
        except Exception:  # noqa: BLE001 - only a head start: a lost cluster shows when candidates are sent
            self._warming = []

    def _candidate_payload(self, engine, base: dict, config: dict) -> dict:
        from ..compiler.search import EVALUATION
        return {"config": config, "base": {slot: [d, engine.fetch(d)] for slot, d in sorted(base.items())},
                "signatures": {n: engine.signature(PHASES[n], config)
                               # plan_package's too: its code is search.py, which evaluates a candidate
                               for n in (*EVALUATION, "schedule_exchange_phase", "plan_package")}}

    def evaluate_candidates(self, engine, base: dict, config: dict, jobs: list[tuple], here) -> list[dict]:
        """``executors.evaluate_candidates`` on the cluster: one task per candidate."""
        common = self._candidate_payload(engine, base, config)
        blobs = common["base"]
        payloads = [dict(common, attempt=a, proposal=p, layout=layout) for a, p, layout in jobs]
        self._warming = []
        results: list = [None] * len(jobs)

        def take(i: int, ok: bool, value) -> None:
            attempt, proposal, _ = jobs[i]
            if not ok:
                log.info("a cluster candidate failed; evaluating it here", attempt=attempt, error=_short(value))
                return
            if "mismatch" in value:
                name, parts = next(iter(value["mismatch"].items()))
                raise Mismatch(self._mismatch(engine, PHASES[name], config, value["worker"], parts))
            if not _candidate_verified(engine, base, config, jobs[i][2], value):
                log.warning("a cluster worker returned a candidate that does not verify; evaluating it here",
                            worker=value.get("worker"), attempt=attempt)
                return
            results[i] = value["result"]
            log.info("evaluated local candidate", attempt=attempt, proposal=proposal,
                     cycles=value["result"].get("cycles", "invalid"), elapsed_ms=int(value["seconds"] * 1000),
                     worker=value["worker"])
            _trace("worker:candidate", value, sum(len(b) for _, b in blobs.values()), 0)

        with span("cluster", work="candidates", candidates=len(jobs)):
            self._map(_evaluate, payloads, take, "candidate")
        left = [i for i, r in enumerate(results) if r is None]
        if left:
            for i, r in zip(left, here([jobs[i] for i in left])):
                results[i] = r
        return results

    # the loop -------------------------------------------------------------------------------------
    def _map(self, fn, payloads: list, take, what: str) -> None:
        """Run ``fn(payload)`` for every payload on the cluster and call ``take(i, ok, value)``
        in submission order (``ok`` False: ``value`` is the task's exception). Tasks in flight
        are bounded; a lost cluster (see ``_check``) gives up on it (one warning) and returns
        with the remaining payloads untaken. A ``Mismatch`` from ``take`` becomes a UserError."""
        futures: list = [None] * len(payloads)
        running: set = set()
        sent = head = 0
        progress = time.monotonic()
        batch = uuid.uuid4().hex[:12]
        woken = threading.Event()           # set whenever a task finishes
        try:
            while head < len(payloads):
                while sent < len(payloads) and len(running) < 2 * max(2, sum(self._threads.values())):
                    try:
                        f = self.client.submit(fn, payloads[sent], key=f"ipubuild-{what}-{batch}-{sent}", pure=False)
                        f.add_done_callback(lambda _: woken.set())
                    except Exception as exc:  # noqa: BLE001 - ClosedClientError, CommClosedError, …
                        raise Lost(f"a task could not be sent ({type(exc).__name__}: {exc})") from None
                    futures[sent] = f
                    running.add(f)
                    sent += 1
                while head < sent and futures[head].done():
                    f, futures[head] = futures[head], None
                    running.discard(f)
                    ok, value = self._outcome(f)
                    take(head, ok, value)
                    head += 1
                    progress = time.monotonic()
                if head == len(payloads):
                    break
                finished = {f for f in running if f.done()}
                if finished:
                    running -= finished
                    progress = time.monotonic()
                    continue
                self._check(progress)
                woken.wait(TICK)
                woken.clear()
        except Lost as exc:
            self._cancel(futures)
            _give_up(self, str(exc))
        except Mismatch as exc:
            self._cancel(futures)
            raise UserError("IPUBUILD_SCHEDULER", f"worker {exc}") from None

    def _outcome(self, f) -> tuple[bool, object]:
        try:
            return True, f.result(timeout=self.stall)
        except (self.distributed.client.FutureCancelledError, TimeoutError, OSError) as exc:
            raise Lost(f"a task's result could not be fetched ({type(exc).__name__}: {exc})") from None
        except Exception as exc:  # noqa: BLE001 - the task's own failure, or a worker it killed
            if self.client is None or self.client.status not in ("running", "connecting"):
                raise Lost(f"the connection to the scheduler was closed ({type(exc).__name__})") from None
            return False, exc

    def _check(self, progress: float) -> None:
        """Raise ``Lost`` if the scheduler is gone, has had no workers for the connect timeout,
        or no task has finished for the stall timeout."""
        now = time.monotonic()
        if self.client is None or self.client.status not in ("running", "connecting"):
            raise Lost("the connection to the scheduler was closed")
        if now - self._asked >= max(1.0, TICK):
            try:
                threads = self._nthreads()
            except Exception as exc:  # noqa: BLE001
                raise Lost(f"the scheduler does not answer ({type(exc).__name__}: {exc})") from None
            self._asked = now
            if threads:
                self._threads, self._no_workers = threads, None
            elif self._no_workers is None:
                self._no_workers = now
        if self._no_workers is not None and now - self._no_workers > self.timeout:
            raise Lost(f"the scheduler has had no workers for {self.timeout:g} s")
        if now - progress > self.stall:
            raise Lost(f"no task finished in {self.stall:g} s")

    def _nthreads(self) -> dict:
        return dict(self.client.nthreads(callback_timeout=self.timeout))

    def _cancel(self, futures) -> None:
        live = [f for f in futures if f is not None]
        if live and self.client is not None:
            try:
                self.client.cancel(live, force=True)
            except Exception:  # noqa: BLE001 - a lost scheduler: nothing to cancel there
                pass

    def _mismatch(self, engine, ph, config, worker: str, theirs: dict) -> str:
        """One line saying what differs between this build and a worker."""
        ours = _parts(engine, ph, config)
        for part in ("setup", "compiler", "code", "toolchain", "plugins", "config"):
            if part in theirs and theirs[part] != ours.get(part):
                if part == "setup":
                    return f"{worker} cannot run ipubuild's phases ({theirs[part]}); install this ipubuild on the workers"
                if part == "toolchain":
                    diff = ", ".join(f"{k} {ours[part].get(k)} here, {v} there"
                                     for k, v in sorted(theirs[part].items()) if ours[part].get(k) != v)
                    return f"{worker} runs another Python toolchain ({diff}); run the workers in the same environment"
                if part == "compiler":
                    return (f"{worker} has another C compiler than this build ({theirs[part]}); give the workers "
                            "the same compiler, or unset IPUBUILD_SCHEDULER")
                return (f"{worker} runs other ipubuild {part} than this build (phase {ph.name}); run the workers "
                        "with the same ipubuild and plugins, or unset IPUBUILD_SCHEDULER")
        return f"{worker} computes other action keys than this build (phase {ph.name}); restart the workers"


def _parts(engine, ph, config) -> dict:
    """What a phase's signature is made of (to name what differs; the check is the key)."""
    return {"code": ph.code, "toolchain": toolchain(),
            "plugins": engine.plugin_fingerprints(ph.hooks) if ph.hooks else {},
            "config": config_subset(config, ph.config)}


def _verified(ph, got: dict) -> bool:
    """Every declared output is there, with bytes whose sha256 is its digest."""
    outputs, blobs = got.get("outputs"), got.get("blobs")
    if not isinstance(outputs, dict) or not isinstance(blobs, dict) or sorted(outputs) != sorted(ph.outputs):
        return False
    return all(isinstance(blobs.get(d), bytes) and canonical.digest(blobs[d]) == d for d in outputs.values())


def _record(engine, name: str, inputs: dict, config: dict, key: str, got: dict) -> None:
    """Store a verified result as ``Engine.run`` stores its own: blobs, provenance, action."""
    subset = config_subset(config, PHASES[name].config)
    for out_name, d in sorted(got["outputs"].items()):
        engine.put(got["blobs"][d])
        engine.store.add_provenance(d, {"phase": name, "inputs": inputs, "config": subset, "output": out_name})
    engine.store.put_action(key, dict(got["outputs"]))


def _trace(name: str, value: dict, sent: int, returned: int) -> None:
    """A task's time on its worker, in the build trace (ending now; the arguments say where it
    ran, its CPU time and the blob bytes sent with it and returned)."""
    end = time.perf_counter()
    record(name, end - value["seconds"], end, {"worker": value["worker"], "seconds": round(value["seconds"], 4),
                                               "cpu_seconds": round(value["cpu"], 4),
                                               "calls": len(value.get("results", [None])),
                                               "bytes_sent": sent, "bytes_returned": returned})


def _short(exc) -> str:
    return f'"{type(exc).__name__}: {str(exc)[:200]}"'


# the worker side --------------------------------------------------------------------------------
_worker_state: dict = {}
_worker_lock = threading.Lock()


def _worker_engine() -> Engine:
    """This worker process's engine over its own temporary store (made on first use)."""
    with _worker_lock:
        engine = _worker_state.get(os.getpid())
        if engine is None:
            from ..engine.registry import load_phases
            from ..plugins import get_plugin_manager
            from ..engine.store import Store
            load_phases()
            try:
                folder = _worker().local_directory
            except (ValueError, AttributeError):
                folder = None
            root = tempfile.mkdtemp(prefix="ipubuild-worker-", dir=folder)
            atexit.register(shutil.rmtree, root, True)
            pm = get_plugin_manager()
            engine = _worker_state[os.getpid()] = Engine(Store(Path(root), WORKER_CACHE_BYTES),
                                                         lambda hooks: pm.fingerprints(hooks))
        return engine


def _worker():
    import distributed
    return distributed.get_worker()


def _address() -> str:
    try:
        return _worker().address
    except (ValueError, AttributeError):
        return f"pid {os.getpid()}"


class _Clock:
    """A task's wall and CPU seconds (its thread's, and its child processes' — the compiler)."""

    def __init__(self):
        self.t0, self.c0 = time.perf_counter(), time.thread_time()
        self.k0 = _children_cpu()

    def read(self) -> dict:
        return {"seconds": time.perf_counter() - self.t0,
                "cpu": time.thread_time() - self.c0 + _children_cpu() - self.k0}


def _children_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def _setup_failure(exc: Exception) -> dict:
    return {"mismatch": {"setup": f"{type(exc).__name__}: {exc}"}}


def _run_calls(payload: dict) -> dict:
    """On a worker: run a chunk of phase calls; their output digests and bytes."""
    clock = _Clock()
    try:
        engine = _worker_engine()
    except Exception as exc:  # noqa: BLE001 - told to the client as a worker it cannot use
        return {"worker": _address(), "results": [_setup_failure(exc)] * len(payload["calls"]), **clock.read()}
    for d, data in payload["blobs"].items():
        if canonical.digest(data) == d:        # a damaged input is simply absent: the call fails
            engine.put(data)
    out = []
    for call in payload["calls"]:
        ph = PHASES[call["phase"]]
        if engine.action_key(ph, call["inputs"], call["config"]) != call["key"]:
            out.append({"mismatch": _parts(engine, ph, call["config"])})
            continue
        if call["phase"] in ("compile_kernel", "compile_counted_kernel"):     # what they compile with
            theirs = _compiler_identity(call["config"]["compiler"]["cc"])
            if theirs != call["config"]["compiler"]["identity"]:
                out.append({"mismatch": {"compiler": theirs.get("version") or str(theirs)}})
                continue
        t = _Clock()
        try:
            r = engine.run(call["phase"], call["inputs"], call["config"])
        except UserError as exc:
            out.append({"error": str(exc)})
            continue
        out.append({"key": r.key, "outputs": r.outputs, "blobs": {d: engine.fetch(d) for d in r.outputs.values()},
                    **t.read()})
    engine.store.trim()
    return {"worker": _address(), "results": out, **clock.read()}


_compilers: dict = {}


def _compiler_identity(cc: str) -> dict:
    if cc not in _compilers:
        from ..compiler.kernels import compiler_identity
        try:
            _compilers[cc] = compiler_identity(cc)[0]
        except UserError as exc:
            _compilers[cc] = {"version": str(exc)}
    return _compilers[cc]


def _candidate_setup(payload: dict):
    """On a worker: the engine and the search's inputs for candidates, or a mismatch report."""
    try:
        engine = _worker_engine()
        from ..compiler.search import evaluate  # noqa: F401
    except Exception as exc:  # noqa: BLE001
        return None, None, {"plan_package": _setup_failure(exc)["mismatch"]}
    config = payload["config"]
    for name, signature in payload["signatures"].items():
        if engine.signature(PHASES[name], config) != signature:
            return None, None, {name: _parts(engine, PHASES[name], config)}
    base = {}
    for slot, (d, data) in payload["base"].items():
        if canonical.digest(data) != d:
            raise ValueError(f"input {slot} arrived damaged")
        base[slot] = engine.put(data)
    return engine, base, None


def _prepare(payload: dict) -> None:
    """On a worker, before a search: load the code, plugins and fingerprints candidates need and
    the graph's plans (``PlanResolver.of``, kept per process), so that the first candidate is not slow."""
    engine, base, mismatch = _candidate_setup(payload)
    if mismatch is None:
        from ..graph.ir import Graph
        from ..compiler.planning.program import PlanResolver
        graph = Graph.from_json(engine.decoded(base["graph"]))
        PlanResolver.of(graph, payload["config"]["target"]["tile_count"])   # computes every op's plans


def _evaluate(payload: dict) -> dict:
    """On a worker: one search candidate's exact evaluation (``search.evaluate``)."""
    clock = _Clock()
    engine, base, mismatch = _candidate_setup(payload)
    if mismatch is not None:
        return {"worker": _address(), "mismatch": mismatch, **clock.read()}
    from ..compiler.search import evaluate
    result = evaluate(engine, base, payload["layout"], payload["config"])
    chain = [] if "invalid" in result else _chain(engine, base, payload["layout"], payload["config"])
    cost = {d: engine.fetch(d) for d in [_cost_of(chain)] if d is not None}
    engine.store.trim()
    return {"worker": _address(), "result": result, "chain": chain, "blobs": cost, **clock.read()}


def _chain(engine, base: dict, layout: dict, config: dict, outputs_of=None) -> list:
    """A candidate's evaluation as ``[(phase, action key, outputs)]``, walked as ``search.evaluate``
    walks it: the outputs by ``outputs_of(phase, key)`` (default: this engine's action records)."""
    from ..compiler.search import EVALUATION, phase_inputs
    artifacts = dict(base, layout=canonical.digest(canonical.encode(layout)))
    chain = []
    for name in EVALUATION:
        ph = PHASES[name]
        key = engine.action_key(ph, phase_inputs(ph, artifacts), config)
        outputs = outputs_of(name, key) if outputs_of is not None else engine.store.get_action(key)
        if not isinstance(outputs, dict):
            return chain
        chain.append((name, key, dict(outputs)))
        artifacts.update(outputs)
    return chain


def _cost_of(chain: list) -> str | None:
    """The digest of the cost a candidate's evaluation ends with (its last ``cost`` output)."""
    return next((outputs["cost"] for _, _, outputs in reversed(chain) if "cost" in outputs), None)


def _candidate_verified(engine, base: dict, config: dict, layout: dict, value: dict) -> bool:
    """A worker's candidate result is what its own artifacts say: every step's action key is the
    one this build computes from the step before (so the chain starts at this candidate's layout
    and this build's inputs), and its cost's bytes match their digest and give the cycles it
    claims. An invalid candidate (no chain) is evaluated here: a worker cannot drop one."""
    result, chain, blobs = value.get("result"), value.get("chain"), value.get("blobs")
    if not isinstance(result, dict) or "invalid" in result or not isinstance(chain, list) \
            or not isinstance(blobs, dict):
        return False
    from ..compiler.search import EVALUATION
    theirs = {}
    for step in chain:
        if not (isinstance(step, (list, tuple)) and len(step) == 3 and isinstance(step[2], dict)):
            return False
        theirs[(step[0], step[1])] = step[2]
    try:
        ours = _chain(engine, base, layout, config, lambda name, key: theirs.get((name, key)))
    except (KeyError, TypeError):
        return False
    if len(ours) != len(EVALUATION) or len(ours) != len(chain):
        return False
    d = _cost_of(ours)
    data = blobs.get(d)
    if not isinstance(data, bytes) or canonical.digest(data) != d:
        return False
    try:
        cost = canonical.loads(data)
        return cost["final_cycles"] == result.get("cycles") and cost["final_exchange"] == result.get("exchange")
    except (ValueError, KeyError, TypeError):
        return False
