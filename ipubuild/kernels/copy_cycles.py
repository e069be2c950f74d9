"""Cycle estimator of copy.c (``args = [src, dst, rows, row_bytes, src_stride, dst_stride]``);
see ``cycles.py`` for what editing this file re-runs."""
from __future__ import annotations

from ..graph.operators import ceil_div


def copy(args, machine):
    """A cycle per row, and the bytes at the copy rate."""
    c = machine["compute"]
    return c["vertex_overhead_cycles"] + args[2] + ceil_div(args[2] * args[3], c["copy_bytes_per_cycle"])
