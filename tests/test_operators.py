"""Built-in operators (ipubuild/builtin/operators.py): references against independent
formulations, type-inference errors, and the block structure of every plan's lowering."""
from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest

from ipubuild import fp8, ir
from ipubuild.graph import reference
from ipubuild.errors import UserError
from ipubuild.operators import registry, split

ML = {"f143": ml_dtypes.float8_e4m3fnuz, "f152": ml_dtypes.float8_e5m2fnuz}
FP8MAX = {"f143": 240.0, "f152": 57344.0}


# helpers ---------------------------------------------------------------------------------------
def fp8_input(g, name, shape, dtype, scale_exp, rng, store):
    """An FP8 graph input with random non-NaN codes."""
    vid = g.value(name, shape, dtype, scale_exp)
    g.inputs.append(vid)
    codes = rng.integers(0, 256, size=shape).astype(np.uint8)
    codes[codes == 0x80] = 0
    store[vid] = codes
    return vid


def f32_input(g, name, shape, rng, store, scale=1.0):
    vid = g.input(name, shape)
    store[vid] = (scale * rng.standard_normal(shape)).astype(np.float32)
    return vid


def dec64(codes, dtype, scale_exp):
    """Independent FP8 decode: ml_dtypes to float64, times 2**-scale_exp."""
    if dtype in ML:
        return np.asarray(codes, np.uint8).view(ML[dtype]).astype(np.float64) * 2.0 ** (-scale_exp)
    return np.asarray(codes).astype(np.float64)


def run(g, inputs, consts=None):
    out_id = g.ops[-1].outputs[0]
    g.outputs = [out_id]
    g.validate()
    return reference.evaluate(g, consts or {}, inputs)[out_id]


def close(got, want, rtol=1e-5):
    got = np.asarray(got, np.float64)
    want = np.asarray(want, np.float64)
    assert got.shape == want.shape
    scale = max(1.0, float(np.abs(want).max()))
    np.testing.assert_allclose(got, want, rtol=rtol, atol=rtol * scale)


SEEDS = [0, 1, 2]


# references --------------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", ["f143", "f152"])
@pytest.mark.parametrize("scale_exp", [-3, 0, 4])
def test_cast_to_fp8_matches_saturating_ml_dtypes(fmt, scale_exp):
    rng = np.random.default_rng(scale_exp + 10)
    g, ins = ir.Graph(), {}
    x = f32_input(g, "x", (5, 7), rng, ins, scale=50.0)
    ins[x][0, :3] = [np.inf, -np.inf, np.nan]
    ins[x][1, 0] = 1e30
    y = g.add("cast", [x], name="c", to=fmt, scale_exp=scale_exp)
    assert g.values[y].dtype == fmt and g.values[y].scale_exp == scale_exp
    got = run(g, ins)
    assert got.dtype == np.uint8
    x64 = ins[x].astype(np.float64) * 2.0 ** scale_exp
    want = np.empty(x64.shape, np.uint8)
    for idx, v in np.ndenumerate(x64):          # element by element, explicit saturation
        if math.isnan(v):
            want[idx] = 0x80
            continue
        v = min(max(v, -FP8MAX[fmt]), FP8MAX[fmt])
        code = int(np.array(v).astype(ML[fmt]).view(np.uint8))
        want[idx] = 0 if code == 0x80 else code    # -0 is +0, never NaN
    np.testing.assert_array_equal(got, want)
    # and it agrees with ipubuild.fp8
    np.testing.assert_array_equal(got, fp8.encode(ins[x], fmt, scale_exp))


@pytest.mark.parametrize("fmt", ["f143", "f152"])
@pytest.mark.parametrize("scale_exp", [-2, 0, 7])
def test_cast_from_fp8_decodes_with_the_source_scale(fmt, scale_exp):
    rng = np.random.default_rng(3)
    g, ins = ir.Graph(), {}
    x = fp8_input(g, "x", (4, 64), fmt, scale_exp, rng, ins)
    g.add("cast", [x], name="c", to="f32")
    got = run(g, ins)
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got.astype(np.float64), dec64(ins[x], fmt, scale_exp))


def test_cast_f16_round_trip():
    rng = np.random.default_rng(4)
    g, ins = ir.Graph(), {}
    x = f32_input(g, "x", (3, 9), rng, ins, scale=1000.0)
    h = g.add("cast", [x], name="to16", to="f16")
    assert g.values[h].dtype == "f16"
    g.add("cast", [h], name="to32", to="f32")
    got = run(g, ins)
    want = fp8.from_f16_bits(fp8.to_f16_bits(ins[x]))
    np.testing.assert_array_equal(got, want)
    # every value within half an f16 ulp (relative 2**-11) of the input
    assert np.all(np.abs(got - ins[x]) <= np.abs(ins[x]) * 2.0 ** -11 + 1e-7)


@pytest.mark.parametrize("seed", SEEDS)
def test_add_same_shape_and_row_broadcast(seed):
    rng = np.random.default_rng(seed)
    g, ins = ir.Graph(), {}
    a = f32_input(g, "a", (2, 3, 5), rng, ins)
    b = f32_input(g, "b", (2, 3, 5), rng, ins)
    g.add("add", [a, b], name="s")
    got = run(g, ins)
    want = np.zeros((2, 3, 5))
    for i, j, k in np.ndindex(2, 3, 5):
        want[i, j, k] = float(ins[a][i, j, k]) + float(ins[b][i, j, k])
    close(got, want)

    for bshape in [(5,), (1, 5)]:
        g, ins = ir.Graph(), {}
        a = f32_input(g, "a", (4, 5), rng, ins)
        b = f32_input(g, "b", bshape, rng, ins)
        g.add("add", [a, b], name="bc")
        got = run(g, ins)
        brow = ins[b].reshape(-1)
        want = [[float(ins[a][r, c]) + float(brow[c]) for c in range(5)] for r in range(4)]
        close(got, want)


@pytest.mark.parametrize("seed", SEEDS)
def test_layernorm_two_pass_float64(seed):
    rng = np.random.default_rng(seed)
    g, ins = ir.Graph(), {}
    x = f32_input(g, "x", (6, 33), rng, ins, scale=3.0)
    ins[x] += 5.0
    ga = f32_input(g, "gamma", (33,), rng, ins)
    be = f32_input(g, "beta", (33,), rng, ins)
    g.add("layernorm", [x, ga, be], name="ln", eps=1e-5)
    got = run(g, ins)
    want = np.zeros((6, 33))
    for r in range(6):
        row = ins[x][r].astype(np.float64)
        mean = sum(row) / len(row)
        var = sum((v - mean) ** 2 for v in row) / len(row)
        want[r] = (row - mean) / math.sqrt(var + 1e-5) * ins[ga] + ins[be]
    close(got, want, rtol=2e-5)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("scale", [1.0, 0.125, 3.0])
def test_softmax_with_scale(seed, scale):
    rng = np.random.default_rng(seed)
    g, ins = ir.Graph(), {}
    x = f32_input(g, "x", (2, 4, 9), rng, ins, scale=4.0)
    g.add("softmax", [x], name="sm", scale=scale)
    got = run(g, ins)
    want = np.zeros((2, 4, 9))
    for i, j in np.ndindex(2, 4):
        row = [scale * float(v) for v in ins[x][i, j]]
        e = [math.exp(v) for v in row]       # no max subtraction: values are small
        want[i, j] = [v / sum(e) for v in e]
    close(got, want)
    np.testing.assert_allclose(got.sum(axis=-1), 1.0, rtol=1e-5)


@pytest.mark.parametrize("seed", SEEDS)
def test_gelu_tanh_form(seed):
    rng = np.random.default_rng(seed)
    g, ins = ir.Graph(), {}
    x = f32_input(g, "x", (7, 11), rng, ins, scale=3.0)
    g.add("gelu", [x], name="ge")
    got = run(g, ins)
    want = np.zeros((7, 11))
    for idx, v in np.ndenumerate(ins[x].astype(np.float64)):
        want[idx] = 0.5 * v * (1.0 + math.tanh(math.sqrt(2.0 / math.pi) * (v + 0.044715 * v ** 3)))
    close(got, want, rtol=1e-6)


@pytest.mark.parametrize("h,w,p,c", [(4, 6, 2, 3), (8, 8, 4, 1), (6, 9, 3, 2)])
def test_patchify_explicit_loop(h, w, p, c):
    rng = np.random.default_rng(h * w)
    g, ins = ir.Graph(), {}
    x = f32_input(g, "img", (h, w * c), rng, ins)
    y = g.add("patchify", [x], name="pf", patch=p, channels=c)
    assert g.values[y].shape == ((h // p) * (w // p), p * p * c)
    got = run(g, ins)
    want = np.zeros(((h // p) * (w // p), p * p * c), np.float32)
    img = ins[x]
    for pi in range(h // p):
        for pj in range(w // p):
            patch = pi * (w // p) + pj
            for dy in range(p):
                for dx in range(p):
                    for ch in range(c):
                        want[patch, (dy * p + dx) * c + ch] = img[pi * p + dy, (pj * p + dx) * c + ch]
    np.testing.assert_array_equal(got, want)


def test_concat_and_slice_rows():
    rng = np.random.default_rng(5)
    g, ins = ir.Graph(), {}
    a = f32_input(g, "a", (1, 6), rng, ins)
    b = f32_input(g, "b", (2, 2, 6), rng, ins)
    cat = g.add("concat_rows", [a, b], name="cat")
    assert g.values[cat].shape == (5, 6)
    got = run(g, ins)
    rows = [list(ins[a][0])] + [list(r) for r in ins[b].reshape(4, 6)]
    np.testing.assert_array_equal(got, np.array(rows, np.float32))
    sl = g.add("slice_rows", [cat], name="sl", start=1, end=4)
    assert g.values[sl].shape == (3, 6)
    got = run(g, ins)
    np.testing.assert_array_equal(got, np.array(rows[1:4], np.float32))


MM_TYPES = [("f143", "f143"), ("f143", "f152"), ("f152", "f143"), ("f152", "f152"), ("f16", "f16"),
            ("f32", "f32")]


@pytest.mark.parametrize("at,bt", MM_TYPES)
@pytest.mark.parametrize("bias", [False, True])
def test_matmul_against_float64_loops(at, bt, bias):
    rng = np.random.default_rng(MM_TYPES.index((at, bt)) * 2 + bias)
    g, ins = ir.Graph(), {}
    M, K, N = 5, 20, 7

    def operand(name, shape, dt, s):
        if dt in ML:
            return fp8_input(g, name, shape, dt, s, rng, ins)
        vid = g.value(name, shape, dt)
        g.inputs.append(vid)
        ins[vid] = rng.standard_normal(shape).astype(np.float16 if dt == "f16" else np.float32)
        return vid
    sa, sb = (3, -2) if at in ML else (0, 0)
    a = operand("a", (M, K), at, sa)
    b = operand("b", (K, N), bt, sb if bt in ML else 0)
    args = [a, b]
    if bias:
        args.append(f32_input(g, "bias", (N,), rng, ins))
    y = g.add("matmul", args, name="mm")
    assert g.values[y].shape == (M, N) and g.values[y].dtype == "f32"
    got = run(g, ins)
    A = dec64(ins[a], at, g.values[a].scale_exp)
    B = dec64(ins[b], bt, g.values[b].scale_exp)
    want = np.zeros((M, N))
    for i in range(M):
        for j in range(N):
            want[i, j] = sum(A[i, k] * B[k, j] for k in range(K)) + (float(ins[args[2]][j]) if bias else 0.0)
    close(got, want, rtol=1e-5)


@pytest.mark.parametrize("fmt", ["f143", "f152"])
@pytest.mark.parametrize("heads", [1, 2, 3])
def test_attention_scores_and_context_einsum(fmt, heads):
    rng = np.random.default_rng(heads)
    S, dh = 6, 4
    D = heads * dh
    g, ins = ir.Graph(), {}
    qkv = fp8_input(g, "qkv", (S, 3 * D), fmt, 2, rng, ins)
    sc = g.add("attention_scores", [qkv], name="scores", heads=heads)
    assert g.values[sc].shape == (heads, S, S)
    got = run(g, ins)
    X = dec64(ins[qkv], fmt, 2)
    q = X[:, :D].reshape(S, heads, dh)
    k = X[:, D:2 * D].reshape(S, heads, dh)
    close(got, np.einsum("shd,thd->hst", q, k))

    g2, ins2 = ir.Graph(), {}
    p = fp8_input(g2, "p", (heads, S, S), fmt, 5, rng, ins2)
    qkv2 = fp8_input(g2, "qkv", (S, 3 * D), fmt, -1, rng, ins2)
    ctx = g2.add("attention_context", [p, qkv2], name="ctx", heads=heads)
    assert g2.values[ctx].shape == (S, D)
    got = run(g2, ins2)
    P = dec64(ins2[p], fmt, 5)
    V = dec64(ins2[qkv2], fmt, -1)[:, 2 * D:].reshape(S, heads, dh)
    close(got, np.einsum("hst,thd->shd", P, V).reshape(S, D))


# inference errors --------------------------------------------------------------------------------
def _g():
    g = ir.Graph()
    return g, g.input("x", (4, 8)), g.input("y", (6, 8)), g.input("m", (8, 16))


BAD = {
    "matmul_k": lambda g, x, y, m: g.add("matmul", [x, y], name="bad_mm"),
    "matmul_bias": lambda g, x, y, m: g.add("matmul", [x, m, g.input("bb", (8,))], name="bad_mm"),
    "matmul_dtypes": lambda g, x, y, m: g.add(
        "matmul", [x, g.add("cast", [m], name="c8", to="f143")], name="bad_mm"),
    "add_shapes": lambda g, x, y, m: g.add("add", [x, y], name="bad_add"),
    "add_dtype": lambda g, x, y, m: g.add("add", [x, g.add("cast", [x], name="c8", to="f16")], name="bad_add"),
    "layernorm_gamma": lambda g, x, y, m: g.add("layernorm", [x, g.input("ga", (4,)), g.input("be", (8,))],
                                                name="bad_ln", eps=1e-5),
    "cast_pair": lambda g, x, y, m: g.add("cast", [g.add("cast", [x], name="c8", to="f143")], name="bad_cast",
                                          to="f16"),
    "patchify": lambda g, x, y, m: g.add("patchify", [x], name="bad_pf", patch=3, channels=1),
    "concat": lambda g, x, y, m: g.add("concat_rows", [x, m], name="bad_cat"),
    "slice": lambda g, x, y, m: g.add("slice_rows", [x], name="bad_sl", start=2, end=9),
    "scores_heads": lambda g, x, y, m: g.add("attention_scores", [m], name="bad_sc", heads=3),
    "context_p": lambda g, x, y, m: g.add("attention_context", [x, g.input("q", (4, 12))], name="bad_ctx",
                                          heads=2),
    "softmax_dtype": lambda g, x, y, m: g.add("softmax", [g.add("cast", [x], name="c8", to="f143")],
                                              name="bad_sm"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_inference_errors_name_the_operation(case):
    g, x, y, m = _g()
    with pytest.raises(UserError) as info:
        BAD[case](g, x, y, m)
    msg = str(info.value)
    assert "\n" not in msg
    name = msg.split(":")[0]
    assert name.startswith("operation bad_"), msg
    assert info.value.message
    assert not any(op.name.startswith("bad_") for op in g.ops)   # the bad op was not appended


def test_unknown_operator():
    g, x, y, m = _g()
    with pytest.raises(UserError) as info:
        g.add("nope", [x])
    assert "nope" in str(info.value) and "unknown operator" in str(info.value)
    assert "matmul" in str(info.value)        # lists the known ones
    assert not g.ops


def test_attention_context_rejects_qkv_width_not_divisible_by_heads():
    g = ir.Graph()
    qkv = g.input("qkv", (4, 9))      # D = 3, not divisible by 2 heads
    p = g.input("p", (2, 4, 4))
    with pytest.raises(UserError, match="ctx"):
        g.add("attention_context", [p, qkv], name="ctx", heads=2)


# lowering under every plan -----------------------------------------------------------------------
def _case_graphs():
    """(name, graph) pairs, each with one operation of interest as the last op."""
    out = []

    def new():
        return ir.Graph()

    g = new(); x = g.input("x", (13, 10)); g.add("cast", [x], to="f143", scale_exp=1); out.append(("cast", g))
    g = new(); x = g.input("x", (13, 10)); b = g.constant("b", (10,)); g.add("add", [x, b]); out.append(("add_bcast", g))
    g = new(); x = g.input("x", (3, 5, 4)); b = g.input("b", (3, 5, 4)); g.add("add", [x, b]); out.append(("add", g))
    g = new(); x = g.input("x", (9, 8)); g.add("layernorm", [x, g.constant("g", (8,)), g.constant("b", (8,))],
                                               eps=1e-6); out.append(("layernorm", g))
    g = new(); x = g.input("x", (2, 7, 7)); g.add("softmax", [x], scale=0.5); out.append(("softmax", g))
    g = new(); x = g.input("x", (11, 3)); g.add("gelu", [x]); out.append(("gelu", g))
    g = new(); x = g.input("x", (12, 18)); g.add("patchify", [x], patch=3, channels=2); out.append(("patchify", g))
    g = new(); a = g.constant("a", (1, 6)); b = g.input("b", (9, 6)); g.add("concat_rows", [a, b]); out.append(("concat", g))
    g = new(); x = g.input("x", (9, 6)); g.add("slice_rows", [x], start=2, end=7); out.append(("slice", g))
    g = new(); a = g.input("a", (19, 48)); b = g.constant("w", (48, 21)); g.add("matmul", [a, b, g.constant("bias", (21,))])
    out.append(("matmul_bias", g))
    g = new(); a = g.input("a", (5, 130)); b = g.input("w", (130, 3)); g.add("matmul", [a, b]); out.append(("matmul", g))
    g = new(); q = g.input("qkv", (10, 18)); g.add("attention_scores", [q], heads=3); out.append(("scores", g))
    g = new(); q = g.input("qkv", (10, 18)); p = g.input("p", (3, 10, 10))
    g.add("attention_context", [p, q], heads=3); out.append(("context", g))
    return out


CASES = _case_graphs()
TILE_COUNTS = [3, 8, 64]


def _dims(g, lowering, vk):
    if vk.startswith("v"):
        v = g.values[int(vk[1:])]
        return v.rows, v.cols
    rows, cols, _ = lowering.temps[vk]
    return rows, cols


def _check_in_range(g, lowering, blk):
    vk, r0, r1, c0, c1 = blk
    rows, cols = _dims(g, lowering, vk)
    assert 0 <= r0 < r1 <= rows and 0 <= c0 < c1 <= cols, (blk, rows, cols)


@pytest.mark.parametrize("tiles", TILE_COUNTS)
@pytest.mark.parametrize("name,g", CASES, ids=[c[0] for c in CASES])
def test_every_plan_writes_each_output_element_exactly_once(name, g, tiles):
    op = g.ops[-1]
    impl = registry().get(op.type)
    plans = impl.plans(g, op, tiles)
    assert plans, f"{name}: no plans for {tiles} tiles"
    for plan in plans:
        low = impl.lower(g, op, plan)
        assert low.stages
        used = set()
        for stage in low.stages:
            for work in stage:
                used.add(work.tile)
                for blk in work.reads + work.writes:
                    _check_in_range(g, low, blk)
                for _kernel, args in work.vertices:
                    for a in args:
                        if isinstance(a, tuple):
                            kind, i, off = a
                            blocks = work.reads if kind == "r" else work.writes
                            assert 0 <= i < len(blocks)
                            vk, r0, r1, c0, c1 = blocks[i]
                            isz = g.values[int(vk[1:])].itemsize if vk.startswith("v") else 4
                            assert 0 <= off < (r1 - r0) * (c1 - c0) * isz
        assert min(used) >= 0
        if op.type not in ("attention_scores", "attention_context") or tiles >= op.attrs["heads"]:
            assert max(used) < tiles, (name, plan)
        # final stage: every element of every graph value it writes exactly once
        for vid in op.outputs:
            v = g.values[vid]
            count = np.zeros((v.rows, v.cols), int)
            for work in low.stages[-1]:
                for vk, r0, r1, c0, c1 in work.writes:
                    if vk == f"v{vid}":
                        count[r0:r1, c0:c1] += 1
            assert np.all(count == 1), (name, plan)
        # and every temporary is written exactly once by some stage
        for tk, (rows, cols, _) in low.temps.items():
            count = np.zeros((rows, cols), int)
            for stage in low.stages:
                for work in stage:
                    for vk, r0, r1, c0, c1 in work.writes:
                        if vk == tk:
                            count[r0:r1, c0:c1] += 1
            assert np.all(count == 1), (name, plan, tk)


@pytest.mark.parametrize("tiles", [4, 16, 64])
@pytest.mark.parametrize("name", ["matmul_bias", "matmul"])
def test_matmul_stage1_reads_cover_a_and_b(name, tiles):
    g = dict(CASES)[name]
    op = g.ops[-1]
    impl = registry().get("matmul")
    a, b = (g.values[i] for i in op.inputs[:2])
    plans = impl.plans(g, op, tiles)
    assert plans
    assert len({tuple(sorted(p.items())) for p in plans}) == len(plans)       # no duplicates
    for plan in plans:
        assert plan["m"] * plan["n"] * plan["k"] <= tiles
        low = impl.lower(g, op, plan)
        stage1 = low.stages[0]
        assert len({w.tile for w in stage1}) == len(stage1)
        ca, cb = np.zeros((a.rows, a.cols), int), np.zeros((b.rows, b.cols), int)
        cbias = np.zeros(b.cols, int)
        for work in stage1:
            for vk, r0, r1, c0, c1 in work.reads:
                if vk == f"v{a.id}":
                    ca[r0:r1, c0:c1] += 1
                elif vk == f"v{b.id}":
                    cb[r0:r1, c0:c1] += 1
                else:
                    assert len(op.inputs) == 3 and vk == f"v{op.inputs[2]}"
                    cbias[c0:c1] += 1
        n_cols = len(split(b.cols, plan["n"]))
        n_rows = len(split(a.rows, plan["m"]))
        assert np.all(ca == n_cols), plan       # each A element once per column block
        assert np.all(cb == n_rows), plan       # each B element once per row block
        if len(op.inputs) == 3:
            assert np.all(cbias == n_rows), plan  # bias added once per output block
        assert len(low.stages) == (1 if plan["k"] == 1 else 2)


def test_matmul_with_small_k_has_a_plan():
    from ipubuild.compiler.planning.program import build_program, default_layout
    g = ir.Graph()
    a = g.input("a", (4, 8))
    w = g.constant("w", (8, 4))
    g.outputs = [g.add("matmul", [a, w], name="small")]
    assert registry().get("matmul").plans(g, g.ops[0], 64)
    build_program(g, default_layout(g, 64), 64)


# following a producer's blocks ---------------------------------------------------------------------
def _chain(follower, *, shape=(13, 24), heads=None):
    """x[13, 10] @ w[10, cols] (a matmul with many plans), then ``follower`` on its output."""
    from ipubuild.compiler.planning.program import PlanResolver
    g = ir.Graph()
    x = g.input("x", (shape[0], 10))
    y = g.add("matmul", [x, g.constant("w", (10, shape[1]))], name="mm")
    z = follower(g, y)
    g.outputs = [z]
    return g, PlanResolver(g, 16)


def _follow_choices(res, op):
    return [i for i, p in enumerate(res.plans[op.id]) if "follow" in p]


FOLLOWERS = {
    "cast": lambda g, y: g.add("cast", [y], to="f143", scale_exp=2),
    "gelu": lambda g, y: g.add("gelu", [y]),
    "add": lambda g, y: g.add("add", [y, g.add("gelu", [y])]),
    "add_bias": lambda g, y: g.add("add", [y, g.constant("b", (24,))]),
}


@pytest.mark.parametrize("name", sorted(FOLLOWERS))
def test_an_elementwise_follower_takes_its_producers_blocks_under_every_plan(name):
    g, res = _chain(FOLLOWERS[name])
    mm, op = g.ops[0], g.ops[-1]
    follow = _follow_choices(res, op)
    assert follow, name
    y = f"v{mm.outputs[0]}"
    for p in range(len(res.plans[mm.id])):
        prod = {(w.tile, b) for st in res.lowering(mm, (p,)).stages[-1:] for w in st for b in w.writes}
        for f in follow:
            if res.plans[op.id][f]["follow"] != op.inputs.index(mm.outputs[0]):
                continue
            low = res.lowering(op, (f, (p,)))
            reads = {(w.tile, b) for w in low.stages[0] for b in w.reads if b[0] == y}
            assert reads == prod, (name, res.plans[mm.id][p])          # every block read where it was written
            out = g.values[op.outputs[0]]
            count = np.zeros((out.rows, out.cols), int)
            for w in low.stages[-1]:
                for vk, r0, r1, c0, c1 in w.writes:
                    count[r0:r1, c0:c1] += 1
            assert np.all(count == 1), (name, res.plans[mm.id][p])


def test_a_rowwise_follower_needs_whole_rows():
    from ipubuild.compiler.planning.program import build_program
    g, res = _chain(lambda g, y: g.add("layernorm", [y, g.constant("g", (24,)), g.constant("b", (24,))], eps=1e-6))
    mm, ln = g.ops
    (f,) = _follow_choices(res, ln)
    whole = next(i for i, p in enumerate(res.plans[mm.id]) if p["n"] == 1 and p["k"] == 1 and p["m"] > 1)
    split_cols = next(i for i, p in enumerate(res.plans[mm.id]) if p["n"] > 1)
    low = res.lowering(ln, (f, (whole,)))
    assert sorted(w.tile for w in low.stages[0]) == sorted(w.tile for w in res.lowering(mm, (whole,)).stages[0])
    with pytest.raises(ValueError, match="whole rows"):
        res.lowering(ln, (f, (split_cols,)))
    layout = {"ops": {"0": {"plan": split_cols, "offset": 0}, "1": {"plan": f, "offset": 0}}}
    with pytest.raises(UserError, match=r"^layout of operation layernorm_1: its plan cannot follow its producer: "
                                        r"its producer splits columns and it needs whole rows$"):
        build_program(g, layout, 16)


def test_a_follower_exchanges_nothing_and_moves_with_its_producer():
    from ipubuild.compiler.planning.program import build_program, vertices_of
    g, res = _chain(lambda g, y: g.add("cast", [g.add("gelu", [y])], to="f143", scale_exp=0))
    mm, gelu, cast = g.ops
    for p in range(0, len(res.plans[mm.id]), 5):
        layout = {"ops": {"0": {"plan": p, "offset": 3}, "1": {"plan": _follow_choices(res, gelu)[0], "offset": 0},
                          "2": {"plan": _follow_choices(res, cast)[0], "offset": 9}}}
        prog = build_program(g, layout, 16)
        steps = {s["name"]: s for s in prog["steps"]}
        assert not len(steps["gelu_1"]["transfers"]) and not len(steps["cast_2"]["transfers"])
        assert set(vertices_of(prog, steps["gelu_1"])) == set(vertices_of(prog, steps["cast_2"])) <= \
            {str(t) for s in prog["steps"] if s["op"] == 0 for t in vertices_of(prog, s)}


@pytest.mark.parametrize("heads", [1, 3])
def test_attention_follows_the_tiles_of_its_heads(heads):
    """scores follow qkv: each head's rows on the tiles that computed its Q, K or V columns;
    context follows the probabilities row for row (or qkv like scores)."""
    from ipubuild.compiler.planning.program import PlanResolver
    g = ir.Graph()
    x = g.input("x", (10, 12))
    qkv = g.add("matmul", [x, g.constant("w", (12, 18))], name="qkv")
    scores = g.add("attention_scores", [qkv], heads=heads)
    probs = g.add("softmax", [scores], scale=0.5)
    ctx = g.add("attention_context", [probs, qkv], heads=heads)
    g.outputs = [ctx]
    res = PlanResolver(g, 16)
    mm, sc, sm, cx = g.ops
    d, dh = 6, 6 // heads
    (fs,) = _follow_choices(res, sc)
    fsm = _follow_choices(res, sm)[0]
    for p in range(len(res.plans[mm.id])):
        qkv_blocks = [(w.tile, *b[1:]) for w in res.lowering(mm, (p,)).stages[-1] for b in w.writes]
        low = res.lowering(sc, (fs, (p,)))
        count = np.zeros((heads * 10, 10), int)
        for w in low.stages[0]:
            (_, r0, r1, _, _), = w.writes
            count[r0:r1] += 1
            h = r0 // 10
            cols = [(base + h * dh, base + (h + 1) * dh) for base in (0, d, 2 * d)]
            assert any(t == w.tile and any(c0 < b and a < c1 for a, b in cols) for t, _, _, c0, c1 in qkv_blocks)
        assert np.all(count == 1), res.plans[mm.id][p]
        for f in _follow_choices(res, cx):
            pos = res.plans[cx.id][f]["follow"]
            choice = (f, (fsm, (fs, (p,)))) if pos == 0 else (f, (p,))
            low = res.lowering(cx, choice)
            out = np.zeros((10, d), int)
            for w in low.stages[0]:
                (_, r0, r1, c0, c1), = w.writes
                out[r0:r1, c0:c1] += 1
            assert np.all(out == 1)
            if pos == 0:    # each probability row read on the tile that computed it
                probs_blocks = {(w.tile, *b) for w in res.lowering(sm, (fsm, (fs, (p,)))).stages[0] for b in w.writes}
                for w in low.stages[0]:
                    vk, r0, r1, c0, c1 = w.reads[0]
                    assert any(t == w.tile and b[1] <= r0 and r1 <= b[2] for t, *b in probs_blocks)
