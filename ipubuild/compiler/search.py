"""The layout search inside ``plan_package``: local search over the layout, as the reference does.

A layout chooses, for every operation, a plan (how it splits over tiles) and a tile offset (where
its tile set starts). Starting from the heuristics' initial layout, each round asks the search
heuristics (plugins) for changes to the incumbent, screens them with a cheap estimate, the
costliest operations' first, within a budget (``invalid``, ``visited``, ``not_cheaper``,
``deduplicated``, ``truncated``, ``shortlisted``, ``unscreened``),
evaluates the shortlist exactly (the compiler's own phases up to the costed, placed program,
through the shared cache, in worker processes) and accepts the best improvement. The state is
saved after every attempt; a re-run validates the saved incumbent and resumes. Only the winner
gets tile images: candidates stop at ``optimize_exchange_placement``, where the cost is known.
"""
from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import gc
import multiprocessing
import numbers
import os
import time
from pathlib import Path
from typing import Callable

from ..engine import canonical, executors
from ..graph.artifacts import graph_of, machine_from, machine_of, to_json
from ..graph.program_buffers import buffers_of
from ..engine.engine import PHASES, MissingBlob, phase
from ..engine.errors import UserError
from ..engine.files import write_atomic
from ..engine.log import log, phase_finished, span
from .estimator import Baseline, Estimator, give_back_memory
from .placement import initial_layouts
from .planning.phases import OPS   # and registers the phases a candidate's evaluation runs
from .planning.program import plans_of
from .planning.storage import headroom, tile_ranges

EVALUATION = ("place_provisional_storage", "schedule_provisional_exchanges", "plan_kernels", "link_runtime",
              "size_tile_code", "place_storage", "lower_exchanges", "optimize_exchange_placement")


@dataclasses.dataclass(frozen=True)
class Changes:
    """A change to a layout, in the reference's terms: ``plans`` (``((operation id, plan
    index), ...)``: the index into ``SearchContext.plans[operation id]``) and ``boundaries``
    (``((operation id, tile offset), ...)``: where the operation's tile set starts, ``0 <=
    offset < tile_count``). The other fields (``UNEXPRESSED``) are carried for layouts that can
    express them; this one cannot, so a change that sets any of them is screened out as
    ``inexpressible``."""
    plans: tuple = ()
    boundaries: tuple = ()
    casts: tuple = ()
    early_casts: tuple = ()
    packing_rows: tuple = (None, None)
    parallel_reductions: tuple = (0, 0)
    disjoint_copy_sources: tuple = (False, False)
    cast_storage: tuple = (None, None)

    #: the fields a layout cannot express, with the value that leaves them unset
    UNEXPRESSED = {"casts": (), "early_casts": (), "packing_rows": (None, None), "parallel_reductions": (0, 0),
                   "disjoint_copy_sources": (False, False)}

    def apply(self, layout: dict, plans: dict[int, list], tile_count: int) -> dict | None:
        """The changed layout, or None if this layout cannot express the change (``why_not``
        says why)."""
        return self._applied(layout, plans, tile_count)[0]

    def why_not(self, layout: dict, plans: dict[int, list], tile_count: int) -> str | None:
        """Why ``apply`` gives None: ``"inexpressible"`` (it sets a field of ``UNEXPRESSED``),
        ``"out_of_range"`` (an operation the layout does not have, a plan index or tile offset
        out of range) or ``"unchanged"`` (the layout already is so); None if it applies."""
        return self._applied(layout, plans, tile_count)[1]

    def _applied(self, layout, plans, tile_count) -> tuple[dict | None, str | None]:
        if any(getattr(self, f) != unset for f, unset in self.UNEXPRESSED.items()):
            return None, "inexpressible"
        ops = {k: dict(v) for k, v in layout["ops"].items()}
        for op, plan in self.plans:
            if str(op) not in ops or not 0 <= plan < len(plans[op]):
                return None, "out_of_range"
            ops[str(op)]["plan"] = plan
        for op, offset in self.boundaries:
            if str(op) not in ops or not 0 <= offset < tile_count:
                return None, "out_of_range"
            ops[str(op)]["offset"] = offset
        out = dict(layout, ops=ops)
        return (None, "unchanged") if out == layout else (out, None)

    def describe(self, graph, policy: str) -> str:
        ops = ", ".join(f"OperationId({op})" for op, _ in sorted(self.plans))
        values = ", ".join(f"ValueId({graph.ops[op].outputs[0]})" for op, _ in sorted(self.boundaries))
        pr, pd, dc = self.packing_rows, self.parallel_reductions, self.disjoint_copy_sources
        return (f"Changes {{ plans: {{{ops}}}, boundaries: [{values}], casts: {list(self.casts)}, "
                f"early_casts: {list(self.early_casts)}, packing_rows: ({pr[0]}, {pr[1]}), "
                f"parallel_reductions: ({pd[0]}, {pd[1]}), disjoint_copy_sources: "
                f"({str(dc[0]).lower()}, {str(dc[1]).lower()}), cast_storage: (Some({policy}), Some({policy})) }}")


@dataclasses.dataclass(frozen=True)
class Heuristic:
    """A search heuristic: ``propose(layout, context) -> list[Changes]``, deterministic.
    ``layout`` is the incumbent (``{"ops": {"<operation id>": {"plan": i, "offset": t}}}``,
    read-only) and ``context`` a :class:`SearchContext`. ``name`` (an identifier, unique) names
    its proposals (``<name>#<index>``) and its counts in the search's log and state."""
    name: str
    propose: Callable


class SearchContext:
    """What heuristics see: ``graph`` (the :class:`ipubuild.ir.Graph` being planned, with its
    casts), ``plans`` (``{operation id: [plan dict, ...]}``, each operator's ``plans`` and
    follow plans), ``tile_count``, ``machine`` (the machine description, a dict of
    ``ipubuild/machines/<name>.toml``), ``producer`` (``{value id: the Op writing it}``) and
    ``estimator`` (an :class:`Estimator` of layouts). Read-only. ``reservations`` (``{kernel
    variant: code bytes}``, ``compile_kernels``'s) give the estimator's ``reservation_excess``
    (what kernels reserve past one quantum), which the initial placement keeps free; without
    them it is 0. ``room`` (``{"headroom": …, "code_room": …}``) is the incumbent's, once the
    search has evaluated it (else None): what a round's screening bounds a proposal's growth
    on each tile by (``Baseline``), so that a heuristic chaining changes can hold each to it."""

    def __init__(self, graph, tile_count: int, machine: dict, reservations: dict[str, int] | None = None):
        self.graph, self.tile_count, self.machine = graph, tile_count, machine
        self.plans = plans_of(graph, tile_count)
        self.estimator = Estimator(graph, tile_count, machine, self.plans, reservations)
        self.producer = {v: op for op in graph.ops for v in op.outputs}
        self.room: dict | None = None


# exact evaluation ------------------------------------------------------------------------------
def phase_inputs(ph, artifacts: dict[str, str]) -> dict[str, str]:
    """A phase's inputs by slot from the artifacts named so far (a family slot ``x/*`` takes every
    ``x/...`` member)."""
    inputs = {}
    for slot in ph.inputs:
        if slot.endswith("/*"):
            inputs.update({k: d for k, d in artifacts.items() if k.startswith(slot[:-1])})
        else:
            inputs[slot] = artifacts[slot]
    return inputs


def evaluate(engine, base: dict[str, str], layout: dict, config: dict) -> dict:
    """Run the compiler's phases up to the costed, placed program for ``layout``: its ``cycles``,
    ``exchange``, ``headroom`` (``storage.headroom``: what later screenings may add per tile) and
    ``code_room`` (``code_room``), or why it is ``invalid``."""
    artifacts = dict(base, layout=engine.put(canonical.encode(layout), pin=True))
    before = collections.Counter(engine.stats)
    try:
        for name in EVALUATION:
            with span("phase", phase=name):
                r = engine.run(name, phase_inputs(PHASES[name], artifacts), config)
                phase_finished(name, r.elapsed_ms, r.hit)
            artifacts.update(r.outputs)
    except MissingBlob:
        raise                  # not the candidate's fault: the step re-makes its inputs
    except UserError as exc:
        return {"invalid": str(exc)}
    cost = engine.decoded(artifacts["cost"])
    after = engine.stats
    machine = machine_from(engine.fetch(artifacts["machine"]))
    room = headroom(engine.decoded(artifacts["storage"]), buffers_of(engine.decoded(artifacts["program"])),
                    machine["memory"]["alignment"])
    return {"cycles": cost["final_cycles"], "exchange": cost["final_exchange"], "headroom": room,
            "code_room": code_room(engine.decoded(artifacts["provisional_code"]), machine),
            "hits": after["hit"] - before["hit"], "misses": after["miss"] - before["miss"]}


def code_room(provisional_code: dict, machine: dict) -> list[int]:
    """Per tile (tile order), the executable memory the generated code at its provisional size
    (``{tile: bytes}``, ``place_provisional_storage``'s) leaves free: a candidate whose code
    outgrows it does not build. The estimator's code is 1–2 KB under the provisional figure on
    ViT-B/16's fullest tiles, so screening bounds its growth by this, as it bounds data by the
    headroom."""
    end = machine["memory"]["executable_end"]
    out = [0] * len(provisional_code)
    for tile, code in provisional_code.items():
        out[int(tile)] = end - tile_ranges(machine, code)["code_end"]
    return out


def rooms(result: dict) -> dict:
    """What screening bounds a change's growth by (``Baseline``'s ``headroom`` and ``code_room``),
    from an exact evaluation's result."""
    return {"headroom": result["headroom"], "code_room": result["code_room"]}


_worker: dict = {}


def _evaluate_in_worker(attempt: int, proposal, layout: dict, forked: bool = False) -> dict:
    w = _worker
    t0 = time.perf_counter()
    with span("local_candidate", attempt=attempt, proposal=proposal):
        result = evaluate(w["engine"], w["base"], layout, w["config"])
    log.info("evaluated local candidate", attempt=attempt, proposal=proposal,
             cycles=result.get("cycles", "invalid"), elapsed_ms=int((time.perf_counter() - t0) * 1000))
    if forked and w["engine"].store.remote is not None:   # [remote tier] this worker's counters, for the parent
        result["remote"] = w["engine"].store.remote.take()
    if forked:
        # a candidate frees gigabytes of arrays that the heap keeps otherwise: each further
        # candidate then grew the worker (1.3 GB of free heap after two on ViT-B/16)
        give_back_memory()
    return result


#: decoded values a forked worker keeps (``Engine.DECODED_BYTES``): it evaluates one candidate at a
#: time, whose values (about 0.8 GB on ViT-B/16) no later candidate reads, so keeping the build
#: process's 3 GiB only grew each worker by gigabytes
WORKER_DECODED_BYTES = 1 << 30


def _worker_started() -> None:
    _worker["engine"].DECODED_BYTES = WORKER_DECODED_BYTES


class Pool:
    """Evaluates candidates in ``workers`` forked processes (or in-process for one worker), or
    on the cluster ``$IPUBUILD_SCHEDULER`` names (``ipubuild.executors``)."""

    def __init__(self, workers: int, engine, base, config):
        _worker.update(engine=engine, base=base, config=config)
        self.workers = workers
        self.executor = None
        executors.prepare_candidates(engine, base, config)

    def map(self, jobs: list[tuple]) -> list[dict]:
        if executors.scheduler() is not None:
            return executors.evaluate_candidates(_worker["engine"], _worker["base"], _worker["config"],
                                                 jobs, self._map_here)
        return self._map_here(jobs)

    def start(self) -> None:
        """Fork the workers now, before the search builds its estimator and evaluates its
        incumbent: what this process holds then, the workers inherit and never use, and on
        ViT-B/16 that was gigabytes each (forked workers all start at the first job)."""
        if self.workers > 1 and self.executor is None and executors.scheduler() is None:
            executors.settle()      # the counted kernel builds compile_kernels left running
            # values decoded by earlier phases are in the store: readers read them from there
            _worker["engine"].forget_values()
            give_back_memory()
            gc.collect()
            gc.freeze()             # the collector would touch, and so copy, every inherited object's page
            try:
                self.executor = concurrent.futures.ProcessPoolExecutor(
                    max_workers=self.workers, mp_context=multiprocessing.get_context("fork"),
                    initializer=_worker_started)
                self.executor.submit(int).result()
            finally:
                gc.unfreeze()

    def _map_here(self, jobs: list[tuple]) -> list[dict]:
        if self.workers > 1 and self.executor is None:
            self.start()
        if self.executor is None:
            return [_evaluate_in_worker(*j) for j in jobs]
        futures = [self.executor.submit(_evaluate_in_worker, *j, True) for j in jobs]
        try:
            results = [f.result() for f in futures]
        except concurrent.futures.BrokenExecutor:
            raise UserError("search", f"a worker evaluating candidates died (killed by the system: most often "
                            f"out of memory); give the build more memory, or set [search] workers below "
                            f"{self.workers}; the search resumes from its last saved round") from None
        for r in results:                                      # [remote tier] workers' counters
            if "remote" in r:
                _worker["engine"].store.remote.merge(r.pop("remote"))
        return results

    def close(self):
        if self.executor is not None:
            self.executor.shutdown()


# the search ------------------------------------------------------------------------------------
def heuristics() -> list[Heuristic]:
    """Every plugin's heuristics, in name order (a name declared twice, or one that is not an
    identifier or is a key of the round's log lines, is an error naming the plugin)."""
    from ..plugins import get_plugin_manager
    found = get_plugin_manager().collect(
        "ipubuild_search_heuristics", _well_named, "a list of ipubuild.search.Heuristic, each named by an "
        f"identifier other than {', '.join(RESERVED_NAMES)}")
    owners: dict[str, str] = {}
    for plugin, h in found:
        if h.name in owners:
            raise UserError(f"plugin {plugin}", f"hook ipubuild_search_heuristics: heuristic {h.name!r} is "
                            f"already registered by {owners[h.name]}")
        owners[h.name] = plugin
    return sorted((h for _, h in found), key=lambda h: h.name)


#: why screening drops a proposal as invalid: the layout cannot express it (``inexpressible``,
#: ``out_of_range``, ``unchanged``: see ``Changes.why_not``), a follow plan then cannot follow
#: its producer (``unfollowable``), or a tile's constants or code exceed their caps (``over_memory``)
INVALID_REASONS = ("inexpressible", "out_of_range", "unchanged", "unfollowable", "over_memory")
#: what the search counts of each heuristic's proposals (the round's log lines and the state)
HEURISTIC_COUNTS = ("proposed", "unscreened", *INVALID_REASONS, "fit", "visited", "deduplicated", "cheaper",
                    "shortlisted", "evaluated", "improved", "accepted")
#: the keys of the round's log lines, which a heuristic's name cannot be
RESERVED_NAMES = ("message", "self", "round", "invalid", "not_cheaper", "truncated", *HEURISTIC_COUNTS)


def _well_named(h) -> bool:
    return isinstance(h, Heuristic) and isinstance(h.name, str) and h.name.isidentifier() \
        and h.name not in RESERVED_NAMES and callable(h.propose)


def state_path(ctx) -> Path:
    return Path(ctx.engine.store.root).parent / "search" / f"{ctx.config['name']}.state.json"


def state_bytes(state: dict) -> bytes:
    """A state file's bytes: plain JSON, ``{"sha256": <digest of the state's canonical JSON>,
    "state": {...}}`` (``json.load`` reads it; the digest tells an edited or damaged one)."""
    data = canonical.dumps(state)
    return canonical.dumps({"sha256": canonical.digest(data), "state": state})


def _save(path: Path, state: dict) -> None:
    """Save the state atomically, with the sha256 of its canonical JSON beside it (``state_bytes``)."""
    data = state_bytes(state)
    write_atomic(path, data)
    log.info("saved mid-plan search state", path=os.path.relpath(path), attempts=state["attempts"], bytes=len(data))


STATE_KEYS = {"key": str, "incumbent": dict, "cycles": int, "attempts": int, "round": int,
              "visited": list, "history": list}
#: optional keys of a saved state: ``heuristics`` — each heuristic's counts (HEURISTIC_COUNTS),
#: summed over the rounds so far
STATE_OPTIONAL = {"heuristics": dict}


def read_state(path: Path) -> dict | None:
    """The search state saved at ``path`` if it verifies (checksum and shape), else None (with a
    warning unless there is no state at all)."""
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as exc:
        log.warning("ignored unreadable search state", path=os.path.relpath(path), error=type(exc).__name__)
        return None
    state = None
    try:
        check, _, data = raw.partition(b"\n")
        if len(check) == 64 and check.decode() == canonical.digest(data):    # the first edition's form
            state = canonical.loads(data)
        else:
            saved = canonical.loads(raw)
            if isinstance(saved, dict) and saved.get("sha256") == canonical.digest_of(saved.get("state")):
                state = saved["state"]
    except (ValueError, TypeError):
        state = None
    if not isinstance(state, dict) or any(not isinstance(state.get(k), t) or isinstance(state.get(k), bool)
                                          for k, t in STATE_KEYS.items()) \
            or any(not isinstance(state.get(k, t()), t) for k, t in STATE_OPTIONAL.items()):
        log.warning("ignored a search state that does not verify (damaged or edited); searching afresh",
                    path=os.path.relpath(path))
        return None
    return state


def _load(path: Path, key: str) -> dict | None:
    """The saved state for this action key, or None: a state may make the search faster, never
    change its outcome."""
    state = read_state(path)
    if state is not None and state["key"] != key:
        log.info("ignored a search state of other inputs; searching afresh", path=os.path.relpath(path))
        return None
    return state


@phase("plan_package", inputs=("graph", "machine", "runtime", "reservations"), outputs=("layout", "search"),
       config=("name", "path", "target.tile_count", "search"), hooks=OPS + ("ipubuild_search_heuristics",))
def plan_package(ctx):
    """The searched layout, and the search's convergence (``search``: initial cycles, accepted steps)."""
    layout, summary = search_layout(ctx, graph_of(ctx))
    return {"layout": to_json(layout), "search": to_json(summary)}


def search_layout(ctx, graph) -> tuple[dict, dict]:
    """The searched layout, and the search's summary ``{"initial_cycles", "history": [{"round",
    "before", "after", "heuristic", "proposal"}], "heuristics": {name: counts}}`` (one history
    entry per accepted improvement; round 0 is the tile mapping, which no heuristic proposes;
    ``heuristics``: each heuristic's HEURISTIC_COUNTS summed over the rounds)."""
    cfg = ctx.config["search"]
    tiles = ctx.config["target"]["tile_count"]
    machine = machine_of(ctx)
    _check_fits(graph, tiles, machine, ctx.config["path"])
    base = {k: ctx.digest(k) for k in ("graph", "machine", "runtime", "reservations")}
    key = ctx.engine.action_key(ctx.phase, ctx.input_digests, ctx.config)
    path = state_path(ctx)
    policy = str(graph.cast_storage)
    found = heuristics()
    state = _load(path, key)
    pool = Pool(cfg["workers"], ctx.engine, base, ctx.config)
    try:
        if state is None or state["round"] < cfg["rounds"]:      # it will screen
            pool.start()
        sc = SearchContext(graph, tiles, machine, ctx.json("reservations"))
        resuming = state is not None
        if resuming:
            try:
                result = evaluate(ctx.engine, base, state["incumbent"], ctx.config)
            except (KeyError, TypeError, ValueError, AttributeError, IndexError):  # a malformed layout
                result = {"invalid": "malformed"}
            if result.get("cycles") != state["cycles"]:
                log.warning("ignored a search state whose incumbent does not build or cost what it says; "
                            "searching afresh", saved=state["cycles"], now=result.get("cycles", "invalid"))
                resuming, state = False, None
        if resuming:
            incumbent = state["incumbent"]
        else:
            for incumbent in initial_layouts(sc):
                result = evaluate(ctx.engine, base, incumbent, ctx.config)
                if "invalid" not in result:
                    break
                log.info("initial layout does not build; trying the next", reason=repr(result["invalid"]))
        if "invalid" in result:
            raise UserError(f"{ctx.config['path']}: search", f"the initial layout does not build: {result['invalid']}")
        cycles, room = result["cycles"], rooms(result)
        log.info("validated search incumbent", cycles=cycles, resuming=resuming)
        sc.estimator.forget(keep=incumbent)
        if pool.executor is not None:
            # the incumbent's values (a gigabyte on ViT-B/16): the workers evaluate; this process
            # only screens until the search ends, and then reads what it needs from the store
            ctx.engine.forget_values()
            give_back_memory()
        if not resuming:
            # the first save comes after the tile-mapping screen, so a resumed search never
            # skips a step an uninterrupted one takes
            state = {"key": key, "incumbent": incumbent, "cycles": cycles, "attempts": 0, "round": 0,
                     "visited": [canonical.digest_of(incumbent)], "history": [], "heuristics": {}}
            incumbent, cycles, room = _screen_mappings(sc, incumbent, cycles, room, pool, state)
            state["incumbent"], state["cycles"] = incumbent, cycles
            state["visited"] = sorted(set(state["visited"]) | {canonical.digest_of(incumbent)})
            _save(path, state)
        visited = set(state["visited"])
        # the budget is counted (rounds, evaluations), never timed: the same layout at any load
        while state["round"] < cfg["rounds"] and state["attempts"] < cfg["evaluations"]:
            rnd = state["round"] + 1
            t0 = time.perf_counter()
            sc.room = room
            proposals = [(h.name, ch) for h in found for ch in _proposals(h, incumbent, sc)]
            screened = screen_round(proposals, incumbent, sc, visited, cfg["shortlist"], [h.name for h in found],
                                    **room)
            per = screened.heuristics
            log.info("screened local search round", round=rnd, proposed=len(proposals), **screened.counts,
                     **screened.invalid, **_by_heuristic(per, ROUND_FIELDS))
            screen_s = time.perf_counter() - t0
            sc.estimator.forget(keep=incumbent)
            shortlist = screened.shortlist[:cfg["evaluations"] - state["attempts"]]
            if not shortlist:
                _count_round(state, rnd, per)
                state["round"] = cfg["rounds"]
                break
            log.info("evaluating ordered local candidates concurrently", candidates=len(shortlist),
                     threads=cfg["workers"])
            jobs = [(state["attempts"] + i + 1, pid, layout) for i, (pid, layout, _, _) in enumerate(shortlist)]
            t1 = time.perf_counter()
            results = pool.map(jobs)
            eval_s = time.perf_counter() - t1
            state["attempts"] += len(jobs)
            hits = sum(r.get("hits", 0) for r in results)
            misses = sum(r.get("misses", 0) for r in results)
            improved = []
            for (attempt, pid, layout), (_, _, changes, name), r in zip(jobs, shortlist, results):
                visited.add(canonical.digest_of(layout))
                per[name]["evaluated"] += 1
                if "invalid" in r:
                    log.info("rejected invalid local candidate", attempt=attempt, proposal=pid, reason=r["invalid"])
                    continue
                if r["cycles"] < cycles:
                    per[name]["improved"] += 1
                    improved.append((r["cycles"], attempt, layout, [(changes, name, pid)], r))
            improved.sort(key=lambda t: t[:2])
            best = improved[0] if improved else None
            # disjoint improvements often add up (a repeated block's operations): they are
            # evaluated together once more, and if that does not build (memory), the best two
            # together; the sum is kept only if it beats the best alone
            taken = combined([t[2] for t in improved], incumbent)[1]
            for subset in (taken, taken[:2]):
                if len(subset) < 2 or state["attempts"] >= cfg["evaluations"]:
                    break
                union = combined([improved[i][2] for i in subset], incumbent)[0]
                if canonical.digest_of(union) in visited:
                    break
                parts = [improved[i][3][0] for i in subset]
                state["attempts"] += 1
                attempt, pid = state["attempts"], "+".join(p for _, _, p in parts)
                (r,) = pool.map([(attempt, pid, union)])
                visited.add(canonical.digest_of(union))
                log.info("evaluated combined local candidates", attempt=attempt, proposals=pid,
                         cycles=r.get("cycles", "invalid"))
                if "invalid" not in r:
                    if r["cycles"] < best[0]:
                        best = (r["cycles"], attempt, union, parts, r)
                    break
            log.info("measured local search round", round=rnd, proposals_per_s=f"{len(proposals) / max(screen_s, 1e-9):.0f}",
                     evaluations_per_s=f"{len(jobs) / max(eval_s, 1e-9):.2f}",
                     cache_hit_rate=f"{hits / max(1, hits + misses):.2f}")
            state["round"] = rnd
            built = sum("invalid" not in r for r in results)
            if best is None and not built:
                # none of them builds: that says nothing of the incumbent, so the next round
                # screens again (what was evaluated is visited) and takes the next shortlist
                log.info("retained incumbent layout: no candidate built", round=rnd)
                _count_round(state, rnd, per)
            elif best is None:
                log.info("retained incumbent layout: no candidate improved", round=rnd)
                _count_round(state, rnd, per)
                state["round"] = cfg["rounds"]
            else:
                _, attempt, layout, parts, r = best
                for _, name, _ in parts:
                    per[name]["accepted"] += 1
                name, pid = parts[0][1], "+".join(p for _, _, p in parts)
                log.info("accepted local layout improvement", attempt=attempt, before=cycles, after=r["cycles"],
                         delta="; ".join(ch.describe(graph, policy) for ch, _, _ in parts), heuristic=name,
                         proposal=pid)
                _count_round(state, rnd, per)
                state["history"].append({"round": rnd, "before": cycles, "after": r["cycles"],
                                         "heuristic": name, "proposal": pid})
                incumbent, cycles, room = layout, r["cycles"], rooms(r)
                state["incumbent"], state["cycles"] = incumbent, cycles
            state["visited"] = sorted(visited)
            _save(path, state)
        h = state["history"]   # the search's convergence, for the report
        return incumbent, {"initial_cycles": h[0]["before"] if h else state["cycles"], "history": h,
                           "heuristics": state.get("heuristics", {})}
    finally:
        pool.close()


def _check_fits(graph, tiles: int, machine: dict, where: str) -> None:
    """Stop at once, in one line, when the model cannot fit the tiles' memory whatever the
    layout (before any layout is planned: on a large model that takes minutes). What it needs
    at least: its constants, all resident for the whole program, and the operation whose
    activations (its outputs and its inputs that are not constants) weigh most, live at once
    beside them."""
    mem = machine["memory"]
    per_tile = mem["loader_limit"] - mem["sram_base"]
    held = set(graph.constants)
    resident = sum(graph.values[v].nbytes for v in held)
    live, widest = 0, None
    for op in graph.ops:
        n = sum(graph.values[v].nbytes for v in {*op.outputs, *(i for i in op.inputs if i not in held)})
        if n > live:
            live, widest = n, op
    need = resident + live
    if need > tiles * per_tile:
        mib = lambda n: f"{n / 2**20:,.1f} MiB"  # noqa: E731
        holds = f"{tiles} tile{'s' if tiles != 1 else ''} hold{'s' if tiles == 1 else ''}"
        busiest = f", operation {widest.name}'s activations {mib(live)}" if widest is not None else ""
        raise UserError(f"{where}: target.tile_count",
                        f"the model needs at least {mib(need)} (constants {mib(resident)}{busiest}), "
                        f"more than {holds} ({mib(tiles * per_tile)}: {per_tile:,} bytes a tile); it needs at "
                        f"least {-(-need // per_tile):,} tiles, or a smaller model")


def _weight(ch: Changes, baseline: Baseline) -> tuple[int, int | None]:
    """The incumbent's estimates of the operations a change touches, summed (what it could
    save at most: a change of twelve blocks' matmuls weighs twelve), and the costliest of them."""
    terms = baseline.terms
    touched = {op for op, _ in (*ch.plans, *ch.boundaries) if terms.get(op) is not None}
    if not touched:
        return 0, None
    return sum(terms[op].cycles for op in touched), max(touched, key=lambda op: (terms[op].cycles, op))


#: how many of one heuristic's proposals for one operation screening takes before it turns to
#: the next costliest operation
SCREEN_CHUNK = 32


def _screening_order(proposals: list, baseline: Baseline) -> list[int]:
    """The proposals' indices in the order screening takes them: by what each one touches
    (``_weight``), costliest first, ``SCREEN_CHUNK`` of each heuristic's
    proposals for an operation at a time (in the order proposed), so that a budget spent before
    the end reaches more operations, and more heuristics, than the one with the most plans
    (on ViT-B/16 one matmul's 305 re-plans spent a round's whole budget)."""
    turns: collections.Counter = collections.Counter()
    keys = []
    for i, (name, ch) in enumerate(proposals):
        weight, op = _weight(ch, baseline)
        keys.append((turns[name, op] // SCREEN_CHUNK, -weight, i))
        turns[name, op] += 1
    return [k[2] for k in sorted(keys)]


def mapping_candidates(layout: dict, tile_count: int) -> list[dict]:
    """Whole-program tile mappings: operation i starts at tile (i * stride) mod tile_count."""
    out = []
    for stride in (1, 2, 3, 4, 5, 7, 8, 16):
        ops = {k: dict(v, offset=(int(k) * stride) % tile_count) for k, v in layout["ops"].items()}
        out.append(dict(layout, ops=ops))
    return out


def _screen_mappings(sc, incumbent, cycles, room, pool, state):
    """Screen whole-program tile mappings by exchange resource load (the estimator's busiest
    port); evaluate the best one exactly, unless it needs more on some tile than the
    incumbent's ``room`` (``rooms``) has, and keep it only if it is cheaper: the layout, its
    cycles and its room."""
    est = sc.estimator
    candidates = mapping_candidates(incumbent, sc.tile_count)
    base_c, base_p = est.estimate(incumbent), est.pressure(incumbent)
    scored = sorted((est.estimate(c), est.pressure(c), i) for i, c in enumerate(candidates))
    best_c, best_p, i = scored[0]
    log.info("screened tile mappings by exchange resource load", candidates=len(candidates),
             baseline_cycles=base_c, candidate_cycles=best_c, baseline_pressure=base_p, candidate_pressure=best_p)
    if best_c < base_c and room is not None and not Baseline(est, incumbent, **room).compare(candidates[i])[1]:
        log.info("refused tile mapping: over the estimator's caps, or more than the incumbent's placement "
                 "has room for, on some tile")
    elif best_c < base_c:
        state["attempts"] += 1
        r = pool.map([(state["attempts"], i, candidates[i])])[0]
        if "invalid" not in r and r["cycles"] < cycles:
            log.info("accepted tile mapping", before=cycles, after=r["cycles"])
            state["history"].append({"round": 0, "before": cycles, "after": r["cycles"]})
            return candidates[i], r["cycles"], rooms(r)
    log.info("retained incumbent tile mapping")
    return incumbent, cycles, room


def _proposals(h: Heuristic, layout, sc) -> list:
    try:
        out = h.propose(layout, sc)
    except Exception as exc:  # noqa: BLE001
        raise UserError(f"search heuristic {h.name}", f"propose raised {type(exc).__name__}: {exc}") from None
    if not isinstance(out, (list, tuple)) or not all(isinstance(c, Changes) for c in out):
        raise UserError(f"search heuristic {h.name}", "propose must return a list of ipubuild.search.Changes")
    for i, c in enumerate(out):
        for field in ("plans", "boundaries"):
            pairs = getattr(c, field)
            if not isinstance(pairs, (list, tuple)) or not all(
                    isinstance(p, (list, tuple)) and len(p) == 2 and all(isinstance(x, numbers.Integral) for x in p)
                    for p in pairs):
                raise UserError(f"search heuristic {h.name}", f"proposal {i}: Changes.{field} must be "
                                f"((operation id, int), ...) pairs of integers, not {pairs!r:.80}")
    return list(out)


#: distinct operation estimates a round's screening may ask for on 64 tiles (in proportion fewer
#: on larger machines, where each costs more: about 1000 on ViT-B/16's 1472 tiles); counted
#: whether or not the estimator has them cached, so a resumed search screens what an
#: uninterrupted one does. vit_fp8 never reaches it
SCREEN_BUDGET = 1_500_000 // 64


@dataclasses.dataclass
class Screening:
    """A round's proposals screened: ``counts`` (each proposal counted once: ``invalid``,
    ``visited``, ``not_cheaper``, ``deduplicated``, ``truncated``, ``shortlisted``,
    ``unscreened``), the invalid ones by reason (INVALID_REASONS), each heuristic's counts
    (HEURISTIC_COUNTS; the search adds ``evaluated``, ``improved`` and ``accepted``) and the
    shortlist ``[(proposal id, layout, changes, heuristic)]``, the cheapest estimate first."""
    counts: dict
    invalid: dict
    heuristics: dict
    shortlist: list


def screen_round(proposals, incumbent, sc, visited, shortlist_size, heuristics=(), headroom=None,
                 code_room=None) -> Screening:
    """Screen ``[(heuristic name, Changes), ...]`` (in the heuristics' order): drop the invalid
    ones (by reason: ``over_memory`` includes those that would add more data or code on a tile
    than the incumbent's ``headroom`` or ``code_room`` there, when known: see ``Baseline``),
    those already evaluated
    (``visited``: layout digests) and repeats, estimate the rest, keep ``shortlist_size`` of
    those the estimate finds cheaper than the incumbent, cheapest first (ties: the earlier
    proposal), the cheapest on distinct operations first (``_diverse``). Proposals are
    screened in ``_screening_order`` (the costliest operations they change first, a chunk of
    each at a time) until SCREEN_BUDGET is spent, and then each heuristic's first in that order
    if none of its proposals was screened; the rest count as ``unscreened``. A
    proposal's id is ``<heuristic>#<index>``: its index in the list its heuristic returned
    this round. Of proposals giving one layout, the earliest speaks for
    it; the others count as ``deduplicated`` (for their heuristics). ``heuristics`` names
    heuristics to count even if they proposed nothing."""
    counts = dict(invalid=0, visited=0, not_cheaper=0, deduplicated=0, truncated=0, shortlisted=0, unscreened=0)
    invalid = dict.fromkeys(INVALID_REASONS, 0)
    per: dict[str, dict] = {name: dict.fromkeys(HEURISTIC_COUNTS, 0) for name in heuristics}
    ids = []
    for order, (name, _) in enumerate(proposals):
        c = per.setdefault(name, dict.fromkeys(HEURISTIC_COUNTS, 0))
        ids.append(f"{name}#{c['proposed']}" if name else order)
        c["proposed"] += 1
    est = sc.estimator
    baseline = Baseline(est, incumbent, headroom, code_room)
    first, cheaper = {}, {}     # layout digest -> (order, heuristic) of its speaker; -> its shortlist entry
    budget = SCREEN_BUDGET * 64 // max(64, sc.tile_count)
    ranked = _screening_order(proposals, baseline)
    reached = set()         # the heuristics with a proposal screened
    for order in ranked:
        name, ch = proposals[order]
        c = per[name]
        # counted the same whatever the estimator has cached; past the budget, each heuristic's
        # first proposal still: one bundled change (settle_light) is not starved by re-plans
        if len(baseline.asked) >= budget and name in reached:
            counts["unscreened"] += 1
            c["unscreened"] += 1
            continue
        reached.add(name)
        layout, reason = ch._applied(incumbent, sc.plans, sc.tile_count)
        if reason is None:
            e, fits = baseline.compare(layout)
            if not fits:         # not valid, or over the cap of constants or code on some tile
                reason = "unfollowable" if e is None else "over_memory"
        if reason is not None:
            counts["invalid"] += 1
            invalid[reason] += 1
            c[reason] += 1
            continue
        c["fit"] += 1
        d = canonical.digest_of(layout)
        if d in visited:
            counts["visited"] += 1
            c["visited"] += 1
            continue
        if d in first:
            counts["deduplicated"] += 1
            spoke, speaker = first[d]
            if order > spoke:
                c["deduplicated"] += 1
                continue
            # screened later but proposed earlier: this proposal speaks for the layout
            first[d] = (order, name)
            per[speaker]["deduplicated"] += 1
            if d in cheaper:
                per[speaker]["cheaper"] -= 1
                c["cheaper"] += 1
                cheaper[d] = (e, order, ids[order], layout, ch, name)
            continue
        first[d] = (order, name)
        if e >= baseline.total:
            counts["not_cheaper"] += 1
            continue
        c["cheaper"] += 1
        cheaper[d] = (e, order, ids[order], layout, ch, name)
    short = _diverse(sorted(cheaper.values(), key=lambda t: (t[0], t[1])), shortlist_size)
    for *_, name in short:
        per[name]["shortlisted"] += 1
    counts["truncated"] = len(cheaper) - len(short)
    counts["shortlisted"] = len(short)
    return Screening(counts, invalid, per, [(pid, layout, ch, name) for _, _, pid, layout, ch, name in short])


def _diverse(ranked: list, size: int) -> list:
    """``size`` of ``ranked`` (shortlist entries, cheapest estimate first): first each entry
    that touches no operation an earlier one taken touches, then the rest in order. The
    cheapest estimates are often one operation's neighbouring plans, and only improvements on
    distinct operations can be combined."""
    taken, rest, ops = [], [], set()
    for entry in ranked:
        mine = _touched(entry[4])
        if mine & ops:
            rest.append(entry)
        else:
            taken.append(entry)
            ops |= mine
    return sorted((taken + rest)[:size], key=lambda t: (t[0], t[1]))


def _touched(ch: Changes) -> set[int]:
    return {op for op, _ in (*ch.plans, *ch.boundaries)}


def _differing(layout: dict, incumbent: dict) -> dict:
    """The operations' choices in ``layout`` that differ from ``incumbent``'s."""
    return {k: v for k, v in layout["ops"].items() if incumbent["ops"].get(k) != v}


def combined(improved: list[dict], incumbent: dict) -> tuple[dict | None, list[int]]:
    """The incumbent with the changes of each of the ``improved`` layouts (best first) that
    touches no operation a better one changed, and which of them it took; None if it would take
    fewer than two."""
    ops, taken = {}, []
    for i, layout in enumerate(improved):
        diff = _differing(layout, incumbent)
        if diff and not diff.keys() & ops.keys():
            ops.update(diff)
            taken.append(i)
    return (dict(incumbent, ops={**incumbent["ops"], **ops}) if len(taken) > 1 else None), taken


def screen(proposals, incumbent, sc, visited, shortlist_size):
    """``screen_round`` of a list of ``Changes`` (their ids: 0, 1, …) or ``(heuristic, Changes)``
    pairs: its counts and its shortlist ``[(proposal id, layout, changes)]``."""
    s = screen_round([p if isinstance(p, tuple) else ("", p) for p in proposals], incumbent, sc, visited,
                     shortlist_size)
    return s.counts, [(pid, layout, ch) for pid, layout, ch, _ in s.shortlist]


#: each heuristic's counts on the round's log line (after ``fit``, the unscreened and invalid
#: ones that are not 0): every screening count, so that they add up to ``proposed``
ROUND_FIELDS = ("proposed", "fit", "visited", "deduplicated", "cheaper", "shortlisted")


def _by_heuristic(per: dict, keys) -> dict:
    """Log fields, one per heuristic: ``<name>="proposed=N fit=N …"`` (after ``fit``, those of
    ``unscreened`` and the invalid reasons that are not 0)."""
    def fields(c):
        if "fit" in keys:
            at = keys.index("fit") + 1
            keys_c = [*keys[:at], *(k for k in ("unscreened", *INVALID_REASONS) if c[k]), *keys[at:]]
        else:
            keys_c = keys
        return '"' + " ".join(f"{k}={c[k]}" for k in keys_c) + '"'
    return {name: fields(c) for name, c in per.items() if name}


def _count_round(state: dict, rnd: int, per: dict) -> None:
    """Log each heuristic's counts of round ``rnd`` and add them to the state's sums."""
    log.info("counted local search round by heuristic", round=rnd,
             **_by_heuristic(per, ("proposed", "fit", "cheaper", "evaluated", "improved", "accepted")))
    sums = state.setdefault("heuristics", {})
    for name, c in per.items():
        total = sums.setdefault(name, dict.fromkeys(HEURISTIC_COUNTS, 0))
        for k, n in c.items():
            total[k] = total.get(k, 0) + n

