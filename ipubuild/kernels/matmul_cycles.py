"""Cycle estimators of matmul.c (``args = [a, b, c, m, k, n, flags, a_scale_exp, b_scale_exp,
bias, …]``); see ``cycles.py`` for what editing this file re-runs."""
from __future__ import annotations

from ..graph.operators import ceil_div
from .cycles import folded_cast


def matmul(a_type: str):
    """``C[m,n] = A[m,k]·B[k,n]``: the AMP unit's multiply-accumulates at ``a_type``'s rate and
    2 vector flops an output element (scale, bias)."""
    def cycles(args, machine):
        m, k, n = args[3], args[4], args[5]
        c = machine["compute"]
        return (c["vertex_overhead_cycles"] + ceil_div(m * k * n, c["amp_macs_per_cycle"][a_type])
                + ceil_div(m * n * 2, c["vector_flops_per_cycle"]))
    return cycles


def matmul_fp8(a_type: str):
    """``-DFP8_OUT``: the product, and a cast folded in on its ``m·n`` outputs."""
    base = matmul(a_type)
    return lambda args, machine: base(args, machine) + folded_cast(args[3] * args[5], machine)
