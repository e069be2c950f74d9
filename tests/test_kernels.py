"""The built-in C kernels against numpy, through ``ipubuild.testing`` (each compiled as a build
compiles it, plus -Werror, and called on a numpy tile memory)."""
import shutil
import subprocess

import numpy as np
import pytest

from ipubuild import fp8, testing
from ipubuild.errors import UserError
from ipubuild.compiler.kernels import KERNEL_DIR
from ipubuild.operators import KernelVariant

F32, F16, F143, F152 = (testing.TYPE_CODES[t] for t in ("f32", "f16", "f143", "f152"))
FP8_NAME = {F143: "f143", F152: "f152"}
NP_STORE = {F32: np.float32, F16: np.uint16, F143: np.uint8, F152: np.uint8}

pytestmark = pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler")


@pytest.fixture(scope="module")
def kernels(tmp_path_factory):
    return Kernels(tmp_path_factory.mktemp("kernels"))


@pytest.fixture
def tile():
    return testing.TileMemory()


class Kernels:
    """Built-in kernel variants by source name and defines, each compiled once."""

    def __init__(self, out_dir):
        self.out_dir = out_dir

    def get(self, name: str, **defines) -> testing.Kernel:
        tag = "".join(f"_{k}{v}" for k, v in sorted(defines.items()))
        return testing.load_variant(KernelVariant(name + tag, KERNEL_DIR / f"{name}.c", tuple(sorted(defines.items()))),
                                    self.out_dir)


def rng(seed=0):
    return np.random.default_rng(seed)


# ---------------------------------------------------------------- helpers

def store(x, t, scale=0):
    """float32 values -> stored representation of type t."""
    if t == F32:
        return x.astype(np.float32)
    if t == F16:
        return fp8.to_f16_bits(x)
    return fp8.encode(x, FP8_NAME[t], scale)


def unscaled(raw, t):
    """stored representation -> float32 values (no scale)."""
    if t == F32:
        return raw.astype(np.float32)
    if t == F16:
        return fp8.from_f16_bits(raw)
    return fp8.decode(raw, FP8_NAME[t])


def random_bits_f32(r, n):
    return r.integers(0, 2**32, n, dtype=np.uint64).astype(np.uint32).view(np.float32)


# ---------------------------------------------------------------- cast

CAST_VARIANTS = [(F32, F143), (F32, F152), (F143, F32), (F152, F32), (F32, F16), (F16, F32)]


@pytest.mark.parametrize("src_t,dst_t", CAST_VARIANTS)
@pytest.mark.parametrize("scale", [0, 5, -9, 32, -32, 150, -150, 1100, -1100])   # |scale| > 1000: the double path
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
def test_cast_bit_exact(kernels, tile, src_t, dst_t, scale):
    k = kernels.get("cast", SRC_TYPE=src_t, DST_TYPE=dst_t)
    r = rng(abs(scale) + 100 * src_t + 10 * dst_t)
    if src_t == F32:
        special = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 240.0, 241.0, -250.0, 57344.0, 61440.0,
                            65504.0, 65520.0, 2.0**-10, 2.0**-11, 3 * 2.0**-11, 2.0**-17, 2.0**-18,
                            2.0**-24, 2.0**-25, 3 * 2.0**-25, -1e-30, 1e-45, 1.0625, 1.1875],
                           np.float32)
        src = np.concatenate([special, random_bits_f32(r, 3000),
                              (r.standard_normal(3000) * 10.0 ** r.integers(-8, 6, 3000)).astype(np.float32)])
    elif src_t == F16:
        src = np.arange(65536, dtype=np.uint32).astype(np.uint16)
    else:
        src = np.tile(np.arange(256, dtype=np.uint8), 3)
    n = src.size
    a_src = tile.put(src, offset=1 if src_t != F32 else 0)
    a_dst = tile.alloc(n * np.dtype(NP_STORE[dst_t]).itemsize, offset=3)  # misaligned store
    assert k(tile, [a_src, a_dst, n, scale & 0xFFFFFFFF]) == 0
    got = tile.read(a_dst, NP_STORE[dst_t], (n,))

    if dst_t in FP8_NAME:
        expect = fp8.encode(src, FP8_NAME[dst_t], scale)
        np.testing.assert_array_equal(got, expect)
    elif src_t in FP8_NAME:
        expect = fp8.decode(src, FP8_NAME[src_t], scale)
        np.testing.assert_array_equal(got.view(np.uint32), expect.view(np.uint32))
    elif dst_t == F16:
        expect = fp8.to_f16_bits(src)
        nan = np.isnan(src)
        np.testing.assert_array_equal(got[~nan], expect[~nan])
        assert np.all((got[nan] & 0x7C00) == 0x7C00) and np.all(got[nan] & 0x3FF)
    else:  # f16 -> f32
        expect = fp8.from_f16_bits(src)
        nan = np.isnan(expect)
        np.testing.assert_array_equal(got.view(np.uint32)[~nan], expect.view(np.uint32)[~nan])
        assert np.all(np.isnan(got[nan]))


@pytest.mark.parametrize("dst_t", [F143, F152])
@pytest.mark.parametrize("scale", [0, 7, -20, 140, -140])
def test_cast_to_fp8_bit_exact_over_a_sweep_of_all_floats(kernels, tile, dst_t, scale):
    """Every 4099th f32 bit pattern (all classes, every binade), against ipubuild/fp8.py."""
    k = kernels.get("cast", SRC_TYPE=F32, DST_TYPE=dst_t)
    every = np.arange(0, 2**32, 4099, dtype=np.uint64).astype(np.uint32).view(np.float32)
    a_src, a_dst = tile.alloc(4 * 2**16), tile.alloc(2**16)
    for start in range(0, every.size, 2**16):   # in chunks that fit tile memory
        src = every[start:start + 2**16]
        tile.write(a_src, src)
        assert k(tile, [a_src, a_dst, src.size, scale & 0xFFFFFFFF]) == 0
        np.testing.assert_array_equal(tile.read(a_dst, np.uint8, (src.size,)),
                                      fp8.encode(src, FP8_NAME[dst_t], scale))


def test_cast_does_not_touch_neighbours(kernels, tile):
    k = kernels.get("cast", SRC_TYPE=F32, DST_TYPE=F143)
    a_src = tile.put(np.ones(7, np.float32))
    a_dst = tile.alloc(16)
    before = tile.mem.copy()
    assert k(tile, [a_src, a_dst, 7, 0]) == 0
    changed = np.nonzero(tile.mem != before)[0]
    assert changed.min() >= a_dst and changed.max() < a_dst + 7


# ---------------------------------------------------------------- matmul

MATMUL_VARIANTS = [(F143, F143), (F143, F152), (F152, F143), (F152, F152), (F16, F16), (F32, F32)]


def matmul_ref(a_raw, b_raw, at, bt, m, k, n, trans, sa, sb, bias, c_old):
    A = unscaled(a_raw, at).reshape(m, k).astype(np.float64)
    B = unscaled(b_raw, bt)
    B = (B.reshape(n, k).T if trans else B.reshape(k, n)).astype(np.float64)
    r = (A @ B) * 2.0 ** -(sa + sb)
    if bias is not None:
        r = r + bias.astype(np.float64)
    if c_old is not None:
        r = r + c_old
    return r.astype(np.float32)


@pytest.mark.parametrize("at,bt", MATMUL_VARIANTS)
@pytest.mark.parametrize("m,k,n", [(3, 5, 7), (1, 1, 1), (4, 16, 8), (2, 33, 3)])
@pytest.mark.parametrize("flags", [0, 1, 2, 3])
@pytest.mark.parametrize("with_bias", [False, True])
def test_matmul(kernels, tile, at, bt, m, k, n, flags, with_bias):
    kern = kernels.get("matmul", A_TYPE=at, B_TYPE=bt)
    r = rng(m * 1000 + k * 10 + n + flags)
    sa, sb = (3, -2) if at in FP8_NAME else (0, 0)
    trans = bool(flags & 1)
    a_raw = store(r.standard_normal(m * k).astype(np.float32) * 4, at, sa)
    b_raw = store(r.standard_normal(k * n).astype(np.float32) * 4, bt, sb)
    bias = r.standard_normal(n).astype(np.float32) if with_bias else None
    c_old = r.standard_normal(m * n).astype(np.float32).reshape(m, n) if flags & 2 else None

    a_addr = tile.put(a_raw, offset=1 if at in FP8_NAME else 0)
    b_addr = tile.put(b_raw, offset=2 if bt == F16 else 0)
    c_addr = tile.put(c_old if c_old is not None else np.full((m, n), np.nan, np.float32))
    bias_addr = tile.put(bias) if bias is not None else 0
    args = [a_addr, b_addr, c_addr, m, k, n, flags, sa & 0xFFFFFFFF, sb & 0xFFFFFFFF, bias_addr]
    assert kern(tile, args) == 0
    got = tile.read(c_addr, np.float32, (m, n))
    expect = matmul_ref(a_raw, b_raw, at, bt, m, k, n, trans, sa, sb, bias, c_old)
    np.testing.assert_allclose(got, expect, rtol=1e-5, atol=1e-6)


def sequential_matmul(A, B):
    """f32 dot products accumulated one product at a time over k, in index order."""
    acc = np.zeros((A.shape[0], B.shape[1]), np.float32)
    for p in range(A.shape[1]):
        acc = acc + A[:, p:p + 1] * B[p:p + 1, :]
    return acc


@pytest.mark.parametrize("at,bt", [(F143, F143), (F152, F143), (F16, F16), (F32, F32)])
@pytest.mark.parametrize("m,k,n", [(1, 1, 1), (5, 37, 9), (9, 64, 17), (4, 200, 8)])
@pytest.mark.parametrize("flags", [0, 1, 3])
def test_matmul_bit_exact_index_order(kernels, tile, at, bt, m, k, n, flags):
    """Bit-exact with one f32 accumulator per dot product over k in index order, on shapes
    that are not whole blocks; nothing outside C is written."""
    kern = kernels.get("matmul", A_TYPE=at, B_TYPE=bt)
    r = rng(m * 7 + k * 3 + n + flags)
    sa, sb = (2, -3) if at in FP8_NAME else (0, 0)
    trans = bool(flags & 1)
    a_raw = store(r.standard_normal(m * k).astype(np.float32) * 3, at, sa)
    b_raw = store(r.standard_normal(k * n).astype(np.float32) * 3, bt, sb)
    bias = r.standard_normal(n).astype(np.float32)
    c_old = r.standard_normal((m, n)).astype(np.float32)
    a_addr, b_addr = tile.put(a_raw, offset=1 if at in FP8_NAME else 0), tile.put(b_raw)
    c_addr, bias_addr = tile.put(c_old), tile.put(bias)
    before = tile.mem.copy()
    args = [a_addr, b_addr, c_addr, m, k, n, flags, sa & 0xFFFFFFFF, sb & 0xFFFFFFFF, bias_addr]
    assert kern(tile, args) == 0
    A = unscaled(a_raw, at).reshape(m, k)
    B = unscaled(b_raw, bt)
    B = B.reshape(n, k).T if trans else B.reshape(k, n)
    expect = np.ldexp(sequential_matmul(A, B), -(sa + sb)).astype(np.float32) + bias
    if flags & 2:
        expect = c_old + expect
    got = tile.read(c_addr, np.float32, (m, n))
    np.testing.assert_array_equal(got.view(np.uint32), expect.view(np.uint32))
    changed = np.nonzero(tile.mem != before)[0]
    assert changed.size == 0 or (changed.min() >= c_addr and changed.max() < c_addr + 4 * m * n)


def test_matmul_fp8_exact_products(kernels, tile):
    """With small integers the f32 result is exact, so compare bit-exactly incl. scaling."""
    kern = kernels.get("matmul", A_TYPE=F143, B_TYPE=F152)
    r = rng(7)
    m, k, n = 3, 5, 7
    A = r.integers(-8, 9, (m, k)).astype(np.float32)
    B = r.integers(-8, 9, (k, n)).astype(np.float32)
    sa, sb = -4, 6
    a_raw, b_raw = fp8.encode(A * 2.0**-sa, "f143", sa), fp8.encode(B * 2.0**-sb, "f152", sb)
    np.testing.assert_array_equal(fp8.decode(a_raw, "f143", sa), A * 2.0**-sa)
    a_addr, b_addr, c_addr = tile.put(a_raw), tile.put(b_raw), tile.alloc(m * n * 4)
    assert kern(tile, [a_addr, b_addr, c_addr, m, k, n, 0, sa & 0xFFFFFFFF, sb & 0xFFFFFFFF, 0]) == 0
    expect = (A * 2.0**-sa) @ (B * 2.0**-sb)  # real values: decode(code, s)
    np.testing.assert_array_equal(tile.read(c_addr, np.float32, (m, n)), expect)


def test_matmul_nan_and_saturated_inputs(kernels, tile):
    kern = kernels.get("matmul", A_TYPE=F143, B_TYPE=F143)
    A = np.array([[np.nan, 1.0], [1e9, 1.0]], np.float32)
    B = np.array([[1.0, 0.0], [0.0, 1.0]], np.float32)
    a_raw, b_raw = fp8.encode(A, "f143"), fp8.encode(B, "f143")
    a_addr, b_addr, c_addr = tile.put(a_raw), tile.put(b_raw), tile.alloc(16)
    assert kern(tile, [a_addr, b_addr, c_addr, 2, 2, 2, 0, 0, 0, 0]) == 0
    got = tile.read(c_addr, np.float32, (2, 2))
    assert np.isnan(got[0]).all()
    np.testing.assert_array_equal(got[1], [240.0, 1.0])


def test_matmul_invalid_flags(kernels, tile):
    kern = kernels.get("matmul", A_TYPE=F32, B_TYPE=F32)
    a = tile.put(np.ones(4, np.float32))
    assert kern(tile, [a, a, tile.alloc(16), 2, 2, 2, 8, 0, 0, 0]) != 0
    assert kern(tile, [a, a, tile.alloc(16), 2, 2, 2, 2 | 4, 0, 0, 0, a]) != 0     # accumulate and addend


@pytest.mark.parametrize("at,bt", [(F143, F143), (F32, F32)])
@pytest.mark.parametrize("flags,with_bias", [(0, True), (1, False)])
def test_matmul_with_an_addend_is_the_product_then_add(kernels, tile, at, bt, flags, with_bias):
    """``flags & 4`` (a residual add folded in): bit for bit the product, then add.c."""
    kern = kernels.get("matmul", A_TYPE=at, B_TYPE=bt)
    r = rng(at * 10 + bt + flags)
    m, k, n, sa, sb = 6, 40, 9, 1, -2
    a = tile.put(store(r.standard_normal(m * k).astype(np.float32) * 4, at, sa))
    b = tile.put(store(r.standard_normal(k * n).astype(np.float32) * 4, bt, sb))
    bias = tile.put(r.standard_normal(n).astype(np.float32)) if with_bias else 0
    res = tile.put((r.standard_normal((m, n)) * 50).astype(np.float32))
    c, summed, fused = tile.alloc(4 * m * n), tile.alloc(4 * m * n), tile.alloc(4 * m * n)
    common = [m, k, n, flags, sa & 0xFFFFFFFF, sb & 0xFFFFFFFF, bias]
    assert kern(tile, [a, b, c, *common]) == 0
    assert kernels.get("add")(tile, [res, c, summed, m, n, m]) == 0
    common[3] |= 4
    assert kern(tile, [a, b, fused, *common, res]) == 0
    np.testing.assert_array_equal(tile.read(fused, np.float32, (m, n)), tile.read(summed, np.float32, (m, n)))
    assert not np.array_equal(tile.read(fused, np.float32, (m, n)), tile.read(c, np.float32, (m, n)))
    if at != F32:
        fp8_out = kernels.get("matmul", A_TYPE=at, B_TYPE=bt, FP8_OUT=1)
        assert fp8_out(tile, [a, b, fused, *common, F143, 0]) != 0            # no addend into FP8


def test_matmul_unknown_type_is_compile_error(tmp_path):
    with pytest.raises(UserError, match="kernel matmul_A_TYPE9_B_TYPE0 .*compile failed"):
        testing.compile_builtin("matmul", tmp_path, {"A_TYPE": 9, "B_TYPE": 0})
    with pytest.raises(UserError, match="compile failed"):
        testing.compile_builtin("cast", tmp_path, {"SRC_TYPE": 0})


# ---------------------------------------------------------------- add

@pytest.mark.parametrize("rows,cols,b_rows", [(3, 7, 1), (3, 7, 3), (1, 1, 1), (5, 33, 5)])
@pytest.mark.parametrize("alias", [False, True])
def test_add(kernels, tile, rows, cols, b_rows, alias):
    kern = kernels.get("add")
    r = rng(rows * cols + b_rows)
    a = r.standard_normal((rows, cols)).astype(np.float32)
    a[0, 0] = np.nan
    b = r.standard_normal((b_rows, cols)).astype(np.float32)
    a_addr, b_addr = tile.put(a), tile.put(b)
    c_addr = a_addr if alias else tile.alloc(a.nbytes)
    assert kern(tile, [a_addr, b_addr, c_addr, rows, cols, b_rows]) == 0
    np.testing.assert_array_equal(tile.read(c_addr, np.float32, (rows, cols)), a + b)


def test_add_invalid_b_rows(kernels, tile):
    kern = kernels.get("add")
    a = tile.put(np.ones((3, 2), np.float32))
    assert kern(tile, [a, a, a, 3, 2, 2]) != 0
    assert kern(tile, [a, a, a, 3, 2, 0]) != 0


# ---------------------------------------------------------------- layernorm

@pytest.mark.parametrize("rows,cols", [(3, 7), (1, 1), (4, 64), (2, 129)])
@pytest.mark.parametrize("alias", [False, True])
def test_layernorm(kernels, tile, rows, cols, alias):
    kern = kernels.get("layernorm")
    r = rng(rows + cols)
    x = (r.standard_normal((rows, cols)) * 3 + 1).astype(np.float32)
    g = r.standard_normal(cols).astype(np.float32)
    bt = r.standard_normal(cols).astype(np.float32)
    eps = np.float32(1e-5)
    xa, ga, ba = tile.put(x), tile.put(g), tile.put(bt)
    ya = xa if alias else tile.alloc(x.nbytes)
    assert kern(tile, [xa, ga, ba, ya, rows, cols, testing.f32_bits(eps)]) == 0
    x64 = x.astype(np.float64)
    mean = x64.mean(axis=1, keepdims=True)
    var = ((x64 - mean) ** 2).mean(axis=1, keepdims=True)
    expect = (x64 - mean) / np.sqrt(var + eps) * g + bt
    np.testing.assert_allclose(tile.read(ya, np.float32, (rows, cols)), expect, rtol=1e-5, atol=1e-5)


def test_layernorm_invalid(kernels, tile):
    a = tile.put(np.ones(4, np.float32))
    assert kernels.get("layernorm")(tile, [a, a, a, a, 1, 0, testing.f32_bits(1e-5)]) != 0


# ---------------------------------------------------------------- softmax

@pytest.mark.parametrize("rows,cols", [(3, 7), (1, 1), (4, 100)])
@pytest.mark.parametrize("scale", [1.0, 0.125, -2.0])
@pytest.mark.parametrize("alias", [False, True])
def test_softmax(kernels, tile, rows, cols, scale, alias):
    kern = kernels.get("softmax")
    r = rng(rows * cols)
    x = (r.standard_normal((rows, cols)) * 5).astype(np.float32)
    if cols > 1:
        x[0, 1] = 80.0  # would overflow expf without max subtraction
    xa = tile.put(x)
    ya = xa if alias else tile.alloc(x.nbytes)
    assert kern(tile, [xa, ya, rows, cols, testing.f32_bits(scale)]) == 0
    z = np.float32(scale) * x.astype(np.float64)
    e = np.exp(z - z.max(axis=1, keepdims=True))
    expect = e / e.sum(axis=1, keepdims=True)
    got = tile.read(ya, np.float32, (rows, cols))
    np.testing.assert_allclose(got, expect, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got.sum(axis=1), 1.0, rtol=1e-5)


def test_softmax_invalid(kernels, tile):
    a = tile.put(np.ones(4, np.float32))
    assert kernels.get("softmax")(tile, [a, a, 1, 0, testing.f32_bits(1.0)]) != 0


# ---------------------------------------------------------------- gelu

@pytest.mark.parametrize("n", [1, 7, 1000])
@pytest.mark.parametrize("alias", [False, True])
def test_gelu(kernels, tile, n, alias):
    kern = kernels.get("gelu")
    x = (rng(n).standard_normal(n) * 4).astype(np.float32)
    x[0] = 0.0
    xa = tile.put(x)
    ya = xa if alias else tile.alloc(x.nbytes, offset=1)
    assert kern(tile, [xa, ya, n]) == 0
    x64 = x.astype(np.float64)
    expect = 0.5 * x64 * (1 + np.tanh(0.7978845608 * (x64 + 0.044715 * x64**3)))
    np.testing.assert_allclose(tile.read(ya, np.float32, (n,)), expect, rtol=1e-5, atol=1e-6)


def test_gelu_special(kernels, tile):
    x = np.array([np.nan, np.inf, -np.inf, 20.0, -20.0], np.float32)
    xa = tile.put(x)
    assert kernels.get("gelu")(tile, [xa, xa, x.size]) == 0
    got = tile.read(xa, np.float32, (x.size,))
    assert np.isnan(got[0])
    assert got[1] == np.inf
    assert np.isnan(got[2])  # -inf * 0
    np.testing.assert_allclose(got[3:], [20.0, 0.0], atol=1e-6)


# ---------------------------------------------------------------- copy

def test_copy_strided(kernels, tile):
    kern = kernels.get("copy")
    src = np.arange(200, dtype=np.uint8)
    sa = tile.put(src, offset=1)
    da = tile.alloc(300, offset=3)
    before = tile.mem.copy()
    assert kern(tile, [sa, da, 5, 13, 17, 29]) == 0
    expect = before.copy()
    for r in range(5):
        expect[da + 29 * r: da + 29 * r + 13] = src[17 * r: 17 * r + 13]
    np.testing.assert_array_equal(tile.mem, expect)


def test_copy_overlapping_row(kernels, tile):
    kern = kernels.get("copy")
    buf = np.arange(64, dtype=np.uint8)
    a = tile.put(buf)
    assert kern(tile, [a, a + 3, 1, 40, 0, 0]) == 0  # memmove semantics
    expect = buf.copy()
    expect[3:43] = buf[0:40]
    np.testing.assert_array_equal(tile.read(a, np.uint8, (64,)), expect)


def test_copy_zero_rows(kernels, tile):
    before = tile.mem.copy()
    assert kernels.get("copy")(tile, [0x4C000, 0x4D000, 0, 8, 8, 8]) == 0
    np.testing.assert_array_equal(tile.mem, before)


# ---------------------------------------------------------------- reduce

@pytest.mark.parametrize("count,n", [(1, 5), (2, 7), (5, 33)])
@pytest.mark.parametrize("alias", [False, True])
def test_reduce(kernels, tile, count, n, alias):
    kern = kernels.get("reduce")
    r = rng(count * n)
    srcs = [(r.standard_normal(n) * 10.0 ** r.integers(-3, 4)).astype(np.float32) for _ in range(count)]
    addrs = [tile.put(s, offset=0 if i % 2 == 0 else 2) for i, s in enumerate(srcs)]
    dst = addrs[0] if alias else tile.alloc(4 * n)
    assert kern(tile, [dst, n, count, *addrs]) == 0
    expect = srcs[0].copy()
    for s in srcs[1:]:
        expect = (expect + s).astype(np.float32)  # f32, in order
    np.testing.assert_array_equal(tile.read(dst, np.float32, (n,)), expect)


def test_reduce_invalid(kernels, tile):
    assert kernels.get("reduce")(tile, [0x4C000, 4, 0]) != 0


# ---------------------------------------------------------------- casts folded into kernels
# Each FP8_OUT / ROWS variant must write exactly the codes the kernel without it followed by
# cast.c writes (the host reference computes the latter).

def cast_after(kernels, tile, f32_addr, n, out_t, scale):
    """The codes cast.c writes for ``n`` f32 values at ``f32_addr``."""
    dst = tile.alloc(n)
    assert kernels.get("cast", SRC_TYPE=F32, DST_TYPE=out_t)(tile, [f32_addr, dst, n, scale & 0xFFFFFFFF]) == 0
    return tile.read(dst, np.uint8, (n,))


@pytest.mark.parametrize("at,bt", [(F143, F143), (F143, F152), (F152, F143), (F152, F152)])
@pytest.mark.parametrize("out_t", [F143, F152])
@pytest.mark.parametrize("flags,with_bias", [(0, True), (1, False)])
def test_matmul_with_folded_cast_is_bit_exact(kernels, tile, at, bt, out_t, flags, with_bias):
    plain, fused = kernels.get("matmul", A_TYPE=at, B_TYPE=bt), kernels.get("matmul", A_TYPE=at, B_TYPE=bt, FP8_OUT=1)
    r = rng(at * 10 + bt + out_t)
    m, k, n, sa, sb, so = 5, 33, 7, 2, -3, -5
    a = tile.put(store(r.standard_normal(m * k).astype(np.float32) * 4, at, sa))
    b = tile.put(store(r.standard_normal(k * n).astype(np.float32) * 4, bt, sb))
    bias = tile.put(r.standard_normal(n).astype(np.float32)) if with_bias else 0
    c32, c8 = tile.alloc(4 * m * n), tile.alloc(m * n)
    common = [m, k, n, flags, sa & 0xFFFFFFFF, sb & 0xFFFFFFFF, bias]
    assert plain(tile, [a, b, c32, *common]) == 0
    assert fused(tile, [a, b, c8, *common, out_t, so]) == 0
    got = tile.read(c8, np.uint8, (m * n,))
    np.testing.assert_array_equal(got, cast_after(kernels, tile, c32, m * n, out_t, so))
    assert len(set(got.tolist())) > 10                      # a real spread of codes
    assert fused(tile, [a, b, c8, m, k, n, 2, 0, 0, 0, out_t, so]) != 0       # no accumulate into FP8
    assert fused(tile, [a, b, c8, *common, F32, so]) != 0                      # FP8 outputs only


@pytest.mark.parametrize("out_t", [F143, F152])
def test_layernorm_gelu_reduce_with_folded_cast_are_bit_exact(kernels, tile, out_t):
    r = rng(out_t)
    rows, cols, so = 3, 50, 3
    x = tile.put((r.standard_normal((rows, cols)) * 3 + 1).astype(np.float32))
    g, bt = tile.put(r.standard_normal(cols).astype(np.float32)), tile.put(r.standard_normal(cols).astype(np.float32))
    y32, y8 = tile.alloc(4 * rows * cols), tile.alloc(rows * cols)
    eps = testing.f32_bits(1e-6)
    assert kernels.get("layernorm")(tile, [x, g, bt, y32, rows, cols, eps]) == 0
    assert kernels.get("layernorm", FP8_OUT=1)(tile, [x, g, bt, y8, rows, cols, eps, out_t, so]) == 0
    np.testing.assert_array_equal(tile.read(y8, np.uint8, (rows * cols,)),
                                  cast_after(kernels, tile, y32, rows * cols, out_t, so))
    n = rows * cols
    assert kernels.get("gelu")(tile, [x, y32, n]) == 0
    assert kernels.get("gelu", FP8_OUT=1)(tile, [x, y8, n, out_t, so]) == 0
    np.testing.assert_array_equal(tile.read(y8, np.uint8, (n,)), cast_after(kernels, tile, y32, n, out_t, so))
    parts = [tile.put(r.standard_normal(n).astype(np.float32)) for _ in range(3)]
    assert kernels.get("reduce")(tile, [y32, n, 3, *parts]) == 0
    assert kernels.get("reduce", FP8_OUT=1)(tile, [y8, n, 3, out_t, so, *parts]) == 0
    np.testing.assert_array_equal(tile.read(y8, np.uint8, (n,)), cast_after(kernels, tile, y32, n, out_t, so))
    for name, args in [("layernorm", [x, g, bt, y8, rows, cols, eps, F16, so]), ("gelu", [x, y8, n, F32, so]),
                       ("reduce", [y8, n, 3, F32, so, *parts])]:
        assert kernels.get(name, FP8_OUT=1)(tile, args) != 0, name


@pytest.mark.parametrize("at,bt", [(F143, F143), (F32, F32)])
@pytest.mark.parametrize("fp8_out", [False, True])
def test_matmul_and_reduce_with_a_folded_gelu_are_bit_exact(kernels, tile, at, bt, fp8_out):
    """``-DGELU``: the product (or the sum of partial products), then gelu.c, then (with
    ``-DFP8_OUT``) cast.c: the same bits."""
    if fp8_out and at == F32:
        pytest.skip("FP8_OUT takes FP8 operands")
    r = rng(at * 10 + bt + fp8_out)
    m, k, n, sa, sb, so = 5, 33, 11, 1, -2, -1
    a = tile.put(store(r.standard_normal(m * k).astype(np.float32) * 3, at, sa))
    b = tile.put(store(r.standard_normal(k * n).astype(np.float32) * 3, bt, sb))
    bias = tile.put(r.standard_normal(n).astype(np.float32))
    c, g = tile.alloc(4 * m * n), tile.alloc(4 * m * n)
    common = [m, k, n, 0, sa & 0xFFFFFFFF, sb & 0xFFFFFFFF, bias]
    assert kernels.get("matmul", A_TYPE=at, B_TYPE=bt)(tile, [a, b, c, *common]) == 0
    assert kernels.get("gelu")(tile, [c, g, m * n]) == 0
    expect = cast_after(kernels, tile, g, m * n, F143, so) if fp8_out else tile.read(g, np.float32, (m * n,))
    out_args = [F143, so] if fp8_out else []
    defines = {"GELU": 1, **({"FP8_OUT": 1} if fp8_out else {})}
    fused = tile.alloc(4 * m * n)
    assert kernels.get("matmul", A_TYPE=at, B_TYPE=bt, **defines)(tile, [a, b, fused, *common, *out_args]) == 0
    got = tile.read(fused, np.uint8 if fp8_out else np.float32, (m * n,))
    np.testing.assert_array_equal(got, expect)
    assert len(set(got.tolist())) > 10 and not np.array_equal(tile.read(g, np.float32, (m * n,)),
                                                               tile.read(c, np.float32, (m * n,)))
    assert kernels.get("matmul", A_TYPE=at, B_TYPE=bt, **defines)(tile, [a, b, fused, m, k, n, 2, 0, 0, 0,
                                                                        *out_args]) != 0  # no accumulate
    # the sum of partial products: c and two more, then the GELU
    parts = [c] + [tile.put(r.standard_normal(m * n).astype(np.float32)) for _ in range(2)]
    assert kernels.get("reduce")(tile, [g, m * n, 3, *parts]) == 0
    assert kernels.get("gelu")(tile, [g, g, m * n]) == 0
    expect = cast_after(kernels, tile, g, m * n, F143, so) if fp8_out else tile.read(g, np.float32, (m * n,))
    assert kernels.get("reduce", **defines)(tile, [fused, m * n, 3, *out_args, *parts]) == 0
    np.testing.assert_array_equal(tile.read(fused, np.uint8 if fp8_out else np.float32, (m * n,)), expect)


@pytest.mark.parametrize("out_t", [F143, F152])
@pytest.mark.parametrize("scale", [1.0, 0.125, -2.0])
def test_softmax_with_folded_cast_is_bit_exact(kernels, tile, out_t, scale):
    """The FP8 softmax writes the codes of the f32 softmax followed by cast.c, every one of them
    (its exponentials in an f32 scratch, which may be its input)."""
    r = rng(out_t * 100 + int(8 * abs(scale)) + (scale < 0))
    rows, cols, so = 5, 197, 7
    x = (r.standard_normal((rows, cols)) * 4).astype(np.float32)
    x[0, 1] = 80.0
    xa = tile.put(x)
    y32, y8 = tile.alloc(4 * rows * cols), tile.alloc(rows * cols)
    shape = [rows, cols, testing.f32_bits(scale)]
    assert kernels.get("softmax")(tile, [xa, y32, *shape]) == 0
    expect = cast_after(kernels, tile, y32, rows * cols, out_t, so)
    for e in (tile.alloc(4 * rows * cols), xa):
        assert kernels.get("softmax", FP8_OUT=1)(tile, [xa, y8, *shape, out_t, so, e]) == 0
        got = tile.read(y8, np.uint8, (rows * cols,))
        np.testing.assert_array_equal(got, expect)
    assert len(set(got.tolist())) > 10
    assert kernels.get("softmax", FP8_OUT=1)(tile, [xa, y8, *shape, F32, so, y32]) != 0


@pytest.mark.parametrize("dst_t", [F143, F152])
def test_cast_rows_is_cast_per_strided_row(kernels, tile, dst_t):
    r = rng(dst_t)
    rows, cols, src_stride, dst_stride, scale = 4, 12, 4 * 30, 17, -2
    src = (r.standard_normal((rows, 30)) * 8).astype(np.float32)
    sa = tile.put(src)
    da = tile.alloc(rows * dst_stride)
    before = tile.mem.copy()
    k = kernels.get("cast", SRC_TYPE=F32, DST_TYPE=dst_t, ROWS=1)
    assert k(tile, [sa, da, rows, cols, scale & 0xFFFFFFFF, src_stride, dst_stride]) == 0
    expect = before.copy()
    for row in range(rows):
        expect[da + row * dst_stride:da + row * dst_stride + cols] = fp8.encode(src[row, :cols], FP8_NAME[dst_t], scale)
    np.testing.assert_array_equal(tile.mem, expect)


# ---------------------------------------------------------------- build properties

def test_single_export_and_reproducible(kernels, tmp_path):
    nm = shutil.which("nm")
    (tmp_path / "x").mkdir()
    (tmp_path / "y").mkdir()
    p1 = testing.compile_builtin("softmax", tmp_path / "x")
    p2 = testing.compile_builtin("softmax", tmp_path / "y")
    assert p1.read_bytes() == p2.read_bytes()
    if nm:
        for name, defs in [("softmax", {}), ("matmul", {"A_TYPE": F143, "B_TYPE": F152})]:
            p = kernels.get(name, **defs).path
            out = subprocess.run([nm, "-D", "--defined-only", str(p)], capture_output=True, text=True).stdout
            syms = [ln.split()[-1] for ln in out.splitlines() if ln.split() and ln.split()[-2] in "TtDdBb"]
            assert syms == ["ipu_vertex"], syms


# ---------------------------------------------------------------- the checked build

CHECKED = {"IPU_CHECKED": 1}
TILE_BYTES = testing.TileMemory().mem.size


def _checked(kernels, name, **defines):
    k = kernels.get(name, **defines, **CHECKED)
    k.set_tile(TILE_BYTES)
    return k


def _valid_calls(tile):
    """One valid call of each kernel (name, defines, args), its buffers in ``tile``."""
    r = rng(7)
    x = tile.put(r.standard_normal(64).astype(np.float32))
    y = tile.alloc(256)
    g = tile.put(np.ones(16, np.float32))
    q = tile.put(fp8.encode(r.standard_normal(64).astype(np.float32), "f143"))
    return [
        ("add", {}, [x, x, y, 4, 16, 4]),
        ("cast", {"SRC_TYPE": F32, "DST_TYPE": F143}, [x, y, 64, 0]),
        ("cast", {"SRC_TYPE": F32, "DST_TYPE": F143, "ROWS": 1}, [x, y, 4, 8, 0, 64, 8]),
        ("copy", {}, [x, y, 4, 32, 64, 32]),
        ("gelu", {}, [x, y, 64]),
        ("gelu", {"FP8_OUT": 1}, [x, y, 64, F143, 0]),
        ("layernorm", {}, [x, g, g, y, 4, 16, testing.f32_bits(1e-5)]),
        ("layernorm", {"FP8_OUT": 1}, [x, g, g, y, 4, 16, testing.f32_bits(1e-5), F143, 0]),
        ("matmul", {"A_TYPE": F143, "B_TYPE": F143}, [q, q, y, 4, 8, 8, 0, 0, 0, g]),
        ("matmul", {"A_TYPE": F143, "B_TYPE": F143, "FP8_OUT": 1}, [q, q, y, 4, 8, 8, 0, 0, 0, g, F143, 0]),
        ("reduce", {}, [y, 16, 2, x, x + 64]),
        ("softmax", {}, [x, y, 4, 16, testing.f32_bits(1.0)]),
        ("softmax", {"FP8_OUT": 1}, [x, y, 4, 16, testing.f32_bits(1.0), F143, 0, x]),
    ]


@pytest.mark.parametrize("case", range(13))
def test_checked_kernels_compute_what_the_unchecked_ones_do(kernels, case):
    memories = []
    for build in ({}, CHECKED):
        tile = testing.TileMemory()
        name, defines, args = _valid_calls(tile)[case]
        k = kernels.get(name, **defines, **build)
        if build:
            k.set_tile(TILE_BYTES)
        assert k(tile, args) == 0
        memories.append(tile.mem)
    np.testing.assert_array_equal(*memories)


@pytest.mark.parametrize("case", range(12))
@pytest.mark.parametrize("where", ["past the tile", "outside the data map", "no tile size"])
def test_checked_kernels_refuse_a_buffer_outside_data_memory_and_touch_nothing(kernels, case, where):
    tile = testing.TileMemory()
    name, defines, args = _valid_calls(tile)[case]
    k = kernels.get(name, **defines, **CHECKED)
    # a data map that holds everything but the first buffer: [its end, end of memory)
    at = 0x100
    tile.write(at, np.array([1, args[0] + 4096, TILE_BYTES], np.uint32))
    if where == "past the tile":
        args = [TILE_BYTES - 2, *args[1:]]
        k.set_tile(TILE_BYTES)
    elif where == "outside the data map":
        k.set_tile(TILE_BYTES, at)
    else:
        k.set_tile(0)
    before = tile.mem.copy()
    assert k(tile, args) == 3
    assert k.reason().endswith("lies outside the tile's data memory")
    assert k.reason() is None            # said once
    np.testing.assert_array_equal(tile.mem, before)


@pytest.mark.parametrize("name,defines,args,code,reason", [
    ("add", {}, [0x4C002, 0x4C100, 0x4C200, 1, 4, 1], 4, "a[rows*cols] is not aligned to its element size"),
    ("matmul", {"A_TYPE": F16, "B_TYPE": F16}, [0x4C001, 0x4C100, 0x4C200, 1, 4, 1, 0, 0, 0, 0], 4,
     "a[m*k] is not aligned to its element size"),
    ("cast", {"SRC_TYPE": F32, "DST_TYPE": F143, "ROWS": 1}, [0x4C000, 0x4C200, 2, 4, 0, 18, 4], 4,
     "a row stride is not a whole number of elements"),
    ("add", {}, [0x4C000, 0x4C100, 0x4C200, 4, 4, 3], 1, "b_rows is neither 1 nor rows"),
    ("layernorm", {}, [0x4C000, 0x4C100, 0x4C200, 0x4C300, 1, 0, 0], 1, "cols is 0"),
    ("reduce", {}, [0x4C000, 4, 0], 1, "count is 0"),
    ("matmul", {"A_TYPE": F32, "B_TYPE": F32}, [0x4C000, 0x4C100, 0x4C200, 1, 1, 1, 8, 0, 0, 0], 1,
     "unknown flag bits"),
    ("matmul", {"A_TYPE": F32, "B_TYPE": F32}, [0x4C000, 0x4C100, 0x4C200, 1, 1, 1, 6, 0, 0, 0, 0x4C300], 1,
     "both accumulate and addend"),
])
def test_checked_kernels_say_why_they_refuse_their_arguments(kernels, name, defines, args, code, reason):
    k = _checked(kernels, name, **defines)
    assert k(testing.TileMemory(), args) == code
    assert k.reason() == reason


def test_checked_build_exports_its_device_interface(kernels):
    nm = shutil.which("nm")
    if not nm:
        pytest.skip("no nm")
    p = kernels.get("softmax", **CHECKED).path
    out = subprocess.run([nm, "-D", "--defined-only", str(p)], capture_output=True, text=True).stdout
    syms = sorted(ln.split()[-1] for ln in out.splitlines() if ln.split() and ln.split()[-2] in "TtDdBb")
    assert syms == ["ipu_tile_bytes", "ipu_tile_map", "ipu_trap_reason", "ipu_vertex"], syms


# ---------------------------------------------------------------- how the compiler is started

def test_the_compiler_starts_without_forking_this_process():
    """A kernel compiles (niced, as the counted builds are) and the compiler's identity is read
    without a fork() of the build's process: a fork runs every ``pthread_atfork`` handler, and
    OpenBLAS's stops its thread pool under a product running on another thread — a build hung
    so in ``check_numerics`` while its counted kernels compiled behind it."""
    import os
    from ipubuild.compiler import kernels as K
    forks = []
    os.register_at_fork(before=lambda: forks.append(1))
    code, obj, _ = K.run_compiler("x", "x.c", {"x.c": b"int f(int x) { return x; }\n"}, "x.c", [], "cc",
                                  K.DEFAULT_CFLAGS, nice=10)
    assert code == 0 and obj.startswith(b"\x7fELF")
    assert K._run(["cc", "--version"])
    assert forks == []


def test_the_compiler_runs_under_its_cpu_limit():
    """The limit reaches the compiler's own processes (set in the child, inherited by cc1), and
    a compiler that cannot start is still an OSError, as ``subprocess`` gives it."""
    from ipubuild.compiler import kernels as K
    out = subprocess.run(K.limited(["sh", "-c", "ulimit -S -t; ulimit -H -t"], seconds=7, nice=3),
                         capture_output=True, text=True)
    assert out.stdout.split() == ["7", "12"]
    with pytest.raises(OSError, match="No such file"):
        K._run(["ipubuild-no-such-compiler", "--version"])
