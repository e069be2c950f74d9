"""The built-in layout-search heuristics: re-plan one operation, align a chain of row-wise
operations on one plan, and move an operation's tiles onto its producer's."""
from __future__ import annotations

from .. import hookimpl
from ..search import Changes, Heuristic


def replan(layout, sc):
    """Each operation on each of its other plans."""
    return [Changes(plans=((op.id, p),)) for op in sc.graph.ops for p in range(len(sc.plans[op.id]))
            if p != layout["ops"][str(op.id)]["plan"]]


def align_chains(layout, sc):
    """Runs of consecutive operations that all split rows: move the whole run to one row count
    (and the producer's offset), so data stays on its tile between them."""
    out, run = [], []
    ops = sc.graph.ops
    for op in ops + [None]:
        ok = op is not None and all("rows" in p and len(p) == 1 for p in sc.plans[op.id]) \
            and (not run or any(v in ops[run[-1]].outputs for v in op.inputs))
        if ok:
            run.append(op.id)
            continue
        if len(run) > 1:
            counts = sorted({p["rows"] for i in run for p in sc.plans[i]}, reverse=True)
            for c in counts:
                plans = tuple((i, [p["rows"] for p in sc.plans[i]].index(c)) for i in run
                              if c in [p["rows"] for p in sc.plans[i]])
                out.append(Changes(plans=plans, boundaries=tuple((i, 0) for i, _ in plans)))
        run = [op.id] if op is not None and all("rows" in p and len(p) == 1 for p in sc.plans[op.id]) else []
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


@hookimpl
def ipubuild_search_heuristics():
    return [Heuristic("replan", replan), Heuristic("align_chains", align_chains),
            Heuristic("follow_producer", follow_producer)]
