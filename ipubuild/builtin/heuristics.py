"""The built-in layout-search heuristics: re-plan one operation, let operations take their
producers' blocks, align a chain of row-wise operations on one plan, move an operation's tiles
onto its producer's, descend: re-plan several coupled operations together along the
estimator's steepest path, regrid: put a matmul on the grids a closed-form estimate ranks best,
align_columns: on the grids whose column blocks are whole 32-column blocks (one matmul, or
all those alike at once), and reshape_alike: all the matmuls alike on the grid one trade from
theirs that a closed-form estimate ranks best, widen_rows and settle_light (the row-wise and
the light operations), and grid_heads: the attention operations alike on a grid of their heads."""
from __future__ import annotations

from .. import hookimpl
from ..compiler.gridplan import aligned_variants, grid_cost, neighbour_grids, ranked_grids
from ..compiler.estimator import Baseline
from ..compiler.search import Changes, Heuristic
from ..graph.operators import registry

#: how many single re-plans one descent chains at most
DESCENT_STEPS = 24
#: how many changes one descent may estimate in all on 64 tiles (vit_fp8's takes about 8000);
#: an estimate's cost grows with the tiles, so the budget shrinks in proportion on larger
#: machines (870 on 1472 tiles), and the costliest operations are tried first
DESCENT_BUDGET = 20000
#: how many of a matmul's best-ranked grids ``regrid`` proposes
REGRID_PLANS = 4


def replan(layout, sc):
    """Each operation on each of its other plans."""
    return [Changes(plans=((op.id, p),)) for op in sc.graph.ops for p in range(len(sc.plans[op.id]))
            if p != layout["ops"][str(op.id)]["plan"]]


def take_producer_blocks(layout, sc):
    """Each operation that can follow its producer's blocks (a cast, an activation, a residual
    add, ...) and does not: follow them, so that input needs no exchange."""
    out = []
    for op in sc.graph.ops:
        current = layout["ops"][str(op.id)]["plan"]
        out += [Changes(plans=((op.id, i),)) for i, p in enumerate(sc.plans[op.id])
                if "follow" in p and i != current]
    return out


def _rows_only(plans) -> bool:
    own = [p for p in plans if "follow" not in p]
    return bool(own) and all("rows" in p and len(p) == 1 for p in own)


def align_chains(layout, sc):
    """Runs of consecutive operations that all split rows: move the whole run to one row count
    (and the producer's offset), so data stays on its tile between them."""
    out, run = [], []
    ops = sc.graph.ops
    for op in ops + [None]:
        ok = op is not None and _rows_only(sc.plans[op.id]) \
            and (not run or any(v in ops[run[-1]].outputs for v in op.inputs))
        if ok:
            run.append(op.id)
            continue
        if len(run) > 1:
            counts = sorted({p["rows"] for i in run for p in sc.plans[i] if "rows" in p}, reverse=True)
            for c in counts:
                plans = tuple((i, j) for i in run for j, p in enumerate(sc.plans[i]) if p == {"rows": c})
                out.append(Changes(plans=plans, boundaries=tuple((i, 0) for i, _ in plans)))
        run = [op.id] if op is not None and _rows_only(sc.plans[op.id]) else []
    return out


def widen_rows(layout, sc):
    """The operations whose own plans all split rows (layer norms, ...), each operator's
    together, on the plan with the most rows, where they are on another plan of their own
    (not following). A row-wise operation gains little alone, so its re-plan is rarely screened
    and never shortlisted before a matmul's; a network's twelve of them together are not little."""
    by_type: dict[str, list] = {}
    for op in sc.graph.ops:
        plans = sc.plans[op.id]
        if not _rows_only(plans):
            continue
        mine = layout["ops"][str(op.id)]["plan"]
        widest = _most_rows(plans)
        if "follow" not in plans[mine] and mine != widest:
            by_type.setdefault(op.type, []).append((op.id, widest))
    return [Changes(plans=tuple(changes)) for _, changes in sorted(by_type.items())]


def _most_rows(plans: list[dict]) -> int | None:
    """The index of the row split (``{"rows": n}``) with the most rows, the first of equals;
    None without one."""
    rows = [i for i, p in enumerate(plans) if set(p) == {"rows"}]
    return max(rows, key=lambda i: (plans[i]["rows"], -i)) if rows else None


def grid_heads(layout, sc):
    """The attention operations of each type together on each of their grid plans (each head's
    output over rows × columns of its tiles: plans with ``cols``), where they are on another,
    each starting where it starts now. A row-wise operation following one of them (the softmax
    after the scores), which cannot follow a grid's blocks, moves with it onto its own plan of
    the most rows, from the same tile. On ViT-B/16 one block's scores and softmax gain ~2,200
    cycles estimated so (a tile receives its rows' and keys' share of Q and K, not a head's whole
    K), one block's context ~650: too little to be shortlisted alone behind the matmuls'
    changes; twelve blocks' together are not little."""
    est, reg = sc.estimator, registry()
    resolved = est.resolve(layout)
    alike: dict[tuple, list] = {}
    for op in sc.graph.ops:
        mine = layout["ops"][str(op.id)]["plan"]
        for i, plan in enumerate(sc.plans[op.id]):
            if "cols" in plan and i != mine:
                alike.setdefault((op.type, i), []).append(op.id)
    out = []
    for (_, i), ops in sorted(alike.items()):
        plans, boundaries = [], []
        for op_id in ops:
            offset = resolved[op_id][1]
            plans.append((op_id, i))
            boundaries.append((op_id, offset))
            for c in sorted(est.consumers(op_id)):
                own = sc.plans[c]
                widest = _most_rows(own)
                if widest is not None and reg.get(sc.graph.ops[c].type).follows == "rows" \
                        and "follow" in own[layout["ops"][str(c)]["plan"]]:
                    plans.append((c, widest))
                    boundaries.append((c, offset))
        out.append(Changes(plans=tuple(plans), boundaries=tuple(boundaries)))
    return out


def settle_light(layout, sc):
    """One pass over the light operations — those that can follow a producer's blocks (layer
    norms, residual adds, casts, ...) — in program order: each on the plan the estimator finds
    cheapest, given the pass's earlier choices, if that is cheaper than its own and the layout
    stays within the incumbent's room as screening will hold the proposal (``sc.room``; without
    one, the caps); every choice made, together, as one proposal. Alone such a change gains
    little (on ViT-B/16 a residual add following its other operand gains 1–2 k cycles), so a
    round's shortlist, which takes the largest gains first, leaves it, and ``descend``, the
    costliest operations first, spends its budget before it comes to them."""
    est, reg = sc.estimator, registry()
    base = Baseline(est, layout, **(sc.room or {}))     # holds each step within what screening will
    current = {"ops": {k: dict(v) for k, v in layout["ops"].items()}}
    chosen: dict[int, int] = {}
    res = est.resolve(current)
    for op in sc.graph.ops:
        if reg.get(op.type).follows is None:
            continue
        mine = current["ops"][str(op.id)]["plan"]
        moves = sorted((d, p) for p in range(len(sc.plans[op.id])) if p != mine
                       and (d := est.delta(current, res, {op.id: p})) is not None and d < 0)
        for _, p in moves:
            trial = _replanned(current, {op.id: p})
            if base.compare(trial)[1]:
                current, chosen[op.id] = trial, p
                res = est.resolve(current)
                break
    return [Changes(plans=tuple(sorted(chosen.items())))] if chosen else []


def _replanned(layout: dict, changes: dict[int, int]) -> dict:
    """``layout``'s operations, each in ``changes`` (``{operation id: plan index}``) on that plan."""
    return {"ops": dict(layout["ops"], **{str(i): dict(layout["ops"][str(i)], plan=p) for i, p in changes.items()})}


def follow_producer(layout, sc):
    """Start an operation's tiles where its first activation input's producer starts."""
    out = []
    for op in sc.graph.ops:
        for v in op.inputs:
            p = sc.producer.get(v)
            if p is not None:
                off = layout["ops"][str(p.id)]["offset"]
                if off != layout["ops"][str(op.id)]["offset"]:
                    out.append(Changes(boundaries=((op.id, off),)))
                break
    return out


def descend(layout, sc):
    """Coupled changes: from the incumbent, take the change the estimator finds best (and
    within the incumbent's room) — one operation re-planned, alone or with the operations that read
    its blocks then following them — then the best from there, and so on while the estimate
    improves (at most DESCENT_STEPS, within DESCENT_BUDGET estimates); propose every prefix of
    that path as one change. A plan whose gain shows only once the operations it feeds change
    too is reached this way, which single re-plans screened one at a time cannot reach. Each
    step is held within the incumbent's room as screening holds the proposal (``sc.room``)."""
    est = sc.estimator
    base = Baseline(est, layout, **(sc.room or {}))     # holds each step within what screening will
    current = {"ops": {k: dict(v) for k, v in layout["ops"].items()}}
    chosen: dict[int, int] = {}
    out = []
    budget = DESCENT_BUDGET * 64 // max(64, sc.tile_count)
    for _ in range(DESCENT_STEPS):
        res = est.resolve(current)
        costliest = sorted(sc.graph.ops, key=lambda op: (-(est.term(op, current, res) or (0,))[0], op.id))
        moves = []
        for op in costliest:
            mine = current["ops"][str(op.id)]["plan"]
            readers = _readers_that_could_follow(current, sc, op.id)
            for p in range(len(sc.plans[op.id])):
                if p == mine:
                    continue
                # alone, and with the readers of its blocks following them
                for change in ({op.id: p}, {op.id: p, **readers}):
                    if budget > 0 and (len(change) == 1 or readers):
                        budget -= 1
                        d = est.delta(current, res, change)
                        if d is not None and d < 0:
                            moves.append((d, tuple(sorted(change.items()))))
        for d, change in sorted(moves):
            trial = _replanned(current, dict(change))
            if base.compare(trial)[1]:
                current = trial
                chosen.update(change)
                out.append(Changes(plans=tuple(sorted(chosen.items()))))
                break
        else:
            break
    return out


def regrid(layout, sc):
    """Each matmul on each of the ``REGRID_PLANS`` grids a closed-form estimate of exchange +
    compute ranks best among those whose weights fit a tile (``gridplan.ranked_grids``), alone
    and with the readers of its blocks following them."""
    out = []
    for op in sc.graph.ops:
        if op.type != "matmul":
            continue
        mine = layout["ops"][str(op.id)]["plan"]
        readers = _readers_that_could_follow(layout, sc, op.id)
        for p in ranked_grids(sc.graph, op, sc.plans[op.id], sc.machine, tile_cap=sc.estimator.cap // 2)[:REGRID_PLANS]:
            if p != mine:
                out.append(Changes(plans=((op.id, p),)))
                if readers:
                    out.append(Changes(plans=tuple(sorted({op.id: p, **readers}.items()))))
    return out


def align_columns(layout, sc):
    """Each matmul on the grids of its K-slices whose column blocks are whole 32-column blocks,
    nearest its own (``gridplan.aligned_variants``): a reader of a few of its columns (an
    attention head of a fused QKV) then takes each block in one transfer, not one a row. Then
    each such grid for all the matmuls alike (``_alike``: a network's repeated blocks) at once:
    one block's gain is a twelfth of ViT-B/16's, and a round shortlists a few changes."""
    def variants(op_id):
        mine = layout["ops"][str(op_id)]["plan"]
        return aligned_variants(sc.plans[op_id], [mine], sc.graph.values[sc.graph.ops[op_id].outputs[0]].cols)

    out = [Changes(plans=((op.id, p),)) for op in sc.graph.ops if op.type == "matmul" for p in variants(op.id)]
    for group in _alike(layout, sc, "matmul"):
        if len(group) > 1:
            out += [Changes(plans=tuple((op, p) for op in group)) for p in variants(group[0])]
    return out


def reshape_alike(layout, sc):
    """All the matmuls alike (``_alike``: a network's repeated blocks) at once on the grid one
    trade from theirs (``gridplan.neighbour_grids``: twice the rows for half the columns, and
    so on) that the closed-form estimate (``gridplan.grid_cost``) finds cheapest, if it finds
    it cheaper than theirs. ``replan`` proposes each block's grids one block at a time, and one
    block's gain is a twelfth of ViT-B/16's: a round shortlists a few changes, and never got to
    the rest. One proposal a group: each screens a dozen operations, from a budget that all the
    heuristics share.

    Where matmuls of the same shapes are on different grids (a few blocks that earlier rounds
    moved on their own), one more proposal moves them all onto that trade of the grid most of
    them are on: the blocks that went their own way often hold the memory (their grids keep
    more copies of their weights) that the trade needs."""
    out = []
    for group in _alike(layout, sc, "matmul"):
        if len(group) > 1:
            best = _best_trade(layout, sc, group)
            if best is not None:
                out.append(Changes(plans=tuple((i, best) for i in group)))
    for kin in _alike(layout, sc, "matmul", by_plan=False):
        plans = [layout["ops"][str(i)]["plan"] for i in kin]
        if len(set(plans)) > 1:
            most = min(set(plans), key=lambda p: (-plans.count(p), p))
            best = _best_trade(layout, sc, [i for i, p in zip(kin, plans) if p == most])
            if best is not None:
                out.append(Changes(plans=tuple((i, best) for i in kin)))
    return out


def _best_trade(layout, sc, group) -> int | None:
    """The plan one trade from ``group``'s (all on one plan) that ``grid_cost`` ranks cheapest,
    if it ranks it cheaper than theirs."""
    op, plans = sc.graph.ops[group[0]], sc.plans[group[0]]
    mine = layout["ops"][str(op.id)]["plan"]
    cost = lambda p: grid_cost(sc.graph, op, plans[p], sc.machine)[0]  # noqa: E731
    best = min(neighbour_grids(plans, mine), key=lambda p: (cost(p), p), default=None)
    return best if best is not None and cost(best) < cost(mine) else None


def _alike(layout, sc, kind: str, *, by_plan: bool = True) -> list[list[int]]:
    """The operations of type ``kind`` in groups of those alike: the same inputs' and outputs'
    shapes and types, the same plans, and (``by_plan``) the same plan in ``layout``; in program
    order."""
    groups: dict = {}
    for op in sc.graph.ops:
        if op.type == kind:
            shapes = tuple((sc.graph.values[v].shape, sc.graph.values[v].dtype) for v in (*op.inputs, *op.outputs))
            plans = tuple(tuple(sorted(p.items())) for p in sc.plans[op.id])
            chosen = layout["ops"][str(op.id)]["plan"] if by_plan else None
            groups.setdefault((shapes, plans, chosen), []).append(op.id)
    return sorted(groups.values())


def _readers_that_could_follow(layout, sc, op_id) -> dict[int, int]:
    """``{reader: its follow plan}`` for each operation that reads ``op_id``'s blocks (its
    output, or its followers') without following them but could."""
    chain = {op_id} | sc.estimator.followers(layout, op_id)
    values = {v: i for i in chain for v in sc.graph.ops[i].outputs}
    out = {}
    for op in sc.graph.ops[op_id + 1:]:
        if op.id in chain:
            continue
        for j, p in enumerate(sc.plans[op.id]):
            if "follow" in p and op.inputs[p["follow"]] in values and j != layout["ops"][str(op.id)]["plan"]:
                out[op.id] = j
                break
    return out


@hookimpl
def ipubuild_search_heuristics():
    return [Heuristic("replan", replan), Heuristic("align_columns", align_columns),
            Heuristic("take_producer_blocks", take_producer_blocks),
            Heuristic("align_chains", align_chains), Heuristic("follow_producer", follow_producer),
            Heuristic("descend", descend), Heuristic("regrid", regrid), Heuristic("reshape_alike", reshape_alike),
            Heuristic("widen_rows", widen_rows), Heuristic("settle_light", settle_light),
            Heuristic("grid_heads", grid_heads)]
