"""Where a build's independent pieces of work run: here (the default), or on a Dask cluster.

Three places hand out independent, content-addressed work: ``build_tile_images`` (the
``build_tile_image`` sub-phase per tile), ``compile_kernels`` (``compile_kernel`` and ``compile_counted_kernel`` per variant) and
the layout search (the exact evaluation of each shortlisted candidate). They go through
``run_phases`` and ``evaluate_candidates``, which run the work here exactly as before — unless
``$IPUBUILD_SCHEDULER`` names a Dask scheduler (``tcp://host:8786``). Then the work is sent to
that cluster by ``ipubuild.cluster`` (which imports ``distributed``: it is imported by name, and
only when there is work to send, so a no-op or fully cached build never imports it).

Where a piece of work runs never changes what it computes: results come back in submission
order, every returned blob is verified against its digest, and a worker that would compute other
action keys (other ipubuild code, plugins, toolchain or C compiler) is refused. A scheduler that
is unreachable or lost costs one warning; the rest of the build runs here.
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import importlib
import os
import re
import threading

from .engine import PHASES, MissingBlob, Result
from .errors import UserError
from .registry import CLUSTER

ENV = "IPUBUILD_SCHEDULER"
_ADDRESS = re.compile(r"((tcp|tls|ws|wss|ucx)://)?[A-Za-z0-9_.\-\[\]:]+:\d{1,5}")


def scheduler() -> str | None:
    """The Dask scheduler's address from ``$IPUBUILD_SCHEDULER``, or None (work runs here)."""
    raw = os.environ.get(ENV, "").strip()
    if not raw:
        return None
    if not _ADDRESS.fullmatch(raw):
        raise UserError(ENV, f"expected a scheduler address such as tcp://host:8786, got {raw!r}")
    address = raw if "://" in raw else "tcp://" + raw
    _warn_plain(address)
    return address


_warned: set = set()


def _warn_plain(address: str) -> None:
    """One warning for a plain ``tcp://`` scheduler that is not on this machine's loopback: a Dask
    scheduler runs whatever it is sent, and tcp carries it unencrypted and unauthenticated."""
    if address in _warned or not address.startswith("tcp://"):
        return
    host = address[len("tcp://"):].rsplit(":", 1)[0].strip("[]")
    import ipaddress
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = host == "localhost"
    if not loopback:
        _warned.add(address)
        from .log import log
        log.warning(f"{ENV}={address} is plain tcp to another machine: anyone who reaches it can run code "
                    "there; use Dask's TLS (tls://, with certificates: see the README)")


def cluster():
    """This process's connection to the cluster (an ``ipubuild.cluster.Cluster``), or None when
    no scheduler is set or it cannot be reached (warned once)."""
    address = scheduler()
    if address is None:
        return None
    return importlib.import_module(CLUSTER).connect(address)


def run_phases(engine, calls: list[tuple], *, threads: int | None = None, then: list[tuple] = ()) -> list[Result]:
    """Run independent phase calls ``[(phase, inputs, config)]``; their results in call order.

    Calls the action cache already answers are answered here. The others run on the cluster if
    one is set, else here: one after the other, stopping at the first failure (``threads``
    None), or on up to ``threads`` threads (then every call finishes and the first failure in
    call order is raised). A call started earlier by ``then`` and still running is waited for,
    not run twice.

    ``then``: calls queued on the same threads behind ``calls`` and left running when this
    returns (not on a cluster, nor without ``threads``): a later ``run_phases`` of the same call
    takes its result. ``compile_kernels`` starts the counted builds so, and they compile while
    the build goes on to the link, the images and the package."""
    if scheduler() is not None and any(_misses(engine, calls)):
        remote = cluster()
        if remote is not None:
            return remote.run_phases(engine, calls)
    if threads is None:
        return [_started(engine, c) or engine.run(*c) for c in calls]
    pool = _pool(threads)
    futures = [_started(engine, c, future=True) or pool.submit(engine.run, *c) for c in calls]
    if then and scheduler() is None:
        for c in then:
            key = _key(engine, c)
            with _lock:
                if key not in _running:
                    _running[key] = (pool.submit(engine.run, *c), engine)
    results, failure = [], None
    for fut in futures:
        try:
            results.append(fut.result())
        except (UserError, MissingBlob) as exc:
            failure = failure or exc
    if failure is not None:
        raise failure
    return results


_threads: dict[int, concurrent.futures.ThreadPoolExecutor] = {}
#: (engine's id, action key) -> (the future of a call ``then`` started, the engine: held, so that
#: its id is not reused); a call is taken only by its own engine, whose store holds its outputs
_running: dict[tuple, tuple] = {}
_background: list[threading.Thread] = []
SETTLE_SAY_AFTER_S = 30
_lock = threading.Lock()


def _pool(threads: int) -> concurrent.futures.ThreadPoolExecutor:
    """This process's pool of ``threads`` threads (kept: calls ``then`` starts outlive the call)."""
    with _lock:
        if threads not in _threads:
            _threads[threads] = concurrent.futures.ThreadPoolExecutor(max(1, threads),
                                                                      thread_name_prefix="ipubuild-phase")
        return _threads[threads]


def background(fn) -> None:
    """Run ``fn()`` on a daemon thread of its own, beside the build (a process that ends does not
    wait for it); its errors are ignored: work done ahead of time, such as compiling a helper,
    that its user does again if it failed."""
    def quiet():
        with contextlib.suppress(Exception):
            fn()
    thread = threading.Thread(target=quiet, name="ipubuild-background", daemon=True)
    with _lock:
        _background.append(thread)
    thread.start()


def settle() -> None:
    """Wait until every call ``then`` started, and every ``background`` call, has finished (a
    call's result stays to be taken): before forking, so that no child inherits a lock a running
    call held. Says so if background work keeps it waiting."""
    with _lock:
        running = [fut for fut, _ in _running.values()]
        threads = list(_background)
    concurrent.futures.wait(running)
    for t in threads:
        t.join(SETTLE_SAY_AFTER_S)
        if t.is_alive():
            from .log import log
            log.warning("waiting for work started in the background (a device backend's prepare()) "
                        "before forking")
            t.join()
    with _lock:
        _background[:] = [t for t in _background if t.is_alive()]


def _forked() -> None:
    """In a forked child the pools' threads do not exist: it starts its own."""
    _threads.clear()
    _running.clear()
    _background.clear()


os.register_at_fork(after_in_child=_forked)


def _key(engine, call: tuple) -> tuple:
    name, inputs, config = call
    return id(engine), engine.action_key(PHASES[name], inputs, config)


def _started(engine, call: tuple, future: bool = False):
    """The result of ``call`` if ``then`` started it (its future, with ``future``), else None."""
    if not _running:
        return None
    with _lock:
        fut, _ = _running.pop(_key(engine, call), (None, None))
    if fut is None or future:
        return fut
    return fut.result()


def _misses(engine, calls):
    for name, inputs, config in calls:
        yield engine.store.get_action(engine.action_key(PHASES[name], inputs, config)) is None


def evaluate_candidates(engine, base: dict, config: dict, jobs: list[tuple], here) -> list[dict]:
    """The search's exact evaluations of ``jobs`` (``(attempt, proposal, layout)``), in job order:
    on the cluster if one is set and reachable, else by ``here(jobs)`` (the search's own pool)."""
    remote = cluster() if jobs else None
    if remote is None:
        return here(jobs)
    return remote.evaluate_candidates(engine, base, config, jobs, here)


def prepare_candidates(engine, base: dict, config: dict) -> None:
    """Before a search: if a cluster is set, have every worker load what candidates need (code,
    plugins, fingerprints, the graph's plans) while this process evaluates the incumbent."""
    if scheduler() is not None:
        remote = cluster()
        if remote is not None:
            remote.prepare_candidates(engine, base, config)
