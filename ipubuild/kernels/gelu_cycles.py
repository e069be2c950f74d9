"""Cycle estimators of gelu.c (``args = [x, y, n, …]``); see ``cycles.py`` for what editing
this file re-runs."""
from __future__ import annotations

from .cycles import elementwise, folded_cast


def gelu(args, machine):
    """``n`` elements, 6 vector flops and a tanh each."""
    return elementwise(args[2], 6, 1, machine)


def gelu_fp8(args, machine):
    """``-DFP8_OUT``: gelu, and a cast folded in on its outputs."""
    return gelu(args, machine) + folded_cast(args[2], machine)
