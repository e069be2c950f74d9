"""A matrix product on the host that is the same on every CPU, whatever BLAS kernel numpy uses.

BLAS sums a dot product in an order that depends on the processor (OpenBLAS picks its kernel by
CPU: ``OPENBLAS_CORETYPE``), so a float32 ``a @ b`` differs in its last bits between machines,
and with it the host reference and the closing figures. Here the operands are split (Ozaki's
scheme) into slices whose products BLAS computes *exactly* in float64: slice ``s`` of row ``i``
of ``a`` holds integers of at most ``beta`` bits times ``2^(e_i - s*beta)`` (``e_i``: the row's
largest exponent), likewise ``b`` by column, and ``K * 2^(2*beta) <= 2^53``, so every partial
sum is exact and the order BLAS adds in cannot matter. The slice products are then added
elementwise in a fixed order. Products of FP8 values fit one slice each: one float64 product,
exact. float32 operands take at most two slices a side (three products); what the third would
add is below 2^-40 of the terms' scale, far below float32's rounding.
"""
from __future__ import annotations

import numpy as np

#: slices a side at most (FP8 data needs one, float32 data two)
MAX_SLICES = 2


def _bits(k: int) -> int:
    """Bits a slice may hold so that ``k`` products of two slices sum exactly in float64."""
    return (53 - max(0, int(k - 1).bit_length())) // 2


def _slices(x: np.ndarray, axis: int, beta: int) -> list[np.ndarray]:
    """``x`` as up to MAX_SLICES slices (the first the largest), each of integers of at most
    ``beta`` bits times a power of two per row (``axis=1``) or column (``axis=0``)."""
    m = np.max(np.abs(x), axis=axis, keepdims=True)
    e = np.frexp(m)[1]                         # |x| < 2^e along the row / column
    out, r = [], x
    for s in range(1, MAX_SLICES + 1):
        unit = np.ldexp(1.0, e - s * beta)
        q = np.rint(r / unit) * unit           # exact: scaling by a power of two, then rounding
        out.append(q)
        r = r - q                              # exact
        if not r.any():
            break
    return out


def matmul(a, b) -> np.ndarray:
    """``a @ b`` (2-D) in float64, bit-identical on every CPU and BLAS; exact when the operands
    fit the slices (FP8 values always do)."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    if a.ndim != 2 or b.ndim != 2 or a.shape[1] != b.shape[0]:
        raise ValueError(f"cannot multiply {list(a.shape)} by {list(b.shape)}")
    if a.size == 0 or b.size == 0 or not (np.all(np.isfinite(a)) and np.all(np.isfinite(b))):
        return a @ b                           # empty, or inf or nan: no exact value to agree on
    beta = _bits(a.shape[1])
    sa, sb = _slices(a, 1, beta), _slices(b, 0, beta)
    terms = [(i, j) for i in range(len(sa)) for j in range(len(sb)) if i + j < MAX_SLICES]
    out = np.zeros((a.shape[0], b.shape[1]))
    for i, j in sorted(terms, key=lambda t: (-(t[0] + t[1]), t)):   # the smallest first
        out += np.ascontiguousarray(sa[i]) @ np.ascontiguousarray(sb[j])
    return out
