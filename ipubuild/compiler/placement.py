"""The search's starting point: a greedy layout, operation by operation in program order.

An elementwise operation (a cast, an activation, a residual add) takes its producer's blocks —
the cheapest of its follow plans that can — so it exchanges nothing. Any other operation takes
the plan, among its default, up to ``INITIAL_PLANS_TRIED`` spread over its list and its follow
plans, that the estimator finds cheapest, counting what reads its output next (``LOOKAHEAD``):
a plan that is cheap by itself but leaves its output in slivers makes its readers pay.

Memory comes first. A plan that would push a tile's constants or generated code over its cap
loses to one that does not. If, placed that way, some operation finds every plan over a cap —
the earlier ones took the memory on the tiles it needs, as on ViT-B/16, whose weights fill a
third of the machine — placing starts again with an allowance: each operation may copy its
constants onto tiles only ``REPLICATION_SHARE`` of the times the model's weights fit in the
memory for constants, and the plans tried include some that keep to it.
"""
from __future__ import annotations

import numpy as np

from ..engine.log import progress
from .estimator import Loads
from ..graph.operators import registry
from .gridplan import ranked_grids
from .planning.program import default_layout

INITIAL_PLANS_TRIED = 8
SPREAD_FACTOR = 2
LOOKAHEAD = 2
REPLICATION_SHARE = 0.75
GRID_PLANS_TRIED = 4
PROGRESS_SLACK = 1.5
PROGRESS_FLOOR = 0.125
CODE_PROGRESS_FLOOR = 0.5
#: the share of the code cap the allowance's placements keep free besides the kernels'
#: reservations past their first quantum (``Estimator.reservation_excess``), one placement per
#: margin (the next if the exact evaluation finds the last one's code over). The estimate of a
#: tile's program and exchange table is ~1–2 KB (≤ 1.5 % of the cap) under what the exact
#: evaluation finds on ViT-B/16's fullest tiles; a larger margin places worse (1.64 M cycles
#: at 0.1 against 1.37 M at 0.02)
CODE_MARGINS = (0.02, 0.1)


def initial_layouts(sc):
    """The greedy layouts of ``sc.graph`` (a ``search.SearchContext``) to start from, best
    first: placed without an allowance, if that keeps within the caps; then placed with the
    allowance (best effort). The caps model constants and code, not the activations live on a
    tile, so the exact evaluation may still find a layout that does not fit memory: the search
    then takes the next."""
    layout = _Greedy(sc, allowance=False).layout()
    if layout is not None:
        yield layout
    for margin in CODE_MARGINS:
        yield _Greedy(sc, allowance=True, code_margin=margin).layout(best_effort=True)


def initial_layout(sc, found=None) -> dict:
    """The first of ``initial_layouts``."""
    return next(initial_layouts(sc))


def _search_only(plan: dict) -> bool:
    """Plans that the search's heuristics propose and the initial placement does not try: a
    matmul's 32-column aligned grids (given them, it placed ViT-B/16 over memory: see
    ``MatMul.plans``) and attention's grids of its heads (``grid_heads``: placed before the
    softmax that reads it, a grid looks cheaper than it is; with them tried vit_fp8 started at
    63,071 cycles instead of 63,184 and its search ended at 50,290 instead of 48,436)."""
    return bool(plan.get("aligned")) or "cols" in plan


def spread(items: list, n: int) -> list:
    """Up to ``n`` of ``items``, evenly spaced, the first and last included."""
    return sorted({items[i * (len(items) - 1) // max(1, n - 1)] for i in range(n)}) if items else []


class _Greedy:
    def __init__(self, sc, allowance: bool, code_margin: float = 0.0):
        self.code_margin = code_margin
        self.sc, self.est, self.g = sc, sc.estimator, sc.graph
        self.reg = registry()
        self.loads = Loads(self.est)
        g = self.g
        if allowance:
            weights = sum(g.values[v].nbytes for v in g.constants) or 1
            copies = REPLICATION_SHARE * self.est.cap * sc.tile_count / weights
            self.allowed = {}
            for op in g.ops:
                held = sum(g.values[v].nbytes for v in set(op.inputs) if v in g.constants)
                # a row-wise operation's parameters (a layer norm's scale and shift) are small and
                # needed beside every row it works on: it may copy them onto a tile per row
                rows = g.values[op.outputs[0]].rows if self.reg.get(op.type).follows else 0
                self.allowed[op.id] = max(copies, min(rows, sc.tile_count)) * held
            # no tile fills ahead of the model: while placing, a tile's constants stay within
            # the cap's share of the model's constants placed so far (times PROGRESS_SLACK), so
            # the first operations cannot take the memory the last ones need
            self.held = {op.id: sum(g.values[v].nbytes for v in set(op.inputs) if v in g.constants) for op in g.ops}
            self.weights, self.placed = weights, 0
        else:
            self.allowed = None

    def layout(self, best_effort: bool = False) -> dict | None:
        sc, est, g = self.sc, self.est, self.g
        layout = default_layout(g, sc.tile_count)
        cursor = 0
        for n, op in enumerate(g.ops):
            progress("operations placed in the initial layout", n, len(g.ops))
            plans = sc.plans[op.id]
            follow = [i for i, p in enumerate(plans) if "follow" in p]
            own = [i for i, p in enumerate(plans) if not _search_only(p)]
            tried = sorted({0, *spread(own, INITIAL_PLANS_TRIED), *follow})
            if self.reg.get(op.type).follows == "elements":
                tried = [p for p in follow if _term(sc, op, layout, p) is not None] or tried
            elif self.allowed is not None and any(v in g.constants for v in op.inputs):
                within = [i for i, b in enumerate(est.footprints(op))
                          if b is not None and b <= self.allowed[op.id] and not _search_only(plans[i])]
                tried = sorted({*tried, *spread(within, INITIAL_PLANS_TRIED)})
            if op.type == "matmul" and self.allowed is not None:
                # where memory is tight (the weights' copies are rationed), also the grids within
                # the allowance that a closed-form estimate of exchange + compute ranks best
                # (poplibs' way): the spread over the plan list rarely hits them at 1472 tiles
                best_grids = ranked_grids(g, op, plans, sc.machine, tile_cap=est.cap // 2, allowed=self.allowed[op.id])
                tried = sorted({*tried, *best_grids[:GRID_PLANS_TRIED]})
            best = self.place(op, layout, tried)
            if best[0][0] and not best_effort:
                return None
            choice = layout["ops"][str(op.id)]
            choice["plan"] = best[1]
            # the plans it did not take are not lowered again: at 1472 tiles they are gigabytes
            est.resolver.keep_choice(op, est.resolve(layout)[op.id][0])
            if "follow" not in plans[best[1]]:
                choice["offset"] = self.offset(op, layout, cursor)
                used = len({w.tile for st in est.lowering(op, layout).stages for w in st})
                if used * SPREAD_FACTOR <= sc.tile_count:
                    cursor = (cursor + used) % sc.tile_count
            self.loads.add(est.term(op, layout))
            if self.allowed is not None:
                self.placed += self.held[op.id]
        progress("operations placed in the initial layout", len(g.ops), len(g.ops))
        return layout

    def overflow(self, op, term) -> tuple[int, int]:
        """(bytes over the caps of constants or code, bytes of constant copies over the
        operation's allowance)."""
        est, loads = self.est, self.loads
        const = loads.const[term.const_tiles] + term.const_bytes
        cap, code_cap = est.cap, est.code_cap
        if self.allowed is not None:
            code_cap -= est.reservation_excess
            share = PROGRESS_SLACK * (self.placed + self.held[op.id]) / self.weights
            cap = min(cap, int(cap * max(share, PROGRESS_FLOOR)))
            # likewise code (exchange tables grow on the tiles that send to many), by the
            # share of operations placed
            share = PROGRESS_SLACK * (op.id + 1) / len(self.g.ops)
            code_cap = int(min(code_cap * (1 - self.code_margin), code_cap * max(share, CODE_PROGRESS_FLOOR)))
        code = np.zeros(est.T, np.int64)
        code[term.code_tiles] = term.code_bytes
        for name, tiles in term.kernels:
            row = est.kernel_index[name]
            new = tiles if row >= len(loads.kernels) else tiles[loads.kernels[row][tiles] == 0]
            np.add.at(code, new, est.kernel_bytes)
        touched = np.flatnonzero(code)
        code = loads.code_with_kernels()[touched] + code[touched]
        excess = int(np.maximum(const - cap, 0).sum() + np.maximum(code - code_cap, 0).sum())
        over = 0 if self.allowed is None else max(0, int(term.const_bytes.sum() - self.allowed[op.id]))
        return excess, over

    def place(self, op, layout, tried: list[int]) -> tuple | None:
        """The best of the ``tried`` plans of ``op``: ``((bytes over the caps, bytes over the
        allowance, estimated cycles of it and of what reads it next), plan)``."""
        best = None
        for p in tried:
            t = _term(self.sc, op, layout, p)
            if t is None:
                continue
            over = self.overflow(op, t)
            if self.allowed is not None and self.reg.get(op.type).follows == "rows":
                over = (over[0] + self.readers_overflow(op, layout), over[1])
            if best is not None and over > best[0][:2]:
                continue
            key = (*over, t.cycles + (_downstream(self.sc, op, layout) if len(tried) > 1 else 0))
            if best is None or key < best[0]:
                best = (key, p)
        return best

    def readers_overflow(self, op, layout) -> int:
        """Bytes over the caps of the matmuls reading ``op``'s output on their best-ranked grid,
        starting where ``op`` starts, given ``op``'s plan in ``layout``: their exchange tables
        land on ``op``'s tiles (the senders), so a row-wise operation that follows the residual
        stream onto tiles already full of tables moves to fresh tiles instead."""
        sc, est = self.sc, self.est
        start = est.resolve(layout)[op.id][1]
        excess = 0
        for c in (sc.graph.ops[i] for i in sorted(est.consumers(op.id))):
            if c.type != "matmul":
                continue
            grids = ranked_grids(self.g, c, sc.plans[c.id], sc.machine, tile_cap=est.cap // 2, allowed=self.allowed[c.id])
            if not grids:
                continue
            choice = layout["ops"][str(c.id)]
            saved = dict(choice)
            choice.update(plan=grids[0], offset=start)
            t = est.term(c, layout)
            choice.clear()
            choice.update(saved)
            if t is not None:
                excess += self.overflow(c, t)[0]
        return excess

    def offset(self, op, layout, cursor: int) -> int:
        """Where ``op`` (on a plan of its own) starts. On a machine much larger than the
        operation, at the cursor: fresh tiles, spreading code and data over the machine.
        Otherwise where its first producer starts (its data is there), unless that overflows
        a tile's constants or code and the cursor does not."""
        sc, est = self.sc, self.est
        choice = layout["ops"][str(op.id)]
        choice["offset"] = cursor
        used = len({w.tile for st in est.lowering(op, layout).stages for w in st})
        producer = next((sc.producer[v] for v in op.inputs if v in sc.producer), None)
        if used * SPREAD_FACTOR <= sc.tile_count or producer is None:
            return cursor
        at_producer = est.resolve(layout)[producer.id][1]
        for offset in (at_producer, cursor):
            choice["offset"] = offset
            t = est.term(op, layout)
            if t is not None and not self.overflow(op, t)[0]:
                return offset
        return at_producer


def _downstream(sc, op, layout, depth: int = LOOKAHEAD) -> int:
    """Estimated cycles of the operations that read ``op``'s output next (not yet placed),
    given ``op``'s plan in ``layout``: an elementwise one on the cheapest of its plans that
    follow ``op`` and, up to ``depth``, what reads it next; any other on its default plan,
    starting where ``op`` starts. The layout is left as it was."""
    est, reg = sc.estimator, registry()
    start = est.resolve(layout)[op.id][1]
    total = 0
    for c in (sc.graph.ops[i] for i in sorted(est.consumers(op.id))):
        choice = layout["ops"][str(c.id)]
        saved = dict(choice)
        if reg.get(c.type).follows == "elements":
            follow = [i for i, p in enumerate(sc.plans[c.id])
                      if "follow" in p and sc.producer.get(c.inputs[p["follow"]]) is op]
            costs = [(t.cycles, i) for i in follow if (t := _term(sc, c, layout, i)) is not None]
            if costs:
                cost, choice["plan"] = min(costs)
                total += cost + (_downstream(sc, c, layout, depth - 1) if depth > 1 else 0)
        else:
            choice.update(plan=0, offset=start)
            total += t.cycles if (t := est.term(c, layout)) is not None else 0
        choice.clear()
        choice.update(saved)
    return total


def _term(sc, op, layout, plan):
    """The estimator's term of ``op`` on ``plan`` (the layout is left with that plan)."""
    layout["ops"][str(op.id)]["plan"] = plan
    return sc.estimator.term(op, layout)
