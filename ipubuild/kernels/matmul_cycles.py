"""Cycle estimators of matmul.c (``args = [a, b, c, m, k, n, flags, a_scale_exp, b_scale_exp,
bias, …]``); see ``cycles.py`` for what editing this file re-runs."""
from __future__ import annotations

from ..graph.operators import ceil_div
from .cycles import folded_cast, folded_gelu


def matmul(a_type: str):
    """``C[m,n] = A[m,k]·B[k,n]``: the AMP unit's multiply-accumulates at ``a_type``'s rate and
    2 vector flops an output element (scale, bias), 3 with an addend (``flags & 4``)."""
    def cycles(args, machine):
        m, k, n, flags = args[3], args[4], args[5], args[6]
        c = machine["compute"]
        return (c["vertex_overhead_cycles"] + ceil_div(m * k * n, c["amp_macs_per_cycle"][a_type])
                + ceil_div(m * n * (3 if flags & 4 else 2), c["vector_flops_per_cycle"]))
    return cycles


def matmul_fp8(a_type: str):
    """``-DFP8_OUT``: the product, and a cast folded in on its ``m·n`` outputs."""
    base = matmul(a_type)
    return lambda args, machine: base(args, machine) + folded_cast(args[3] * args[5], machine)


def matmul_gelu(a_type: str, fp8_out: bool):
    """``-DGELU`` (and ``-DFP8_OUT`` with ``fp8_out``): the product, then a GELU folded in on
    its ``m·n`` outputs (and their cast)."""
    base = matmul_fp8(a_type) if fp8_out else matmul(a_type)
    return lambda args, machine: base(args, machine) + folded_gelu(args[3] * args[5], machine)
