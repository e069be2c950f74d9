"""FP8 (Graphcore F143 / F152) and F16 conversions in numpy.

F143 is ``ml_dtypes.float8_e4m3fnuz`` (bias 8, max 240, min subnormal 2**-10)
and F152 is ``ml_dtypes.float8_e5m2fnuz`` (bias 16, max 57344, min subnormal
2**-17).  Both have a single NaN code 0x80 and no negative zero.

A tensor carries a power-of-two scale exponent ``s``: the stored code encodes
``x * 2**s`` and decoding yields ``value(code) * 2**-s``.  The device cast
saturates: values are clipped to +-MAX first (+-inf -> +-MAX, NaN stays NaN),
then rounded to nearest even.  Scaling is done in float64, where it is exact,
so there is exactly one rounding step (this is what the C kernels do too).
"""

from __future__ import annotations

import math

import numpy as np

MAX = {"f143": 240.0, "f152": 57344.0}

NAN_CODE = 0x80
SCALE_EXP_MIN = -32
SCALE_EXP_MAX = 32


def __getattr__(name: str):
    """``FORMATS`` (``{"f143": dtype, "f152": dtype}``), made at first use: importing ml_dtypes
    costs more than a no-op build's every other import, and only a phase that casts needs it."""
    if name == "FORMATS":
        if "FORMATS" in globals():
            return globals()["FORMATS"]
        import ml_dtypes
        globals()["FORMATS"] = {"f143": ml_dtypes.float8_e4m3fnuz, "f152": ml_dtypes.float8_e5m2fnuz}
        return globals()["FORMATS"]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _dtype(fmt: str):
    try:
        return __getattr__("FORMATS")[fmt]
    except KeyError:
        raise ValueError(f"unknown fp8 format {fmt!r}; expected one of {sorted(__getattr__('FORMATS'))}") from None


def encode(x: np.ndarray, fmt: str, scale_exp: int = 0) -> np.ndarray:
    """Saturating cast of float32 ``x * 2**scale_exp`` to fp8 codes.

    Returns a uint8 array of the same shape.  Values beyond +-MAX (including
    +-inf) become +-MAX, NaN becomes 0x80, everything else is rounded to
    nearest even.  A result that would be negative zero is 0x00.
    """
    dt = _dtype(fmt)
    m = MAX[fmt]
    with np.errstate(invalid="ignore", over="ignore"):
        x64 = np.ldexp(np.asarray(x, dtype=np.float32).astype(np.float64), int(scale_exp))
        clipped = np.clip(x64, -m, m)  # NaN propagates through clip
        codes = np.asarray(clipped.astype(dt)).view(np.uint8).copy()
    nan = np.isnan(x64)
    # Only a NaN input may produce the NaN code (guards against -0 -> 0x80).
    codes = np.where(nan, np.uint8(NAN_CODE), np.where(codes == NAN_CODE, np.uint8(0), codes))
    return codes.astype(np.uint8).reshape(np.shape(x))


def decode(codes: np.ndarray, fmt: str, scale_exp: int = 0) -> np.ndarray:
    """Decode fp8 codes to float32 values ``value(code) * 2**-scale_exp``.

    Code 0x80 decodes to NaN.  The scaling is exact in float64 followed by a
    single rounding to float32.
    """
    dt = _dtype(fmt)
    c = np.ascontiguousarray(np.asarray(codes, dtype=np.uint8))
    v = c.view(dt).astype(np.float64)
    return np.ldexp(v, -int(scale_exp)).astype(np.float32).reshape(np.shape(codes))


def quantize(x: np.ndarray, fmt: str, scale_exp: int = 0) -> np.ndarray:
    """Round-trip ``x`` through fp8: ``decode(encode(x, fmt, s), fmt, s)`` (float32)."""
    return decode(encode(x, fmt, scale_exp), fmt, scale_exp)


def scale_exp_for(amax: float, fmt: str) -> int:
    """Largest power-of-two scale exponent ``s`` with ``amax * 2**s <= MAX[fmt]``.

    That is ``s = floor(log2(MAX / amax))``, so ``2 * amax * 2**s > MAX``.
    ``amax`` of 0, inf or NaN gives 0.  The result is clamped to [-32, 32].
    """
    m = MAX[fmt]
    a = abs(float(amax))
    if a == 0.0 or not math.isfinite(a):
        return 0
    s = math.floor(math.log2(m / a))
    # Fix up possible off-by-one from floating-point log2.
    while math.ldexp(a, s) > m:
        s -= 1
    while math.ldexp(a, s + 1) <= m:
        s += 1
    return int(min(max(s, SCALE_EXP_MIN), SCALE_EXP_MAX))


def to_f16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> IEEE binary16 bit patterns (uint16), round-to-nearest-even."""
    with np.errstate(over="ignore", invalid="ignore"):
        return np.asarray(x, dtype=np.float32).astype(np.float16).view(np.uint16)


def from_f16_bits(u16: np.ndarray) -> np.ndarray:
    """IEEE binary16 bit patterns (uint16) -> float32 (exact)."""
    return np.ascontiguousarray(np.asarray(u16, dtype=np.uint16)).view(np.float16).astype(np.float32)
