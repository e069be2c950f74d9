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
import importlib
import os
import re

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


def run_phases(engine, calls: list[tuple], *, threads: int | None = None) -> list[Result]:
    """Run independent phase calls ``[(phase, inputs, config)]``; their results in call order.

    Calls the action cache already answers are answered here. The others run on the cluster if
    one is set, else here: one after the other, stopping at the first failure (``threads``
    None), or on up to ``threads`` threads (then every call finishes and the first failure in
    call order is raised)."""
    if scheduler() is not None and any(_misses(engine, calls)):
        remote = cluster()
        if remote is not None:
            return remote.run_phases(engine, calls)
    if threads is None:
        return [engine.run(name, inputs, config) for name, inputs, config in calls]
    with concurrent.futures.ThreadPoolExecutor(max(1, min(len(calls), threads))) as pool:
        futures = [pool.submit(engine.run, name, inputs, config) for name, inputs, config in calls]
        results, failure = [], None
        for fut in futures:
            try:
                results.append(fut.result())
            except (UserError, MissingBlob) as exc:
                failure = failure or exc
    if failure is not None:
        raise failure
    return results


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
