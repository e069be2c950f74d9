"""The built-in operators of ipubuild, with their C kernels and cycle estimators."""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from ..graph import fp8, hostmath, hostmatmul
from .. import hookimpl
from ..graph.ir import FP8
# each kernel's cycle estimators live beside its C source; imported module by module, so that
# the planning phases' code fingerprints take in these files and not the kernels package itself
from ..kernels.add_cycles import add as add_cycles
from ..kernels.cast_cycles import cast as cast_cycles, cast_rows as cast_rows_cycles
from ..kernels.copy_cycles import copy as copy_cycles
from ..kernels.gelu_cycles import gelu as gelu_cycles, gelu_fp8 as gelu_fp8_cycles
from ..kernels.layernorm_cycles import layernorm as layernorm_cycles, layernorm_fp8 as layernorm_fp8_cycles
from ..kernels.matmul_cycles import matmul as matmul_cycles, matmul_fp8 as matmul_fp8_cycles, \
    matmul_gelu as matmul_gelu_cycles
from ..kernels.reduce_cycles import reduce as reduce_cycles, reduce_fp8 as reduce_fp8_cycles, \
    reduce_gelu as reduce_gelu_cycles, reduce_gelu_fp8 as reduce_gelu_fp8_cycles
from ..kernels.softmax_cycles import softmax as softmax_cycles, softmax_fp8 as softmax_fp8_cycles
from ..graph.operators import (F32_ROUNDOFF as U, KernelVariant, Lowering, Operator, TileWork, aligned_counts, f32_bits,
                               gamma, key, split)

KERNELS = Path(__file__).resolve().parent.parent / "kernels"
TYPE_CODE = {"f32": "IPU_F32", "f16": "IPU_F16", "f143": "IPU_F143", "f152": "IPU_F152"}


def _variant(name, source, cycles, **defines):
    return KernelVariant(name, KERNELS / source, tuple(sorted(defines.items())), cycles)


MATMUL_TYPES = [("f143", "f143"), ("f143", "f152"), ("f152", "f143"), ("f152", "f152"),
                ("f16", "f16"), ("f32", "f32")]
CAST_TYPES = [("f32", "f143"), ("f32", "f152"), ("f143", "f32"), ("f152", "f32"), ("f32", "f16"),
              ("f16", "f32")]


TYPE_NUM = {"f32": 0, "f16": 1, "f143": 2, "f152": 3}    # ipu_kernel.h's type codes


def _folded(op) -> str | None:
    """The dtype of a cast folded into the operation (attribute ``to``), if any."""
    return op.attrs.get("to")


def _out_type(op, dtype: str, scale_exp: int) -> tuple[str, int]:
    """The output (dtype, scale_exp): a folded cast's, else the operation's own."""
    if _folded(op) is None:
        return dtype, scale_exp
    if op.attrs["to"] not in FP8:
        raise ValueError(f"a cast folded into {op.type} must be to {' or '.join(FP8)}, not {op.attrs['to']}")
    return op.attrs["to"], op.attrs.get("scale_exp", 0)


def _encode_out(op, out):
    """The reference of a folded cast: the f32 result encoded as the device encodes it."""
    return out if _folded(op) is None else fp8.encode(out, op.attrs["to"], op.attrs.get("scale_exp", 0))


def _epilogue(op) -> list:
    """The vertex arguments of a folded cast: ``[out_type, out_scale_exp]``."""
    return [TYPE_NUM[op.attrs["to"]], op.attrs.get("scale_exp", 0) & 0xFFFFFFFF] if _folded(op) else []


MIN_ROWS = 8  # the default plan gives each tile at least this many rows (finer ones fragment)


# tolerances: how far a kernel's f32 result may be from the reference's (Operator.tolerance) ----
TINY = 2.0 ** -126      # the smallest normal f32: below it roundings are absolute, not relative
LIBM_ULPS = 4           # a float32 exp or tanh (the C library's, numpy's) is within this many ulps


def _exact(op) -> list:
    """The tolerance of a kernel that must be bit-exact with the reference (copies, casts, adds)."""
    return [0.0 for _ in op.outputs]


def _abs(x):
    return np.abs(np.asarray(x, np.float64))


def _sequential_error(terms) -> np.ndarray:
    """A bound on the error of an f32 sum of ``terms`` (float64) along the last axis in index
    order: each addition rounds to within ``u`` of its partial sum (the computed partial sums
    are within ``gamma(n)`` of the exact ones, hence the last factor)."""
    n = terms.shape[-1]
    partial = np.abs(np.cumsum(terms, axis=-1))[..., 1:].sum(axis=-1, keepdims=True)
    return U * partial * (1 + 2 * gamma(n))


def _product_bound(a, av, b, bv, trans_b=False, terms=0):
    """Twice (device and reference) the bound on each element of ``A·B·2^-(sa+sb)`` summed in
    any order over ``k`` products (plus ``terms`` more roundings: a bias, a split-K reduction):
    ``gamma(k)·Σ|a·b|``. ``|A|·|B|`` is taken in f32 (the operands' decoded values are exact
    there), which is within ``gamma(k)`` of exact: so many more roundings keep it a bound."""
    pa, pb = np.abs(_decode(a, av)), np.abs(_decode(b, bv))
    k = pa.shape[-1]
    mags = hostmatmul.matmul(pa, pb.T if trans_b else pb) * (1 + 2 * gamma(k))
    return 2 * gamma(k + terms) * mags * 2.0 ** -(av.scale_exp + bv.scale_exp)


def _rows_plans(rows: int, tile_count: int, min_rows: int = MIN_ROWS) -> list[dict]:
    """Row splits over 1, 2, 4, … tiles and over min(rows, tiles); the default (first) is the
    largest with at least ``min_rows`` rows a tile."""
    counts, n = [], min(rows, tile_count)
    while n >= 1:
        counts.append(n)
        n //= 2
    default = next((c for c in counts if rows // c >= min_rows), counts[-1])
    return [{"rows": default}] + [{"rows": c} for c in counts if c != default]


def _rows_work(rows: int, plan: dict, fn) -> list[TileWork]:
    """``fn(tile, r0, r1)`` per row range of a ``rows`` plan, or per block of a ``blocks`` plan
    (whole rows: ``follow`` checked that)."""
    if "blocks" in plan:
        return [fn(t, r0, r1) for t, r0, r1, _, _ in plan["blocks"]]
    return [fn(t, r0, r1) for t, (r0, r1) in enumerate(split(rows, plan["rows"]))]


def _block_work(value, plan: dict, fn) -> list[TileWork]:
    """``fn(tile, r0, r1, c0, c1)`` per block: whole-row blocks of a ``rows`` plan, or the
    blocks of a ``blocks`` plan."""
    if "blocks" in plan:
        return [fn(*b) for b in plan["blocks"]]
    return [fn(t, r0, r1, 0, value.cols) for t, (r0, r1) in enumerate(split(value.rows, plan["rows"]))]


# operators -------------------------------------------------------------------------------------
class RowwiseOperator(Operator):
    """An operator whose tiles each take a range of output rows (or follow its producer)."""
    follows = "rows"

    def plans(self, graph, op, tile_count):
        return _rows_plans(graph.values[op.outputs[0]].rows, tile_count) + self.follow_plans(graph, op)


class ElementwiseOperator(RowwiseOperator):
    """An operator whose output elements each need only the same element of its inputs: it
    takes row ranges, or any blocks its producer wrote."""
    follows = "elements"


class Cast(ElementwiseOperator):
    name = "cast"

    def infer(self, graph, op):
        x = graph.values[op.inputs[0]]
        to = op.attrs["to"]
        if (x.dtype, to) not in CAST_TYPES:
            raise ValueError(f"no cast from {x.dtype} to {to}; supported: {CAST_TYPES}")
        return [(x.shape, to, op.attrs.get("scale_exp", 0) if to in FP8 else 0)]

    def reference(self, graph, op, inputs):
        x, src, to = inputs[0], graph.values[op.inputs[0]], op.attrs["to"]
        if to in FP8:
            return [fp8.encode(x, to, op.attrs.get("scale_exp", 0))]
        if src.dtype in FP8:
            return [fp8.decode(x, src.dtype, src.scale_exp)]
        if to == "f16":
            return [x.astype(np.float16)]
        return [x.astype(np.float32)]

    def tolerance(self, graph, op, inputs, outputs):
        return _exact(op)

    def lower(self, graph, op, plan):
        x, y = graph.values[op.inputs[0]], graph.values[op.outputs[0]]
        scale = y.scale_exp if y.dtype in FP8 else x.scale_exp if x.dtype in FP8 else 0

        def work(t, r0, r1, c0, c1):
            return TileWork(t, [(key(x.id), r0, r1, c0, c1)], [(key(y.id), r0, r1, c0, c1)],
                            [(f"cast_{x.dtype}_{y.dtype}", [("r", 0, 0), ("w", 0, 0),
                                                             (r1 - r0) * (c1 - c0), scale & 0xFFFFFFFF])])
        return Lowering([_block_work(x, plan, work)])

    def variants(self, graph, op):
        return [f"cast_{graph.values[op.inputs[0]].dtype}_{op.attrs['to']}"]

    def kernels(self):
        return [_variant(f"cast_{s}_{d}", "cast.c", cast_cycles,
                         SRC_TYPE=TYPE_CODE[s], DST_TYPE=TYPE_CODE[d]) for s, d in CAST_TYPES]


class Add(ElementwiseOperator):
    name = "add"

    def infer(self, graph, op):
        a, b = (graph.values[i] for i in op.inputs)
        if a.dtype != "f32" or b.dtype != "f32":
            raise ValueError(f"add takes f32 values, got {a.dtype} and {b.dtype}")
        if b.shape != a.shape and not (b.cols == a.cols and b.rows == 1):
            raise ValueError(f"cannot add {b.name} of shape {list(b.shape)} to {a.name} of shape "
                             f"{list(a.shape)}; expected {list(a.shape)} or [1, {a.cols}]")
        return [(a.shape, "f32", 0)]

    def reference(self, graph, op, inputs):
        a, b = inputs
        return [(a.reshape(-1, a.shape[-1]) + b.reshape(-1, a.shape[-1])).reshape(a.shape).astype(np.float32)]

    def tolerance(self, graph, op, inputs, outputs):
        return _exact(op)

    def lower(self, graph, op, plan):
        a, b = (graph.values[i] for i in op.inputs)
        c = graph.values[op.outputs[0]]
        bcast = b.rows == 1 and a.rows != 1

        def work(t, r0, r1, c0, c1):
            brows = (0, 1) if bcast else (r0, r1)
            return TileWork(t, [(key(a.id), r0, r1, c0, c1), (key(b.id), *brows, c0, c1)],
                            [(key(c.id), r0, r1, c0, c1)],
                            [("add_f32", [("r", 0, 0), ("r", 1, 0), ("w", 0, 0), r1 - r0, c1 - c0,
                                          1 if bcast else r1 - r0])])
        return Lowering([_block_work(c, plan, work)])

    def kernels(self):
        return [_variant("add_f32", "add.c", add_cycles)]


class LayerNorm(RowwiseOperator):
    name = "layernorm"

    def infer(self, graph, op):
        x, g, b = (graph.values[i] for i in op.inputs)
        if x.dtype != "f32" or g.shape != (x.cols,) or b.shape != (x.cols,):
            raise ValueError(f"layernorm needs f32 x and gamma/beta of shape [{x.cols}], got "
                             f"{list(g.shape)} and {list(b.shape)}")
        return [(x.shape, *_out_type(op, "f32", 0))]

    def fuses_cast(self, graph, op, dtype):
        return dtype in FP8

    def reference(self, graph, op, inputs):
        x, g, b = inputs
        mean = x.mean(axis=-1, keepdims=True, dtype=np.float32)
        var = ((x - mean) ** 2).mean(axis=-1, keepdims=True, dtype=np.float32)
        return [_encode_out(op, ((x - mean) / np.sqrt(var + np.float32(op.attrs["eps"])) * g + b).astype(np.float32))]

    def tolerance(self, graph, op, inputs, outputs):
        """Both sides compute the mean and the variance with sums of ``cols`` terms: the kernel
        in index order (the kernel ABI), so its error is bounded by the roundings of its partial
        sums (``_sequential_error``), a far tighter bound than ``gamma(cols)`` times the terms'
        magnitudes when they cancel; the reference's numpy sums are compared with the exact
        (float64) values. The variance moves with the mean only in second order (the deviations
        sum to zero); the normalised value moves with the mean, through ``x - mean``, and with
        the denominator; then ``·gamma + beta`` rounds twice on each side."""
        xf = np.asarray(inputs[0], np.float32)
        x, g = xf.astype(np.float64), _abs(inputs[1])
        n, eps = x.shape[-1], float(np.float32(op.attrs["eps"]))
        mean = x.mean(axis=-1, keepdims=True)
        dev = x - mean
        var = (dev ** 2).mean(axis=-1, keepdims=True)
        # the reference's mean and variance, as it computes them, against the exact ones
        ref_mean = xf.mean(axis=-1, keepdims=True, dtype=np.float32)
        ref_var = ((xf - ref_mean) ** 2).mean(axis=-1, keepdims=True, dtype=np.float32)
        dm_kernel = _sequential_error(x) / n + U * (np.abs(mean) + _sequential_error(x) / n)
        dm = np.abs(ref_mean - mean) + dm_kernel
        dvar = (np.abs(ref_var - var) + dm_kernel ** 2 + 4 * U * var
                + _sequential_error(dev ** 2) * (1 + 4 * U) / n)
        denom = np.sqrt(var + eps)
        drel = 0.5 * dvar / (var + eps) + 4 * U
        v = dev / denom
        dv = (dm + 2 * U * np.abs(dev)) / denom + np.abs(v) * (drel + 2 * U)
        return [g * dv + 2 * U * (np.abs(v) * g + _abs(outputs[0])) + TINY]

    def lower(self, graph, op, plan):
        x, g, b = (graph.values[i] for i in op.inputs)
        y = graph.values[op.outputs[0]]

        def work(t, r0, r1):
            return TileWork(t, [(key(x.id), r0, r1, 0, x.cols), (key(g.id), 0, 1, 0, x.cols),
                                (key(b.id), 0, 1, 0, x.cols)], [(key(y.id), r0, r1, 0, y.cols)],
                            [("layernorm_f32" + ("_fp8" if _folded(op) else ""),
                              [("r", 0, 0), ("r", 1, 0), ("r", 2, 0), ("w", 0, 0), r1 - r0, x.cols,
                               f32_bits(op.attrs["eps"]), *_epilogue(op)])])
        return Lowering([_rows_work(x.rows, plan, work)])

    def variants(self, graph, op):
        return ["layernorm_f32" + ("_fp8" if _folded(op) else "")]      # the one lower() calls

    def kernels(self):
        return [_variant("layernorm_f32", "layernorm.c", layernorm_cycles),
                _variant("layernorm_f32_fp8", "layernorm.c", layernorm_fp8_cycles, FP8_OUT=1)]


class Softmax(RowwiseOperator):
    name = "softmax"

    def infer(self, graph, op):
        x = graph.values[op.inputs[0]]
        if x.dtype != "f32":
            raise ValueError(f"softmax takes f32, got {x.dtype}")
        return [(x.shape, *_out_type(op, "f32", 0))]

    def fuses_cast(self, graph, op, dtype):
        return dtype in FP8

    def reference(self, graph, op, inputs):
        x = inputs[0] * np.float32(op.attrs.get("scale", 1.0))
        e = hostmath.exp(x - x.max(axis=-1, keepdims=True))
        return [_encode_out(op, (e / e.sum(axis=-1, keepdims=True)).astype(np.float32))]

    def tolerance(self, graph, op, inputs, outputs):
        """Relative to each probability: both exponentials' last bits (``LIBM_ULPS`` ulps each,
        in the element and, through the sum, in every other), both sums over ``cols`` terms in
        any order, both divisions."""
        n = graph.values[op.inputs[0]].cols
        return [(4 * LIBM_ULPS * 2 * U + 2 * gamma(n) + 2 * U) * _abs(outputs[0]) + TINY]

    def lower(self, graph, op, plan):
        x, y = graph.values[op.inputs[0]], graph.values[op.outputs[0]]

        # with a cast folded in, the exponentials go to an f32 scratch of the rows (as the f32
        # output they replace would take)
        scratch = f"t{op.id}.0" if _folded(op) else None

        def work(t, r0, r1):
            writes = [(key(y.id), r0, r1, 0, y.cols)] + ([(scratch, r0, r1, 0, x.cols)] if scratch else [])
            return TileWork(t, [(key(x.id), r0, r1, 0, x.cols)], writes,
                            [("softmax_f32" + ("_fp8" if scratch else ""),
                              [("r", 0, 0), ("w", 0, 0), r1 - r0, x.cols, f32_bits(op.attrs.get("scale", 1.0)),
                               *_epilogue(op), *([("w", 1, 0)] if scratch else [])])])
        return Lowering([_rows_work(x.rows, plan, work)], {scratch: (x.rows, x.cols, "f32")} if scratch else {})

    def variants(self, graph, op):
        return ["softmax_f32" + ("_fp8" if _folded(op) else "")]

    def kernels(self):
        return [_variant("softmax_f32", "softmax.c", softmax_cycles),
                _variant("softmax_f32_fp8", "softmax.c", softmax_fp8_cycles, FP8_OUT=1)]


def _gelu_tanh(x):
    """The tanh of gelu.c's GELU (tanh approximation), in f32."""
    c = np.float32(0.7978845608)
    return hostmath.tanh(c * (x + np.float32(0.044715) * x * x * x))


def _gelu(x):
    """gelu.c's GELU on the host, in f32."""
    return (np.float32(0.5) * x * (np.float32(1) + _gelu_tanh(x))).astype(np.float32)


def _gelu_tolerance(x, out):
    """The argument of tanh is computed the same way on both sides; tanh's last bits differ
    (``LIBM_ULPS`` ulps each), then ``1 + t`` and the product round once more each."""
    x = np.asarray(x, np.float32)
    t = _abs(_gelu_tanh(x))
    half = 0.5 * _abs(x)
    return half * (2 * LIBM_ULPS * 2 * U * t + 2 * U * (1 + t)) + 2 * U * _abs(out) + TINY


#: the largest slope of the GELU (tanh approximation): an error in its input grows by at most this
GELU_SLOPE = 1.13


class Gelu(ElementwiseOperator):
    name = "gelu"

    def infer(self, graph, op):
        x = graph.values[op.inputs[0]]
        if x.dtype != "f32":
            raise ValueError(f"gelu takes f32, got {x.dtype}")
        return [(x.shape, *_out_type(op, "f32", 0))]

    def fuses_cast(self, graph, op, dtype):
        return dtype in FP8

    def reference(self, graph, op, inputs):
        return [_encode_out(op, _gelu(inputs[0]))]

    def tolerance(self, graph, op, inputs, outputs):
        return [_gelu_tolerance(inputs[0], outputs[0])]

    def lower(self, graph, op, plan):
        x, y = graph.values[op.inputs[0]], graph.values[op.outputs[0]]

        def work(t, r0, r1, c0, c1):
            return TileWork(t, [(key(x.id), r0, r1, c0, c1)], [(key(y.id), r0, r1, c0, c1)],
                            [("gelu_f32" + ("_fp8" if _folded(op) else ""),
                              [("r", 0, 0), ("w", 0, 0), (r1 - r0) * (c1 - c0), *_epilogue(op)])])
        return Lowering([_block_work(x, plan, work)])

    def variants(self, graph, op):
        # the one lower() calls: a gelu edit compiles only it (the default, every variant of
        # kernels(), compiled gelu_f32 for targets whose gelu has its cast folded in)
        return ["gelu_f32" + ("_fp8" if _folded(op) else "")]

    def kernels(self):
        return [_variant("gelu_f32", "gelu.c", gelu_cycles),
                _variant("gelu_f32_fp8", "gelu.c", gelu_fp8_cycles, FP8_OUT=1)]


class Patchify(Operator):
    """Image ``[H, W*C]`` (rows of pixels, channels last) to patches ``[(H/P)*(W/P), P*P*C]``."""
    name = "patchify"

    def infer(self, graph, op):
        x = graph.values[op.inputs[0]]
        p, c = op.attrs["patch"], op.attrs["channels"]
        h, wc = x.shape
        if h % p or wc % (p * c):
            raise ValueError(f"image of shape {list(x.shape)} does not divide into {p}x{p} patches "
                             f"of {c} channels")
        if _folded(op) and x.dtype != "f32":
            raise ValueError(f"a cast folded into patchify needs an f32 image, got {x.dtype}")
        return [(((h // p) * (wc // (p * c)), p * p * c), *_out_type(op, x.dtype, x.scale_exp))]

    def fuses_cast(self, graph, op, dtype):
        return dtype in FP8 and graph.values[op.inputs[0]].dtype == "f32"

    def reference(self, graph, op, inputs):
        x = inputs[0]
        p, c = op.attrs["patch"], op.attrs["channels"]
        h, wc = x.shape
        w = wc // c
        img = x.reshape(h // p, p, w // p, p, c)
        return [_encode_out(op, np.ascontiguousarray(img.transpose(0, 2, 1, 3, 4).reshape((h // p) * (w // p), p * p * c)))]

    def tolerance(self, graph, op, inputs, outputs):
        return _exact(op)

    def plans(self, graph, op, tile_count):
        # whole rows of patches (a patch row is ``patch`` image rows), then runs of patches
        x, y = graph.values[op.inputs[0]], graph.values[op.outputs[0]]
        rows = _rows_plans(x.rows // op.attrs["patch"], tile_count, min_rows=1)
        counts = sorted({min(y.rows, tile_count), *_pow2(min(y.rows, tile_count))}, reverse=True)
        return rows + [{"patches": c} for c in counts if c > rows[0]["rows"]]

    def lower(self, graph, op, plan):
        x, y = graph.values[op.inputs[0]], graph.values[op.outputs[0]]
        p, c = op.attrs["patch"], op.attrs["channels"]
        npw = x.cols // (p * c)
        if "patches" in plan:
            ranges = split(y.rows, plan["patches"])
        else:
            ranges = [(a * npw, b * npw) for a, b in split(x.rows // p, plan["rows"])]
        return Lowering([[self._work(op, t, a, b, x, y, p, c, npw) for t, (a, b) in enumerate(ranges)]])

    @staticmethod
    def _work(op, t, a, b, x, y, p, c, npw) -> TileWork:
        """Patches ``a..b`` (row-major over the image): one image block per patch row they
        touch (or one for whole patch rows), one copy vertex per patch — a copy with the cast
        folded in when the output is FP8."""
        size, pc, wc, osize = x.itemsize, p * c, x.cols, y.itemsize

        def vertex(r, src_off, src_stride, patch):
            dst = ("w", 0, (patch - a) * p * pc * osize)
            if _folded(op):
                return (f"cast_rows_f32_{y.dtype}", [("r", r, src_off), dst, p, pc, y.scale_exp & 0xFFFFFFFF,
                                                     src_stride, pc * osize])
            return ("copy", [("r", r, src_off), dst, p, pc * size, src_stride, pc * size])

        if a % npw == 0 and b % npw == 0:       # whole patch rows: one image block
            verts = [vertex(0, ((pr - a // npw) * p * wc + pj * pc) * size, wc * size, pr * npw + pj)
                     for pr in range(a // npw, b // npw) for pj in range(npw)]
            return TileWork(t, [(key(x.id), a // npw * p, b // npw * p, 0, wc)], [(key(y.id), a, b, 0, y.cols)], verts)
        reads, verts = [], []
        for pr in range(a // npw, (b - 1) // npw + 1):
            j0, j1 = max(a, pr * npw) - pr * npw, min(b, (pr + 1) * npw) - pr * npw
            reads.append((key(x.id), pr * p, pr * p + p, j0 * pc, j1 * pc))
            verts += [vertex(len(reads) - 1, (pj - j0) * pc * size, (j1 - j0) * pc * size, pr * npw + pj)
                      for pj in range(j0, j1)]
        return TileWork(t, reads, [(key(y.id), a, b, 0, y.cols)], verts)

    def kernels(self):
        return [_variant("copy", "copy.c", copy_cycles), *_cast_rows_variants()]


def _cast_rows_variants():
    return [_variant(f"cast_rows_f32_{d}", "cast.c", cast_rows_cycles, SRC_TYPE=TYPE_CODE["f32"],
                     DST_TYPE=TYPE_CODE[d], ROWS=1) for d in FP8]


class ConcatRows(RowwiseOperator):
    """``[a; b]``: the rows of ``a`` then the rows of ``b`` (e.g. the class token, then patches).
    With ``attrs["addend"]`` (the ``fold_adds`` pass) its third input, an f32 value of its
    output's shape, is added to the rows (a positional embedding): bit-exact with the concat
    then ``add``."""
    name = "concat_rows"
    follows = None

    def infer(self, graph, op):
        a, b = (graph.values[i] for i in op.inputs[:2])
        if a.cols != b.cols or a.dtype != b.dtype:
            raise ValueError(f"cannot stack {a.name} {list(a.shape)} {a.dtype} on "
                             f"{b.name} {list(b.shape)} {b.dtype}")
        shape = (a.rows + b.rows, a.cols)
        if op.attrs.get("addend"):
            v = graph.values[op.inputs[2]]
            if a.dtype != "f32" or v.dtype != "f32" or v.shape != shape:
                raise ValueError(f"an addend of concat_rows must be f32 of shape {list(shape)} added to f32 "
                                 f"rows, got {v.dtype} {list(v.shape)} to {a.dtype}")
        return [(shape, a.dtype, a.scale_exp)]

    def fuses_addend(self, graph, op):
        return not op.attrs.get("addend") and graph.values[op.outputs[0]].dtype == "f32"

    def reference(self, graph, op, inputs):
        a, b = inputs[:2]
        out = np.concatenate([a.reshape(-1, a.shape[-1]), b.reshape(-1, b.shape[-1])])
        if op.attrs.get("addend"):
            out = (out + inputs[2].reshape(out.shape)).astype(np.float32)
        return [out]

    def tolerance(self, graph, op, inputs, outputs):
        return _exact(op)

    def lower(self, graph, op, plan):
        a, b = (graph.values[i] for i in op.inputs[:2])
        addend = graph.values[op.inputs[2]] if op.attrs.get("addend") else None
        y = graph.values[op.outputs[0]]
        rb = y.cols * y.itemsize

        def piece(reads, src, rows, at):
            """The vertex that writes ``rows`` rows from ``reads[src]`` at row ``at`` of the
            tile's block: a copy, or with an addend, the add of the addend's rows."""
            if addend is None:
                return ("copy", [("r", src, 0), ("w", 0, at * rb), rows, rb, rb, rb])
            return ("add_f32", [("r", src, 0), ("r", len(reads) - 1, at * rb), ("w", 0, at * rb), rows, y.cols, rows])

        def work(t, r0, r1):
            reads, pieces = [], []             # (read, rows, first row in the tile's block)
            if r0 < a.rows:
                reads.append((key(a.id), r0, min(r1, a.rows), 0, a.cols))
                pieces.append((0, min(r1, a.rows) - r0, 0))
            if r1 > a.rows:
                s0 = max(r0, a.rows)
                reads.append((key(b.id), s0 - a.rows, r1 - a.rows, 0, b.cols))
                pieces.append((len(reads) - 1, r1 - s0, s0 - r0))
            if addend is not None:
                reads.append((key(addend.id), r0, r1, 0, y.cols))
            return TileWork(t, reads, [(key(y.id), r0, r1, 0, y.cols)], [piece(reads, *p) for p in pieces])
        return Lowering([_rows_work(y.rows, plan, work)])

    def variants(self, graph, op):
        return ["add_f32" if op.attrs.get("addend") else "copy"]

    def kernels(self):
        return [_variant("copy", "copy.c", copy_cycles), _variant("add_f32", "add.c", add_cycles)]


class SliceRows(RowwiseOperator):
    name = "slice_rows"
    follows = None

    def infer(self, graph, op):
        x = graph.values[op.inputs[0]]
        s, e = op.attrs["start"], op.attrs["end"]
        if not 0 <= s < e <= x.rows:
            raise ValueError(f"rows {s}:{e} are outside {x.name} with {x.rows} rows")
        if _folded(op) and x.dtype != "f32":
            raise ValueError(f"a cast folded into slice_rows needs f32 rows, got {x.dtype}")
        return [((e - s, x.cols), *_out_type(op, x.dtype, x.scale_exp))]

    def fuses_cast(self, graph, op, dtype):
        return dtype in FP8 and graph.values[op.inputs[0]].dtype == "f32"

    def reference(self, graph, op, inputs):
        x = inputs[0]
        return [_encode_out(op, np.ascontiguousarray(x.reshape(-1, x.shape[-1])[op.attrs["start"]:op.attrs["end"]]))]

    def tolerance(self, graph, op, inputs, outputs):
        return _exact(op)

    def lower(self, graph, op, plan):
        x, y = graph.values[op.inputs[0]], graph.values[op.outputs[0]]
        s, rb = op.attrs["start"], x.cols * x.itemsize

        def work(t, r0, r1):
            if _folded(op):
                vertex = (f"cast_rows_f32_{y.dtype}", [("r", 0, 0), ("w", 0, 0), r1 - r0, x.cols,
                                                        y.scale_exp & 0xFFFFFFFF, rb, y.cols * y.itemsize])
            else:
                vertex = ("copy", [("r", 0, 0), ("w", 0, 0), r1 - r0, rb, rb, rb])
            return TileWork(t, [(key(x.id), s + r0, s + r1, 0, x.cols)], [(key(y.id), r0, r1, 0, y.cols)], [vertex])
        return Lowering([_rows_work(y.rows, plan, work)])

    def kernels(self):
        return [_variant("copy", "copy.c", copy_cycles), *_cast_rows_variants()]


def _decode(x, v):
    return fp8.decode(x, v.dtype, 0) if v.dtype in FP8 else x.astype(np.float32)


def _matmul_reference(a, av, b, bv, trans_b=False):
    b = _decode(b, bv)
    # the same bits on every CPU (BLAS's summation order depends on the processor), and exact
    # for FP8 operands; one rounding to f32
    out = hostmatmul.matmul(_decode(a, av), b.T if trans_b else b)
    return (out * 2.0 ** -(av.scale_exp + bv.scale_exp)).astype(np.float32)


def _matmul_suffix(op) -> str:
    """The suffix of the kernels that write a matmul's result: ``_gelu`` with a GELU folded in,
    ``_fp8`` with a cast."""
    return ("_gelu" if op.attrs.get("activation") else "") + ("_fp8" if _folded(op) else "")


def _matmul_operands(op) -> tuple[int, int, int | None, int | None]:
    """A matmul's ``(a, b, bias, addend)`` value ids: inputs ``[a, b]``, then the bias if any,
    then the addend if ``attrs["addend"]`` (a residual add folded in)."""
    rest = list(op.inputs[2:])
    addend = rest.pop() if op.attrs.get("addend") else None
    return op.inputs[0], op.inputs[1], (rest[0] if rest else None), addend


class MatMul(Operator):
    """``A[M,K] @ B[K,N] (+ bias[N])`` with f32 accumulation; B is a constant or activation.
    With ``attrs["addend"]`` (the ``fold_adds`` pass) its last input, an f32 ``[M, N]``, is
    added to the product: ``addend + (A @ B + bias)``, bit-exact with the product then ``add``.
    With ``attrs["activation"] = "gelu"`` (the ``fold_activations`` pass) the GELU of the product
    (before any folded cast), bit-exact with the product then ``gelu``."""
    name = "matmul"

    def infer(self, graph, op):
        ia, ib, ibias, iadd = _matmul_operands(op)
        a, b = graph.values[ia], graph.values[ib]
        if len(a.shape) != 2 or len(b.shape) != 2 or a.shape[1] != b.shape[0]:
            raise ValueError(f"cannot multiply {a.name} {list(a.shape)} by {b.name} {list(b.shape)}")
        if (a.dtype, b.dtype) not in MATMUL_TYPES:
            raise ValueError(f"no matmul for {a.dtype} x {b.dtype}; supported: {MATMUL_TYPES}")
        if len(op.inputs) > 3 + (iadd is not None):
            raise ValueError(f"a matmul takes a, b, a bias and an addend at most, got {len(op.inputs)} inputs")
        if ibias is not None and graph.values[ibias].shape != (b.shape[1],):
            raise ValueError(f"bias must have shape [{b.shape[1]}]")
        if iadd is not None:
            v = graph.values[iadd]
            if v.shape != (a.shape[0], b.shape[1]) or v.dtype != "f32":
                raise ValueError(f"the addend must be f32 of shape [{a.shape[0]}, {b.shape[1]}], got "
                                 f"{v.dtype} {list(v.shape)}")
            if _folded(op) or op.attrs.get("activation"):
                raise ValueError("a matmul with an addend cannot have a cast or an activation folded in")
        if op.attrs.get("activation") not in (None, "gelu"):
            raise ValueError(f"a matmul's activation must be gelu, not {op.attrs['activation']!r}")
        if _folded(op) and not self.fuses_cast(graph, op, op.attrs["to"]):
            raise ValueError(f"a cast folded into a matmul needs FP8 operands, got {a.dtype} x {b.dtype}")
        return [((a.shape[0], b.shape[1]), *_out_type(op, "f32", 0))]

    def fuses_cast(self, graph, op, dtype):
        return dtype in FP8 and not op.attrs.get("addend") and all(graph.values[v].dtype in FP8 for v in op.inputs[:2])

    def fuses_addend(self, graph, op):
        return not op.attrs.get("addend") and not _folded(op) and not op.attrs.get("activation")

    def fuses_activation(self, graph, op, activation):
        return activation == "gelu" and not any(op.attrs.get(a) for a in ("addend", "activation", "to"))

    def _product(self, graph, op, inputs):
        """The reference of the product and bias, before any addend."""
        a, b = graph.values[op.inputs[0]], graph.values[op.inputs[1]]
        out = _matmul_reference(inputs[0], a, inputs[1], b)
        if _matmul_operands(op)[2] is not None:
            out = (out + inputs[2]).astype(np.float32)
        return out

    def reference(self, graph, op, inputs):
        out = self._product(graph, op, inputs)
        if op.attrs.get("addend"):
            out = (inputs[-1] + out).astype(np.float32)
        if op.attrs.get("activation"):
            out = _gelu(out)
        return [_encode_out(op, out)]

    def tolerance(self, graph, op, inputs, outputs):
        """``K`` products summed in any order (a split-K plan sums partial results, its first
        with the bias: a few roundings more), then the bias added: see ``_product_bound``;
        with an addend, its sum rounds once more; with a GELU, that bound on its input times the
        GELU's largest slope, and the GELU's own (``_gelu_tolerance``)."""
        a, b = graph.values[op.inputs[0]], graph.values[op.inputs[1]]
        bound = _product_bound(inputs[0], a, inputs[1], b, terms=4)
        if _matmul_operands(op)[2] is not None:
            bound = bound + 2 * gamma(4) * _abs(inputs[2])
        if op.attrs.get("addend"):
            bound = bound + 2 * U * _abs(self._product(graph, op, inputs))
        if op.attrs.get("activation"):
            pre = self._product(graph, op, inputs)
            return [GELU_SLOPE * (bound + 2 * U * _abs(pre) + TINY) + _gelu_tolerance(pre, outputs[0])]
        return [bound + 2 * U * _abs(outputs[0]) + TINY]

    def plans(self, graph, op, tile_count):
        a, b = graph.values[op.inputs[0]], graph.values[op.inputs[1]]
        m_, k_, n_ = a.shape[0], a.shape[1], b.shape[1]
        out = []
        for k in (1, 2, 4, 8, 16, 32):
            # powers of two; with k = 1 also column counts that divide N evenly (head-aligned
            # blocks, e.g. 3 or 9 for a fused QKV), and row counts that fill the tiles
            ns = _pow2(min(n_, tile_count))
            if k == 1:
                ns += [d for d in range(3, 17) if d & (d - 1) and n_ % d == 0 and d <= tile_count]
            for n in ns:
                ms = _pow2(min(m_, tile_count))
                if k == 1:
                    ms = sorted({*ms, min(m_, tile_count // n)} - {0})
                for m in ms:
                    if m * n * k <= tile_count and (k == 1 or k <= k_ // 16):
                        out.append({"m": m, "n": n, "k": k})
            if k > 1 and k <= k_ // 16:
                # with a K split, also the column counts that fill the tiles (a grid of
                # 2 × 46 × 16 on 1472 tiles, not 2 × 32 × 16 on 1024)
                for m in _pow2(min(m_, tile_count)):
                    n = min(n_, tile_count // (m * k))
                    if n >= 1 and n not in ns:
                        out.append({"m": m, "n": n, "k": k})
        # default first: blocks of at least 8 rows and 32 columns (smaller ones fragment the
        # exchange), then the most tiles, no K split, the squarest blocks
        def order(p):
            return (m_ // p["m"] < min(8, m_) or n_ // p["n"] < min(32, n_), -(p["m"] * p["n"] * p["k"]), p["k"],
                    abs(math.log2(max(1, m_ // p["m"]) / max(1, n_ // p["n"]))))
        out.sort(key=order)
        # then, marked ``aligned``, the grids of the same rows and K-slices whose column count
        # cuts N into whole 32-column blocks (a fused QKV's heads): a reader of a few such
        # columns takes each block's rows in one transfer, not one a row (ViT-B/16's attention
        # exchange halves). After the others, so the initial placement, which spreads its
        # tries over the list, does not see them (it would place ViT-B/16 over memory); the
        # search's ``align_columns`` proposes them
        have = {(p["m"], p["n"], p["k"]) for p in out}
        extra = [{"m": m, "n": n, "k": k, "aligned": True} for m, k in sorted({(p["m"], p["k"]) for p in out})
                 for n in aligned_counts(n_, tile_count) if (m, n, k) not in have and m * n * k <= tile_count]
        return out + sorted(extra, key=order)

    def macs(self, graph, op):
        a, b = graph.values[op.inputs[0]], graph.values[op.inputs[1]]
        return a.shape[0] * a.shape[1] * b.shape[1]

    def lower(self, graph, op, plan):
        ia, ib, ibias, iadd = _matmul_operands(op)
        a, b = graph.values[ia], graph.values[ib]
        bias = graph.values[ibias] if ibias is not None else None
        addend = graph.values[iadd] if iadd is not None else None
        y = graph.values[op.outputs[0]]
        m_, k_, n_ = a.shape[0], a.shape[1], b.shape[1]
        rows, cols, ks = split(m_, plan["m"]), split(n_, plan["n"]), split(k_, plan["k"])
        kname = f"matmul_{a.dtype}_{b.dtype}"
        epilogue = _epilogue(op)
        suffix = _matmul_suffix(op)
        temp = f"t{op.id}.0"
        stage1, stage2 = [], []
        for i, (r0, r1) in enumerate(rows):
            for j, (c0, c1) in enumerate(cols):
                for l, (k0, k1) in enumerate(ks):
                    t = (i * len(cols) + j) * len(ks) + l
                    reads = [(key(a.id), r0, r1, k0, k1), (key(b.id), k0, k1, c0, c1)]
                    bias_arg = 0
                    if bias is not None and l == 0:
                        reads.append((key(bias.id), 0, 1, c0, c1))
                        bias_arg = ("r", 2, 0)
                    direct = len(ks) == 1      # else partial sums, reduced in stage 2
                    flags, tail = 0, epilogue if direct else []
                    if direct and addend is not None:
                        reads.append((key(addend.id), r0, r1, c0, c1))
                        flags, tail = 4, [("r", len(reads) - 1, 0)]
                    out = (key(y.id), r0, r1, c0, c1) if direct else (temp, l * m_ + r0, l * m_ + r1, c0, c1)
                    stage1.append(TileWork(t, reads, [out], [(kname + (suffix if direct else ""), [
                        ("r", 0, 0), ("r", 1, 0), ("w", 0, 0), r1 - r0, k1 - k0, c1 - c0, flags,
                        a.scale_exp & 0xFFFFFFFF, b.scale_exp & 0xFFFFFFFF, bias_arg, *tail])]))
                # the reduction is spread over the block's K-slice tiles (a reduce-scatter, as
                # poplibs does): tile l sums rows l of the block's split, so each receives
                # (k-1)/k of a block's partial sums rather than one tile (k-1) blocks; every
                # element is still summed over l = 0, 1, … in order (deterministic)
                for l, (q0, q1) in enumerate(split(r1 - r0, len(ks)) if len(ks) > 1 else ()):
                    if q0 == q1:
                        continue
                    t = (i * len(cols) + j) * len(ks) + l
                    s0, s1 = r0 + q0, r0 + q1
                    reads = [(temp, p * m_ + s0, p * m_ + s1, c0, c1) for p in range(len(ks))]
                    if addend is not None:        # summed last: the partial sums' total, then it
                        reads.append((key(addend.id), s0, s1, c0, c1))
                    stage2.append(TileWork(t, reads, [(key(y.id), s0, s1, c0, c1)], [(
                        "reduce_f32" + suffix,
                        [("w", 0, 0), (s1 - s0) * (c1 - c0), len(reads), *epilogue]
                        + [("r", p, 0) for p in range(len(reads))])]))
        if not stage2:
            return Lowering([stage1])
        return Lowering([stage1, stage2], {temp: (len(ks) * m_, n_, "f32")})

    def variants(self, graph, op):
        a, b = graph.values[op.inputs[0]], graph.values[op.inputs[1]]
        base = [f"matmul_{a.dtype}_{b.dtype}", "reduce_f32"]
        suffix = _matmul_suffix(op)
        return base + [f"{k}{suffix}" for k in base] if suffix else base

    def kernels(self):
        out = [_variant(f"matmul_{x}_{w}", "matmul.c", matmul_cycles(x), A_TYPE=TYPE_CODE[x],
                        B_TYPE=TYPE_CODE[w]) for x, w in MATMUL_TYPES]
        out += _matmul_fp8_variants()
        out += [_variant(f"matmul_{x}_{w}_gelu", "matmul.c", matmul_gelu_cycles(x, False), A_TYPE=TYPE_CODE[x],
                         B_TYPE=TYPE_CODE[w], GELU=1) for x, w in MATMUL_TYPES]
        out += [_variant(f"matmul_{x}_{w}_gelu_fp8", "matmul.c", matmul_gelu_cycles(x, True), A_TYPE=TYPE_CODE[x],
                         B_TYPE=TYPE_CODE[w], GELU=1, FP8_OUT=1) for x, w in MATMUL_TYPES if x in FP8 and w in FP8]
        out.append(_variant("reduce_f32", "reduce.c", reduce_cycles))
        out.append(_variant("reduce_f32_fp8", "reduce.c", reduce_fp8_cycles, FP8_OUT=1))
        out.append(_variant("reduce_f32_gelu", "reduce.c", reduce_gelu_cycles, GELU=1))
        out.append(_variant("reduce_f32_gelu_fp8", "reduce.c", reduce_gelu_fp8_cycles, GELU=1, FP8_OUT=1))
        return out


def _matmul_fp8_variants():
    """Products of FP8 operands with the cast of their result folded in (``FP8_OUT``)."""
    return [_variant(f"matmul_{x}_{w}_fp8", "matmul.c", matmul_fp8_cycles(x),
                     A_TYPE=TYPE_CODE[x], B_TYPE=TYPE_CODE[w], FP8_OUT=1)
            for x, w in MATMUL_TYPES if x in FP8 and w in FP8]


def _pow2(n):
    out, p = [], 1
    while p <= n:
        out.append(p)
        p *= 2
    return out


def _head_plans(rows: int, heads: int, tile_count: int) -> list[dict]:
    """Each head's rows split over ``rows`` tiles; with fewer tiles than heads × rows, tiles
    take several heads (``tiles`` is how many tiles the plan uses)."""
    return [{"rows": p["rows"], "tiles": min(heads * p["rows"], tile_count)}
            for p in _rows_plans(rows, max(1, tile_count // heads))]


def _head_grid_plans(rows: int, cols: int, heads: int, tile_count: int) -> list[dict]:
    """Each head's output over a ``rows`` × ``cols`` grid of its own tiles, for 2, 4, 8, …
    column blocks and as many row blocks as the head's share of the tiles then takes. A tile
    of a row-only plan reads the whole of its head's K (scores) or V (context) — 12.6 KB of
    FP8 on a ViT-B/16 head, for every one of the 122 tiles of the head — where a tile of a
    grid reads its rows' and columns' share of both operands."""
    share = max(1, tile_count // heads)
    out = []
    for c in _pow2(min(cols, share))[1:]:
        r = min(rows, share // c)
        if r >= 1:
            out.append({"rows": r, "cols": c, "tiles": min(heads * r * c, tile_count)})
    return out


def _head_items(plan: dict, s: int, h: int, cols: int) -> list[tuple]:
    """The ``(tile, head, r0, r1, c0, c1)`` work items of an attention plan over an output of
    ``cols`` columns a head: explicit (``work``, whole columns where an item gives rows only),
    each head's rows over its own tiles (``head_tiles``), or each head's rows × columns grid
    (``rows`` × ``cols``, one column block without ``cols``) over consecutive tiles, wrapping
    at ``tiles``."""
    if "work" in plan:
        return [tuple(w) if len(w) == 6 else (*w, 0, cols) for w in plan["work"]]
    if "head_tiles" in plan:
        return [(tiles[i], hh, r0, r1, 0, cols) for hh, tiles in enumerate(plan["head_tiles"])
                for i, (r0, r1) in enumerate(split(s, len(tiles)))]
    r, c = plan["rows"], plan.get("cols", 1)
    return [((hh * r * c + i * c + j) % plan["tiles"], hh, r0, r1, c0, c1)
            for hh in range(h) for i, (r0, r1) in enumerate(split(s, r))
            for j, (c0, c1) in enumerate(split(cols, c))]


def _heads_on_qkv(blocks: list, d: int, h: int, dh: int) -> dict:
    """Each head's rows over the tiles that hold any of its Q, K or V columns of ``qkv``, in the
    order of the rows they hold (so a tile's rows are mostly its own Q rows)."""
    out = []
    for hh in range(h):
        spans = [(base + hh * dh, base + (hh + 1) * dh) for base in (0, d, 2 * d)]
        found = sorted((r0, c0, t) for t, r0, r1, c0, c1 in blocks if any(c0 < b and a < c1 for a, b in spans))
        out.append(list(dict.fromkeys(t for _, _, t in found)))
    return {"head_tiles": out}


def _produced(graph, vid) -> bool:
    return vid not in graph.constants and vid not in graph.inputs


class AttentionScores(Operator):
    """Per head ``q_h @ k_h^T`` from a fused ``qkv[S, 3D]``: output ``[H, S, S]``."""
    name = "attention_scores"

    def infer(self, graph, op):
        qkv = graph.values[op.inputs[0]]
        h = op.attrs["heads"]
        if len(qkv.shape) != 2 or qkv.shape[1] % (3 * h):
            raise ValueError(f"qkv must be [S, 3*D] with D divisible by {h} heads, got {list(qkv.shape)}")
        s = qkv.shape[0]
        return [((h, s, s), "f32", 0)]

    def _dims(self, graph, op):
        qkv = graph.values[op.inputs[0]]
        s, d = qkv.shape[0], qkv.shape[1] // 3
        return qkv, s, d, op.attrs["heads"], d // op.attrs["heads"]

    def reference(self, graph, op, inputs):
        qkv, s, d, h, dh = self._dims(graph, op)
        x = inputs[0]
        out = [_matmul_reference(x[:, i * dh:(i + 1) * dh], qkv, x[:, d + i * dh:d + (i + 1) * dh], qkv,
                                 trans_b=True) for i in range(h)]
        return [np.stack(out)]

    def tolerance(self, graph, op, inputs, outputs):
        qkv, s, d, h, dh = self._dims(graph, op)
        x = inputs[0]
        bound = np.stack([_product_bound(x[:, i * dh:(i + 1) * dh], qkv, x[:, d + i * dh:d + (i + 1) * dh], qkv,
                                         trans_b=True, terms=1) for i in range(h)])
        return [bound + 2 * U * _abs(outputs[0]) + TINY]

    def plans(self, graph, op, tile_count):
        qkv, s, d, h, dh = self._dims(graph, op)
        return _head_plans(s, h, tile_count) + self.follow_plans(graph, op) + _head_grid_plans(s, s, h, tile_count)

    def follow_plans(self, graph, op):
        """Following ``qkv``: each head's rows on the tiles that computed its Q, K, V blocks."""
        return [{"follow": 0}] if _produced(graph, op.inputs[0]) else []

    def follow(self, graph, op, position, blocks):
        qkv, s, d, h, dh = self._dims(graph, op)
        return _heads_on_qkv(blocks, d, h, dh)

    def macs(self, graph, op):
        qkv, s, d, h, dh = self._dims(graph, op)
        return h * s * s * dh

    def lower(self, graph, op, plan):
        qkv, s, d, h, dh = self._dims(graph, op)
        y = graph.values[op.outputs[0]]
        sc = qkv.scale_exp & 0xFFFFFFFF
        work = [TileWork(t, [(key(qkv.id), r0, r1, hh * dh, (hh + 1) * dh),
                             (key(qkv.id), c0, c1, d + hh * dh, d + (hh + 1) * dh)],
                         [(key(y.id), hh * s + r0, hh * s + r1, c0, c1)],
                         [(f"matmul_{qkv.dtype}_{qkv.dtype}",
                           [("r", 0, 0), ("r", 1, 0), ("w", 0, 0), r1 - r0, dh, c1 - c0, 1, sc, sc, 0])])
                for t, hh, r0, r1, c0, c1 in _head_items(plan, s, h, s)]
        return Lowering([work])

    def variants(self, graph, op):
        dtype = graph.values[op.inputs[0]].dtype
        return [f"matmul_{dtype}_{dtype}"]


class AttentionContext(Operator):
    """Per head ``p_h @ v_h`` with ``p[H, S, S]`` and ``v`` from ``qkv[S, 3D]``: output ``[S, D]``."""
    name = "attention_context"

    def infer(self, graph, op):
        p, qkv = (graph.values[i] for i in op.inputs)
        h = op.attrs["heads"]
        if len(qkv.shape) != 2 or qkv.shape[1] % (3 * h):
            raise ValueError(f"qkv must be [S, 3*D] with D divisible by {h} heads, got {list(qkv.shape)}")
        s, d = qkv.shape[0], qkv.shape[1] // 3
        if p.shape != (h, s, s):
            raise ValueError(f"probabilities must be [{h}, {s}, {s}], got {list(p.shape)}")
        if (p.dtype, qkv.dtype) not in MATMUL_TYPES:
            raise ValueError(f"no matmul for {p.dtype} x {qkv.dtype}")
        if _folded(op) and not self.fuses_cast(graph, op, op.attrs["to"]):
            raise ValueError(f"a cast folded into attention_context needs FP8 operands, got {p.dtype} x {qkv.dtype}")
        return [((s, d), *_out_type(op, "f32", 0))]

    def fuses_cast(self, graph, op, dtype):
        return dtype in FP8 and all(graph.values[v].dtype in FP8 for v in op.inputs)

    def reference(self, graph, op, inputs):
        pv, qkv = (graph.values[i] for i in op.inputs)
        p, x = inputs
        h = op.attrs["heads"]
        d = qkv.shape[1] // 3
        dh = d // h
        return [_encode_out(op, np.concatenate([_matmul_reference(p[i], pv, x[:, 2 * d + i * dh:2 * d + (i + 1) * dh], qkv)
                                                for i in range(h)], axis=1))]

    def tolerance(self, graph, op, inputs, outputs):
        pv, qkv = (graph.values[i] for i in op.inputs)
        p, x = inputs
        h = op.attrs["heads"]
        d = qkv.shape[1] // 3
        dh = d // h
        bound = np.concatenate([_product_bound(p[i], pv, x[:, 2 * d + i * dh:2 * d + (i + 1) * dh], qkv, terms=1)
                                for i in range(h)], axis=1)
        return [bound + 2 * U * _abs(outputs[0]) + TINY]

    def plans(self, graph, op, tile_count):
        qkv, h = graph.values[op.inputs[1]], op.attrs["heads"]
        s, dh = qkv.shape[0], qkv.shape[1] // 3 // h
        return _head_plans(s, h, tile_count) + self.follow_plans(graph, op) + _head_grid_plans(s, dh, h, tile_count)

    def follow_plans(self, graph, op):
        """Following the probabilities (each row where it was computed), or ``qkv`` (each
        head's rows on the tiles that computed its Q, K, V blocks)."""
        return [{"follow": i} for i in (0, 1) if _produced(graph, op.inputs[i])]

    def follow(self, graph, op, position, blocks):
        qkv = graph.values[op.inputs[1]]
        h = op.attrs["heads"]
        s, d = qkv.shape[0], qkv.shape[1] // 3
        if position == 1:
            return _heads_on_qkv(blocks, d, h, d // h)
        work = []
        for t, r0, r1, c0, c1 in blocks:
            if (c0, c1) != (0, s):
                raise ValueError("its producer splits the columns of the probabilities and it needs whole rows")
            for hh in range(r0 // s, (r1 - 1) // s + 1):
                work.append([t, hh, max(r0, hh * s) - hh * s, min(r1, (hh + 1) * s) - hh * s])
        return {"work": work}

    def macs(self, graph, op):
        qkv = graph.values[op.inputs[1]]
        s, d = qkv.shape[0], qkv.shape[1] // 3
        return s * s * d

    def lower(self, graph, op, plan):
        pv, qkv = (graph.values[i] for i in op.inputs)
        y = graph.values[op.outputs[0]]
        h = op.attrs["heads"]
        s, d = qkv.shape[0], qkv.shape[1] // 3
        dh = d // h
        work = [TileWork(t, [(key(pv.id), hh * s + r0, hh * s + r1, 0, s),
                             (key(qkv.id), 0, s, 2 * d + hh * dh + c0, 2 * d + hh * dh + c1)],
                         [(key(y.id), r0, r1, hh * dh + c0, hh * dh + c1)],
                         [(f"matmul_{pv.dtype}_{qkv.dtype}" + ("_fp8" if _folded(op) else ""),
                           [("r", 0, 0), ("r", 1, 0), ("w", 0, 0), r1 - r0, s, c1 - c0, 0,
                            pv.scale_exp & 0xFFFFFFFF, qkv.scale_exp & 0xFFFFFFFF, 0, *_epilogue(op)])])
                for t, hh, r0, r1, c0, c1 in _head_items(plan, s, h, dh)]
        return Lowering([work])

    def variants(self, graph, op):
        pv, qkv = (graph.values[i] for i in op.inputs)
        return [f"matmul_{pv.dtype}_{qkv.dtype}" + ("_fp8" if _folded(op) else "")]


@hookimpl
def ipubuild_operators():
    return [Cast(), Add(), LayerNorm(), Softmax(), Gelu(), Patchify(), ConcatRows(), SliceRows(),
            MatMul(), AttentionScores(), AttentionContext()]
