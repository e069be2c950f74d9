"""Cycle estimator of softmax.c (``args = [x, y, rows, cols, scale_bits]``); see ``cycles.py``
for what editing this file re-runs."""
from __future__ import annotations

from .cycles import elementwise


def softmax(args, machine):
    """``rows·cols`` elements, 4 vector flops and an exponential each."""
    return elementwise(args[2] * args[3], 4, 1, machine)
