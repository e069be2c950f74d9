"""Cycle estimators of reduce.c (``args = [dst, n, count, …]``); see ``cycles.py`` for what
editing this file re-runs."""
from __future__ import annotations

from .cycles import elementwise, folded_cast, folded_gelu


def reduce(args, machine):
    """``n·(count-1)`` additions, a vector flop each."""
    return elementwise(args[1] * (args[2] - 1), 1, 0, machine)


def reduce_fp8(args, machine):
    """``-DFP8_OUT``: the sum, and a cast folded in on its ``n`` outputs."""
    return reduce(args, machine) + folded_cast(args[1], machine)


def reduce_gelu(args, machine):
    """``-DGELU``: the sum, then a GELU folded in on its ``n`` outputs."""
    return reduce(args, machine) + folded_gelu(args[1], machine)


def reduce_gelu_fp8(args, machine):
    """``-DGELU -DFP8_OUT``: the sum, a GELU and a cast folded in on its ``n`` outputs."""
    return reduce_fp8(args, machine) + folded_gelu(args[1], machine)
