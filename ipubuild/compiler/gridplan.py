"""Choosing a matmul's tile grid (rows × columns × K-slices) by a closed-form estimate, as
poplibs' planner does: per grid, the exchange each tile waits for (its block of the activation,
and with a K split the partial sums it reduces), the slowest tile's compute and the syncs, with
the weights' footprint (how many times the grid copies them) beside it.

The estimate assumes the activation arrives from other tiles, row-contiguous, and that every
tile receives its whole block: it ranks grids, the ``Estimator`` (which knows where the blocks
really are) then judges the few best. The placement and the ``regrid`` heuristic use it to
pick which of a matmul's several hundred grids to estimate at all.
"""
from __future__ import annotations

import itertools
import math

from ..graph.operators import aligned_counts, ceil_div


def grid_cost(graph, op, plan: dict, machine: dict) -> tuple[int, int]:
    """(estimated cycles, bytes of weights held in all) of matmul ``op`` on grid ``plan``
    (``{"m", "n", "k"}``), with what is folded into it: a GELU or a cast in its last kernel, an
    addend received where the sum is written."""
    from ..graph.operators import registry
    a, b = graph.values[op.inputs[0]], graph.values[op.inputs[1]]
    m_, k_, n_ = a.shape[0], a.shape[1], b.shape[1]
    m, n, k = plan["m"], plan["n"], plan["k"]
    x = machine["exchange"]
    rows, depth, cols = ceil_div(m_, m), ceil_div(k_, k), ceil_div(n_, n)
    kernels = registry().kernels
    suffix = ("_gelu" if op.attrs.get("activation") else "") + ("_fp8" if op.attrs.get("to") else "")
    addend = bool(op.attrs.get("addend"))
    name = f"matmul_{a.dtype}_{b.dtype}" + (suffix if k == 1 else "")
    # stage 1: the activation block (a transfer per row unless it spans whole rows), the product
    a_bytes = rows * depth * a.itemsize + (rows * cols * 4 if addend and k == 1 else 0)
    setup = x["transfer_setup_cycles"] * (1 if k == 1 and not addend else rows)
    flags = 4 if addend and k == 1 else 0
    cycles = setup + ceil_div(a_bytes, x["bytes_per_cycle"]) \
        + int(kernels[name].cycles([0, 0, 0, rows, depth, cols, flags, 0, 0, 0], machine)) + x["sync_cycles"]
    if k > 1:
        # stage 2: each K-slice tile sums a 1/k row share of the block's k partial sums (and
        # the addend's share)
        share = ceil_div(rows, k)
        part = share * cols * 4
        terms = k + addend
        cycles += x["transfer_setup_cycles"] * (terms - 1) * share + ceil_div((terms - 1) * part, x["bytes_per_cycle"]) \
            + int(kernels["reduce_f32" + suffix].cycles([0, share * cols, terms], machine)) + x["sync_cycles"]
    held = m * k_ * n_ * b.itemsize if op.inputs[1] in graph.constants else 0
    return cycles, held


def ranked_grids(graph, op, plans: list[dict], machine: dict, tile_cap: int | None = None,
                 allowed: float | None = None) -> list[int]:
    """Indices of ``plans`` (a matmul's) that are grids, cheapest estimate first (ties: the
    earlier plan), leaving out those whose weights exceed ``tile_cap`` bytes on a tile or
    ``allowed`` bytes in all, and the ``aligned`` ones (``MatMul.plans``), which this estimate
    cannot tell from their neighbours."""
    a, b = graph.values[op.inputs[0]], graph.values[op.inputs[1]]
    out = []
    for i, p in enumerate(plans):
        if not all(d in p for d in "mnk") or p.get("aligned"):
            continue
        cycles, held = grid_cost(graph, op, p, machine)
        per_tile = ceil_div(a.shape[1], p["k"]) * ceil_div(b.shape[1], p["n"]) * b.itemsize
        if held and ((tile_cap is not None and per_tile > tile_cap) or (allowed is not None and held > allowed)):
            continue
        out.append((cycles, i))
    return [i for _, i in sorted(out)]


def aligned_variants(plans: list[dict], chosen: list[int], columns: int) -> list[int]:
    """For each of the ``chosen`` grids of ``plans`` (a matmul's, of ``columns`` output columns),
    the grids of the same K-slices whose column count is the nearest below and above its own
    that cuts the columns into whole 32-column blocks (``operators.aligned_counts``): with its
    own row count, and with the row counts that keep its rows × columns nearest, below and
    above (ViT-B/16's QKV on 2 × 64 × 8 goes to 4 × 36 × 8, heads of 64 columns on about as
    many tiles, not only to 2 × 36 × 8 on half of them). The closed-form estimate does not see
    that a reader of a few columns then takes each block in one transfer, not one a row; the
    estimator does, given the plans to judge."""
    by_grid = {(p["m"], p["n"], p["k"]): i for i, p in enumerate(plans) if all(d in p for d in "mnk")}
    counts = set(aligned_counts(columns, columns))
    out = []
    for i in chosen:
        m, n, k = (plans[i][d] for d in "mnk")
        aligned = sorted(c for (mm, c, kk) in by_grid if (mm, kk) == (m, k) and c in counts)
        below = [c for c in aligned if c <= n]
        above = [c for c in aligned if c > n]
        for c in below[-1:] + above[:1]:
            rows = sorted(r for (r, cc, kk) in by_grid if (cc, kk) == (c, k))
            fewer = [r for r in rows if r * c <= m * n]
            more = [r for r in rows if r * c > m * n]
            out += [by_grid[r, c, k] for r in {m, *fewer[-1:], *more[:1]}]
    return sorted(set(out) - set(chosen))


def neighbour_grids(plans: list[dict], chosen: int) -> list[int]:
    """The grids of ``plans`` (a matmul's) one trade from grid ``chosen``: about twice as many
    of one of rows, columns and K-slices for about half as many of another, the third kept
    (2 × 46 × 16 gives 4 × 23 × 16, 2 × 92 × 8, 4 × 46 × 8, ...). Each trade takes the grid
    nearest its target (in factors of two) that moves both counts the way it says; aligned grids
    trade among aligned ones."""
    mine = plans[chosen]
    if not all(d in mine for d in "mnk"):
        return []
    counts = {i: (p["m"], p["n"], p["k"]) for i, p in enumerate(plans)
              if all(d in p for d in "mnk") and bool(p.get("aligned")) == bool(mine.get("aligned"))}
    own = counts[chosen]
    out = set()
    for up, down in itertools.permutations(range(3), 2):
        target = [math.log2(c) + (d == up) - (d == down) for d, c in enumerate(own)]
        near = [(sum(abs(math.log2(c) - t) for c, t in zip(g, target)), i) for i, g in counts.items()
                if g[3 - up - down] == own[3 - up - down] and g[up] > own[up] and g[down] < own[down]]
        if near:
            out.add(min(near)[1])
    return sorted(out)
