import math

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from ipubuild import fp8

FMTS = ["f143", "f152"]
MIN_SUB = {"f143": 2.0**-10, "f152": 2.0**-17}
ALL_CODES = np.arange(256, dtype=np.uint8)


def ref_encode(x, fmt):
    """Clip-then-ml_dtypes reference (scale 0)."""
    x = np.asarray(x, dtype=np.float32)
    with np.errstate(invalid="ignore", over="ignore"):
            c = np.clip(x, -fp8.MAX[fmt], fp8.MAX[fmt]).astype(fp8.FORMATS[fmt]).view(np.uint8)
    return np.where(np.isnan(x), 0x80, np.where(c == 0x80, 0, c)).astype(np.uint8)


@pytest.mark.parametrize("fmt", FMTS)
def test_all_codes_decode_and_roundtrip(fmt):
    expect = ALL_CODES.view(fp8.FORMATS[fmt]).astype(np.float32)
    got = fp8.decode(ALL_CODES, fmt)
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got, expect)  # NaN == NaN here
    assert np.isnan(got[0x80]) and np.isnan(got).sum() == 1
    back = fp8.encode(got, fmt)
    assert back.dtype == np.uint8 and back.shape == (256,)
    np.testing.assert_array_equal(back, ALL_CODES)
    assert float(np.nanmax(got)) == fp8.MAX[fmt]
    assert float(got[1]) == MIN_SUB[fmt]


@pytest.mark.parametrize("fmt", FMTS)
def test_boundaries(fmt):
    m = fp8.MAX[fmt]
    dec = lambda c: float(fp8.decode(np.array([c], np.uint8), fmt)[0])  # noqa: E731
    enc = lambda v, s=0: int(fp8.encode(np.array([v], np.float32), fmt, s)[0])  # noqa: E731
    cmax = enc(m)
    assert dec(cmax) == m
    assert enc(np.nextafter(np.float32(m), np.float32(np.inf))) == cmax
    assert enc(m * 1.5) == cmax
    assert enc(3.0e38) == cmax
    assert enc(np.inf) == cmax
    assert enc(-np.inf) == cmax | 0x80
    assert enc(-m * 4) == cmax | 0x80
    assert enc(np.nan) == 0x80
    assert enc(-np.nan) == 0x80
    ms = MIN_SUB[fmt]
    assert enc(ms) == 0x01
    assert enc(-ms) == 0x81
    assert enc(ms * 0.5) == 0x00  # tie -> even (zero)
    assert enc(ms * 0.5000001) == 0x01
    assert enc(ms * 1.5) == 0x02  # tie between 1 and 2 -> 2
    assert enc(ms * 2.5) == 0x02  # tie between 2 and 3 -> 2
    assert enc(-0.0) == 0x00
    assert enc(-ms * 0.25) == 0x00
    assert enc(-1e-30) == 0x00
    assert enc(0.0) == 0x00
    # halfway between 1.0 and the next code rounds to even (1.0)
    one = enc(1.0)
    step = dec(one + 1) - 1.0
    assert enc(1.0 + step / 2) == one
    assert enc(1.0 + 3 * step / 2) == one + 2
    assert enc(1.0 + step / 2 * 1.0001) == one + 1


@pytest.mark.parametrize("fmt", FMTS)
def test_scale_exp(fmt):
    x = np.array([0.1, -3.0, 1000.0, 1e-6, np.nan], np.float32)
    for s in (-7, -1, 0, 3, 12):
        c = fp8.encode(x, fmt, s)
        np.testing.assert_array_equal(c, ref_encode(np.ldexp(x.astype(np.float64), s).astype(np.float32), fmt))
        d = fp8.decode(c, fmt, s)
        np.testing.assert_array_equal(d, np.ldexp(fp8.decode(c, fmt).astype(np.float64), -s).astype(np.float32))
        np.testing.assert_array_equal(fp8.quantize(x, fmt, s), d)
    # scaled value 1.0 -> code of 1.0
    assert fp8.encode(np.array([2.0**-5], np.float32), fmt, 5)[0] == fp8.encode(np.array([1.0], np.float32), fmt)[0]
    assert fp8.decode(fp8.encode(np.array([2.0**-5], np.float32), fmt, 5), fmt, 5)[0] == 2.0**-5


def test_shapes_and_scalars():
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    assert fp8.encode(x, "f143").shape == (3, 4)
    assert fp8.decode(fp8.encode(x, "f152"), "f152").shape == (3, 4)
    assert fp8.encode(np.float32(2.0), "f143").shape == ()
    with pytest.raises(ValueError):
        fp8.encode(x, "f16")


@pytest.mark.parametrize("fmt", FMTS)
@settings(max_examples=60, deadline=None)
@given(x=hnp.arrays(np.float32, st.integers(1, 64), elements=st.floats(width=32, allow_nan=True, allow_infinity=True)))
def test_encode_matches_clip_then_cast(fmt, x):
    np.testing.assert_array_equal(fp8.encode(x, fmt), ref_encode(x, fmt))


@pytest.mark.parametrize("fmt", FMTS)
def test_encode_random_bit_patterns(fmt):
    rng = np.random.default_rng(0)
    x = rng.integers(0, 2**32, 200_000, dtype=np.uint64).astype(np.uint32).view(np.float32)
    np.testing.assert_array_equal(fp8.encode(x, fmt), ref_encode(x, fmt))


@pytest.mark.parametrize("fmt", FMTS)
@settings(max_examples=200, deadline=None)
@given(amax=st.floats(min_value=1e-9, max_value=1e9, allow_nan=False, allow_infinity=False))
def test_scale_exp_for_property(fmt, amax):
    s = fp8.scale_exp_for(amax, fmt)
    m = fp8.MAX[fmt]
    assert -32 <= s <= 32
    if -32 < s < 32:
        assert math.ldexp(amax, s) <= m
        assert 2 * math.ldexp(amax, s) > m


@pytest.mark.parametrize("fmt", FMTS)
def test_scale_exp_for_edges(fmt):
    m = fp8.MAX[fmt]
    for bad in (0.0, math.inf, -math.inf, math.nan):
        assert fp8.scale_exp_for(bad, fmt) == 0
    assert fp8.scale_exp_for(m, fmt) == 0
    assert fp8.scale_exp_for(m / 2, fmt) == 1
    assert fp8.scale_exp_for(np.nextafter(m, 0.0), fmt) == 0
    assert fp8.scale_exp_for(np.nextafter(m, math.inf), fmt) == -1
    assert fp8.scale_exp_for(1e-30, fmt) == 32
    assert fp8.scale_exp_for(1e30, fmt) == -32
    assert fp8.scale_exp_for(-m / 4, fmt) == 2


def test_f16_helpers():
    x = np.array([0.0, -0.0, 1.0, 65504.0, 65520.0, 1e-8, 2.0**-24, 2.0**-25, 3 * 2.0**-25, np.inf], np.float32)
    u = fp8.to_f16_bits(x)
    assert u.dtype == np.uint16
    np.testing.assert_array_equal(u, [0, 0x8000, 0x3C00, 0x7BFF, 0x7C00, 0, 1, 0, 2, 0x7C00])
    with np.errstate(over="ignore"):
        np.testing.assert_array_equal(fp8.from_f16_bits(u), x.astype(np.float16).astype(np.float32))
    allbits = np.arange(65536, dtype=np.uint32).astype(np.uint16)
    f = fp8.from_f16_bits(allbits)
    assert f.dtype == np.float32
    ok = ~np.isnan(f)
    np.testing.assert_array_equal(fp8.to_f16_bits(f)[ok], allbits[ok])


def test_formats_are_ml_dtypes():
    assert fp8.FORMATS["f143"] is ml_dtypes.float8_e4m3fnuz
    assert fp8.FORMATS["f152"] is ml_dtypes.float8_e5m2fnuz
    assert fp8.MAX == {"f143": 240.0, "f152": 57344.0}
