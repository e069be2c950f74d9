"""Cycle estimators of cast.c (``args = [src, dst, n, scale_exp]``; ``-DROWS``: ``[src, dst,
rows, cols, scale_exp, src_stride, dst_stride]``); see ``cycles.py`` for what editing this file
re-runs."""
from __future__ import annotations

from ..graph.operators import ceil_div
from .cycles import elementwise


def cast(args, machine):
    """``n`` elements, 2 vector flops each."""
    return elementwise(args[2], 2, 0, machine)


def cast_rows(args, machine):
    """``-DROWS``, a copy of rows with a cast folded in: a cycle per row (as copy.c's estimator)
    and the cast's 2 vector flops an element."""
    c = machine["compute"]
    return c["vertex_overhead_cycles"] + args[2] + ceil_div(args[2] * args[3] * 2, c["vector_flops_per_cycle"])
