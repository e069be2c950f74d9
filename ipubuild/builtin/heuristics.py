"""The built-in layout-search heuristics: re-plan one operation, let operations take their
producers' blocks, align a chain of row-wise operations on one plan, move an operation's tiles
onto its producer's, and descend: re-plan several coupled operations together along the
estimator's steepest path."""
from __future__ import annotations

from .. import hookimpl
from ..search import Changes, Heuristic

#: how many single re-plans one descent chains at most
DESCENT_STEPS = 24


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
    """Coupled changes: from the incumbent, take the single re-plan the estimator finds best
    (and within the constant cap), then the best from there, and so on while the estimate
    improves (at most DESCENT_STEPS); propose every prefix of that path as one change. A plan
    whose gain shows only once the operations it feeds change too is reached this way, which
    single re-plans screened one at a time cannot reach."""
    est = sc.estimator
    current = {"ops": {k: dict(v) for k, v in layout["ops"].items()}}
    chosen: dict[int, int] = {}
    out = []
    for _ in range(DESCENT_STEPS):
        res = est.resolve(current)
        moves = []
        for op in sc.graph.ops:
            mine = current["ops"][str(op.id)]["plan"]
            for p in range(len(sc.plans[op.id])):
                if p != mine:
                    d = est.delta(current, res, op.id, p)
                    if d is not None and d < 0:
                        moves.append((d, op.id, p))
        for d, op_id, p in sorted(moves):
            trial = {"ops": dict(current["ops"], **{str(op_id): dict(current["ops"][str(op_id)], plan=p)})}
            if est.fits(trial):
                current, chosen[op_id] = trial, p
                out.append(Changes(plans=tuple(sorted(chosen.items()))))
                break
        else:
            break
    return out


@hookimpl
def ipubuild_search_heuristics():
    return [Heuristic("replan", replan), Heuristic("take_producer_blocks", take_producer_blocks),
            Heuristic("align_chains", align_chains), Heuristic("follow_producer", follow_producer),
            Heuristic("descend", descend)]
