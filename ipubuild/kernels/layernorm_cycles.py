"""Cycle estimators of layernorm.c (``args = [x, gamma, beta, y, rows, cols, eps_bits, …]``);
see ``cycles.py`` for what editing this file re-runs."""
from __future__ import annotations

from .cycles import elementwise, folded_cast


def layernorm(args, machine):
    """``rows·cols`` elements, 5 vector flops each."""
    return elementwise(args[4] * args[5], 5, 0, machine)


def layernorm_fp8(args, machine):
    """``-DFP8_OUT``: layernorm, and a cast folded in on its outputs."""
    return layernorm(args, machine) + folded_cast(args[4] * args[5], machine)
