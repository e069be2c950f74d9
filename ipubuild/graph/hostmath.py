"""Elementwise functions the host reference computes with the same bits on every CPU.

numpy picks an implementation of ``exp`` and ``tanh`` by the processor's instruction set (its
AVX2 and AVX-512 loops differ from its baseline one in the last bit), so the same graph gave
another reference, and another FP8 scale, on another machine. These compute the float32
function in float64 from IEEE operations only (``+ - * /``, ``rint``, ``ldexp``: correctly
rounded everywhere, and numpy never fuses two of them), then round once to float32: the same
bytes on every CPU and numpy build, within a rounding of the true value.
"""
from __future__ import annotations

import math

import numpy as np

_LN2_HI = 6.93147180369123816490e-01      # ln 2 in two parts: n * _LN2_HI is exact for |n| < 2**20
_LN2_LO = 1.90821492927058770002e-10
_LOG2E = 1.44269504088896338700e+00
_DEGREE = 11
_TAYLOR = [1.0 / math.factorial(k) for k in range(_DEGREE + 1)]


def _exp64(x: np.ndarray) -> np.ndarray:
    """exp of finite float64 values in [-745, 709]: 2**n * exp(r), |r| <= ln2/2, exp(r) by its
    Taylor series to degree 11 (remainder < 1e-14 relative: far below float32's rounding)."""
    n = np.rint(x * _LOG2E)
    r = x - n * _LN2_HI
    r -= n * _LN2_LO
    p = np.full_like(r, _TAYLOR[_DEGREE])
    for c in reversed(_TAYLOR[:_DEGREE]):
        p *= r
        p += c
    return np.ldexp(p, n.astype(np.int32))


def _float64(x) -> tuple[np.ndarray, np.ndarray]:
    x64 = np.asarray(x, np.float32).astype(np.float64)
    nan = np.isnan(x64)
    return np.where(nan, 0.0, x64), nan


def exp(x) -> np.ndarray:
    """``exp`` of a float32 array, as float32."""
    x64, nan = _float64(x)
    # past these, float32 overflows to inf or underflows to 0 (and float64's ldexp stays finite)
    y = _exp64(np.clip(x64, -120.0, 100.0))
    y[x64 > 100.0] = np.inf
    y[x64 < -120.0] = 0.0
    y[nan] = np.nan
    with np.errstate(over="ignore"):
        return y.astype(np.float32)


def tanh(x) -> np.ndarray:
    """``tanh`` of a float32 array, as float32: ``1 - 2 / (exp(2a) + 1)`` for ``a = |x|``, and
    its series ``a (1 - a²/3 + 2a⁴/15)`` below 0.01 (where the difference would cancel)."""
    x64, nan = _float64(x)
    a = np.minimum(np.abs(x64), 20.0)                 # tanh(20) is 1 in float64
    t = 1.0 - 2.0 / (_exp64(2.0 * a) + 1.0)
    small = a < 0.01
    if small.any():
        s, s2 = a[small], a[small] * a[small]
        t[small] = s * (1.0 - s2 / 3.0 + 2.0 * (s2 * s2) / 15.0)
    t = np.copysign(t, x64)
    t[nan] = np.nan
    return t.astype(np.float32)
