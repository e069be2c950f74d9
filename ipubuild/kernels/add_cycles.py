"""Cycle estimator of add.c (``args = [a, b, c, rows, cols, b_rows]``); see ``cycles.py`` for
what editing this file re-runs."""
from __future__ import annotations

from .cycles import elementwise


def add(args, machine):
    """``rows·cols`` elements, a vector flop each."""
    return elementwise(args[3] * args[4], 1, 0, machine)
