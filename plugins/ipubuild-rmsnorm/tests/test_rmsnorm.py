"""The plugin's own tests, written with ``ipubuild.testing``: the operator against an
independent float64 formula, its C kernel compiled as a build compiles it, the graph pass, the
heuristic, and a whole build of the target the plugin ships."""
from __future__ import annotations

import types

import numpy as np
import pytest

from ipubuild import testing
from ipubuild.frontend import Model
from ipubuild.ir import Graph, Op
from ipubuild.search import Changes

from ipubuild_rmsnorm import plugin


def _graph(shape=(5, 7), gamma_shape=None, eps=1e-5, dtype="f32"):
    g = Graph()
    x = g.input("x", shape, dtype)
    gam = g.constant("gamma", gamma_shape or (shape[-1],))
    op = Op(0, "rmsnorm", "norm", [x, gam], [], {} if eps is None else {"eps": eps})
    return g, op


def _independent(x, gamma, eps):
    x64, g64 = x.astype(np.float64), gamma.astype(np.float64)
    return x64 / np.sqrt(np.mean(x64 * x64, axis=-1, keepdims=True) + eps) * g64


# the operator ----------------------------------------------------------------------------------
@pytest.mark.parametrize("shape", [(5, 7), (1, 192), (3, 4, 16), (197, 192)])
def test_reference_matches_independent_float64(shape):
    rng = np.random.default_rng(1)
    g, op = _graph(shape, eps=1e-6)
    x = (3 * rng.standard_normal(shape)).astype(np.float32)
    gamma = (1 + 0.1 * rng.standard_normal(shape[-1])).astype(np.float32)
    assert plugin.RMSNorm().infer(g, op) == [(tuple(shape), "f32", 0)]
    (y,) = plugin.RMSNorm().reference(g, op, [x, gamma])
    assert y.dtype == np.float32 and y.shape == x.shape
    np.testing.assert_allclose(y, _independent(x, gamma, 1e-6), rtol=2e-6, atol=1e-6)


def test_reference_eps_dominates_small_rows():
    g, op = _graph((2, 4), eps=1.0)
    x = np.zeros((2, 4), np.float32)
    x[1] = 1e-4
    (y,) = plugin.RMSNorm().reference(g, op, [x, np.ones(4, np.float32)])
    assert np.all(np.isfinite(y)) and np.all(y[0] == 0)
    np.testing.assert_allclose(y[1], 1e-4 / np.sqrt(1e-8 + 1.0), rtol=1e-6)


@pytest.mark.parametrize("kw, message", [
    ({"gamma_shape": (6,)}, r"gamma of shape \[7\].*got \[6\]"),
    ({"dtype": "f16"}, r"f32 x and gamma, got f16"),
    ({"eps": None}, r"attribute eps, a number > 0, got None"),
    ({"eps": 0.0}, r"attribute eps, a number > 0, got 0.0"),
])
def test_infer_rejects_bad_inputs_with_a_message(kw, message):
    g, op = _graph(**kw)
    with pytest.raises(ValueError, match=message):
        plugin.RMSNorm().infer(g, op)


def test_infer_rejects_wrong_input_count():
    g, op = _graph()
    op.inputs = op.inputs[:1]
    with pytest.raises(ValueError, match="2 inputs"):
        plugin.RMSNorm().infer(g, op)


def test_plans_and_lowering_cover_every_row_once():
    g, op = _graph((197, 192))
    y = g.value("norm", (197, 192), "f32")
    op.outputs = [y]
    rms = plugin.RMSNorm()
    plans = rms.plans(g, op, 64)
    assert plans == [{"rows": r} for r in (64, 32, 16, 8, 4, 2, 1)]   # exactly {"rows": n}: chains align
    for plan in plans:
        (stage,) = rms.lower(g, op, plan).stages
        assert [w.tile for w in stage] == list(range(plan["rows"]))
        covered = []
        for w in stage:
            (xr, gr), (wr,) = w.reads, w.writes
            assert xr[0] == "v0" and gr == ("v1", 0, 1, 0, 192) and wr[0] == f"v{y}"
            assert xr[1:] == wr[1:]
            (name, args), = w.vertices
            assert name == "rmsnorm_f32"
            assert args == [("r", 0, 0), ("r", 1, 0), ("w", 0, 0), xr[2] - xr[1], 192, testing.f32_bits(1e-5)]
            covered.extend(range(xr[1], xr[2]))
        assert covered == list(range(197))


def test_kernel_variant_and_cycle_estimate():
    (kv,) = plugin.RMSNorm().kernels()
    assert kv.name == "rmsnorm_f32" and kv.source == plugin.KERNEL_SOURCE and kv.defines == ()
    machine = {"workers": 6, "compute": {"vertex_overhead_cycles": 40, "vector_flops_per_cycle": 12,
                                         "transcendental_cycles": 4}}
    small, big = kv.cycles([0, 0, 0, 1, 192, 0], machine), kv.cycles([0, 0, 0, 4, 192, 0], machine)
    assert small == 40 + 64 + 1 and big > small


# the C kernel, compiled as a build compiles it ---------------------------------------------------
@pytest.fixture
def kernel():
    return testing.load_variant("rmsnorm_f32")       # by name: the registered operator's variant (compiled once)


# both builds: the plain one (takes unaligned data) and the checked one the device runs
@pytest.mark.parametrize("checked", [False, True])
@pytest.mark.parametrize("rows, cols, offset", [(1, 1, 0), (3, 7, 1), (13, 192, 0), (5, 33, 3)])
def test_kernel_matches_reference(kernel, rows, cols, offset, checked):
    offset = 0 if checked else offset        # the checked build refuses misaligned f32 buffers
    rng = np.random.default_rng(rows * 100 + cols)
    x = (2 * rng.standard_normal((rows, cols))).astype(np.float32)
    gamma = (1 + 0.1 * rng.standard_normal(cols)).astype(np.float32)
    g, op = _graph((rows, cols), eps=1e-6)
    y = g.value("y", (rows, cols), "f32")
    op.outputs = [y]
    (work,), = plugin.RMSNorm().lower(g, op, {"rows": 1}).stages     # the vertex lower gives a tile
    (name, args), = work.vertices
    run = testing.run_vertex(testing.load_variant(name, checked=checked), args, reads=[x, gamma],
                             writes=[((rows, cols), "f32")], offset=offset)
    assert run.status == 0
    (want,) = plugin.RMSNorm().reference(g, op, [x, gamma])
    np.testing.assert_allclose(run.outputs[0], want, rtol=3e-6, atol=1e-6)
    np.testing.assert_allclose(run.outputs[0], _independent(x, gamma, 1e-6), rtol=5e-6, atol=1e-6)


def test_kernel_in_place_and_zero_cols(kernel):
    x = np.arange(1, 13, dtype=np.float32).reshape(3, 4)
    tile = testing.TileMemory()
    ax, ag = tile.put(x), tile.put(np.full(4, 2, np.float32))
    assert kernel(tile, [ax, ag, ax, 3, 4, testing.f32_bits(1e-5)]) == 0
    np.testing.assert_allclose(tile.read(ax, "f32", (3, 4)), _independent(x, np.full(4, 2.0), 1e-5), rtol=3e-6)
    assert kernel(tile, [ax, ag, ax, 3, 0, 0]) == 1


def test_checked_kernel_refuses_a_buffer_outside_the_tile_and_says_why():
    k = testing.load_variant("rmsnorm_f32", checked=True)
    tile = testing.TileMemory()
    ax, ag = tile.put(np.ones((2, 4), np.float32)), tile.put(np.ones(4, np.float32))
    before = tile.mem.copy()
    assert k(tile, [ax, ag, tile.mem.size - 8, 2, 4, testing.f32_bits(1e-5)]) == 3   # y runs off the tile
    assert k.reason() == "y[rows*cols] lies outside the tile's data memory"
    assert k(tile, [ax + 1, ag, ax, 2, 4, testing.f32_bits(1e-5)]) == 4                 # misaligned x
    assert k.reason() == "x[rows*cols] is not aligned to its element size"
    assert k(tile, [ax, ag, ax, 2, 0, 0]) == 1 and k.reason() == "cols is 0"
    assert np.array_equal(tile.mem, before)                                                # nothing touched


# the graph pass ----------------------------------------------------------------------------------
def test_pass_replaces_every_layernorm_and_prune_drops_the_shifts():
    from ipubuild.builtin.vit import build_vit, vit_params
    from ipubuild.passes import prune
    model = build_vit(vit_params({"image_size": 32, "patch": 16, "width": 16, "heads": 2, "mlp": 32,
                                  "classes": 4}, "t.toml"), 0)
    norms = [op.name for op in model.graph.ops if op.type == "layernorm"]
    before = len(model.graph.constants)
    plugin.layernorm_to_rmsnorm(model, {})
    assert [op.name for op in model.graph.ops if op.type == "rmsnorm"] == norms
    assert not any(op.type == "layernorm" for op in model.graph.ops)
    prune(model)
    assert len(model.graph.constants) == before - len(norms)          # one beta each
    assert not any(v.name.endswith(".beta") for v in model.graph.values.values())
    assert sorted(model.constants) == sorted(model.graph.constants)
    model.graph.validate()


def test_pass_is_declared_opt_in_before_casts():
    (p,) = plugin.ipubuild_graph_passes()
    assert (p.name, p.stage, p.default) == ("layernorm_to_rmsnorm", "float", False)


# the heuristic -----------------------------------------------------------------------------------
def test_heuristic_proposes_the_row_count_of_the_operation_that_split_the_rows():
    g = Graph()
    a = g.input("a", (197, 192))
    gam = g.constant("gamma", (192,))
    add = Op(0, "add", "add", [a, a], [g.value("s", (197, 192), "f32")])
    gelu = Op(1, "gelu", "gelu", [add.outputs[0]], [g.value("t", (197, 192), "f32")])
    norm = Op(2, "rmsnorm", "norm", [gelu.outputs[0], gam], [g.value("n", (197, 192), "f32")], {"eps": 1e-6})
    g.ops = [add, gelu, norm]
    rows = [{"rows": r} for r in (64, 32, 16, 8, 4, 2, 1)]
    sc = types.SimpleNamespace(graph=g, plans={0: rows, 1: rows + [{"follow": 0}], 2: rows},
                               producer={v: op for op in g.ops for v in op.outputs})
    layout = {"ops": {"0": {"plan": 2, "offset": 5}, "1": {"plan": 7, "offset": 0}, "2": {"plan": 0, "offset": 0}}}
    (h,) = plugin.ipubuild_search_heuristics()
    assert h.name == "rmsnorm_follow"
    assert h.propose(layout, sc) == [Changes(plans=((2, 2),), boundaries=((2, 5),))]   # through gelu's follow
    assert h.propose(layout, sc) == h.propose(layout, sc)  # deterministic


# the model family and the target it ships --------------------------------------------------------
def test_model_family_hooks():
    assert plugin.ipubuild_model_families() == ["vit_rms"]
    assert plugin.ipubuild_build_model("vit", {}, 0, "t.toml") is None
    model = plugin.ipubuild_build_model("vit_rms", {"image_size": 32, "width": 16, "heads": 2, "mlp": 32}, 0, "t.toml")
    assert isinstance(model, Model) and "rmsnorm" in {op.type for op in model.graph.ops}
    from ipubuild.errors import UserError
    with pytest.raises(UserError, match=r"t.toml: model.width"):
        plugin.ipubuild_build_model("vit_rms", {"width": "wide"}, 0, "t.toml")


def test_the_shipped_target_builds_and_the_heuristic_counts_are_in_the_round_log(tmp_path, capfd):
    assert [p.name for p in plugin.ipubuild_targets()] == ["vit_rms_small.toml"]
    built = testing.build_target("vit_rms_small", tmp_path, overrides={"search": {"rounds": 1}})
    assert built.passed, built.verdict
    log = capfd.readouterr().err
    screened = [ln for ln in log.splitlines() if "screened local search round" in ln]
    counted = [ln for ln in log.splitlines() if "counted local search round by heuristic" in ln]
    assert screened and all('rmsnorm_follow="proposed=' in ln for ln in screened + counted), log[-3000:]
    assert "ran graph pass name=layernorm_to_rmsnorm stage=float" in log
    assert "ipubuild_rmsnorm: proposed rmsnorm moves" in log


# the ONNX converter --------------------------------------------------------------------------------
def test_onnx_simplified_layer_normalization_imports_as_rmsnorm():
    """An ONNX model with onnxruntime's SimplifiedLayerNormalization (what exporters write for an
    RMSNorm) imports through this plugin's converter; the graph computes what onnxruntime does."""
    onnx = pytest.importorskip("onnx")
    from onnx import TensorProto, helper, numpy_helper

    from ipubuild.graph.onnx_import import import_model
    from ipubuild.plugins import get_plugin_manager
    from ipubuild.graph.reference import evaluate
    rng = np.random.default_rng(3)
    scale = (1 + 0.1 * rng.standard_normal(16)).astype(np.float32)
    node = helper.make_node("SimplifiedLayerNormalization", ["x", "scale"], ["y"], name="/norm/rms",
                            axis=-1, epsilon=1e-6)
    graph = helper.make_graph([node], "rms", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8, 16])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 8, 16])],
                              [numpy_helper.from_array(scale, "scale")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    data = model.SerializeToString()
    m = import_model(get_plugin_manager(), data, {}, "models/rms.onnx", batch=None, seed=5)
    assert [(op.type, op.name, op.attrs) for op in m.graph.ops] == [("rmsnorm", "/norm/rms", {"eps": float(np.float32(1e-6))})]
    (x,) = m.inputs.values()
    got = evaluate(m.graph, m.constants, m.inputs)[m.graph.outputs[0]]
    np.testing.assert_allclose(got, _independent(x, scale, 1e-6), rtol=1e-5, atol=1e-6)
    try:
        import onnxruntime as ort
    except ImportError:
        return
    want = ort.InferenceSession(data, providers=["CPUExecutionProvider"]).run(None, {"x": x.reshape(1, 8, 16)})[0]
    np.testing.assert_allclose(got, want.reshape(got.shape), rtol=1e-5, atol=1e-5)
