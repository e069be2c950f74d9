"""Cycle estimators of softmax.c (``args = [x, y, rows, cols, scale_bits, …]``); see ``cycles.py``
for what editing this file re-runs."""
from __future__ import annotations

from .cycles import elementwise, folded_cast


def softmax(args, machine):
    """``rows·cols`` elements, 4 vector flops and an exponential each."""
    return elementwise(args[2] * args[3], 4, 1, machine)


def softmax_fp8(args, machine):
    """``-DFP8_OUT``: softmax, and a cast folded in on its outputs."""
    return softmax(args, machine) + folded_cast(args[2] * args[3], machine)
