"""The ONNX front end: models built with onnx.helper imported and compared with the built-in
ViT on the same weights, with onnx's reference evaluator and onnxruntime; the decomposed forms
exporters emit; external data; the one-line errors; and, in whole builds, the shipped ONNX target
and a weights-only change that re-runs no planning phase."""
from __future__ import annotations

import math
import shutil
from pathlib import Path

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
from onnx import TensorProto, helper, numpy_helper  # noqa: E402

from ipubuild.errors import UserError  # noqa: E402
from ipubuild.graph.onnx_import import declared_sources, import_model  # noqa: E402
from ipubuild.plugins import get_plugin_manager  # noqa: E402
from ipubuild.graph.reference import evaluate  # noqa: E402

import buildtree  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
SMALL = {"image_size": 32, "channels": 3, "patch": 16, "width": 32, "heads": 2, "mlp": 64, "blocks": 2, "classes": 5}


def _import(model, **kw):
    data = model if isinstance(model, bytes) else model.SerializeToString()
    kw.setdefault("batch", None)
    kw.setdefault("seed", 0)
    return import_model(get_plugin_manager(), data, kw.pop("external", {}), "models/x.onnx", **kw)


def _outputs(m):
    out = evaluate(m.graph, m.constants, m.inputs)
    return {m.graph.values[v].name: a for v, a in out.items()}


def test_the_importer_gives_the_built_in_vit_on_the_same_weights():
    """timm's exported form (Conv, shape arithmetic, LayerNormalization, Split heads, Erf-GELU,
    Gather, Gemm) becomes the built-in ViT's graph: the same operators, bit-identical outputs."""
    from ipubuild.builtin.vit import build_vit
    from ipubuild.builtin.onnx_vit import vit_onnx, vit_weights
    _, image = vit_weights(SMALL, 4)
    m = _import(vit_onnx(SMALL, 4), input_array=image)
    b = build_vit(SMALL, 4)
    assert [op.type for op in m.graph.ops] == [op.type for op in b.graph.ops]
    assert [op.attrs.get("heads") for op in m.graph.ops] == [op.attrs.get("heads") for op in b.graph.ops]
    got, want = _outputs(m), _outputs(b)
    for name in ("features", "logits"):
        np.testing.assert_array_equal(got[name].reshape(want[name].shape), want[name])


def test_the_importer_agrees_with_onnx_s_reference_evaluator():
    """The same model run by onnx.reference (float64-ish numpy, exact erf): within what the tanh
    form of GELU differs by (ipubuild's gelu kernel is the tanh form)."""
    from onnx.reference import ReferenceEvaluator

    from ipubuild.builtin.onnx_vit import vit_onnx
    model = vit_onnx(SMALL, 1)
    m = _import(model, seed=7)
    x = np.random.default_rng(7).standard_normal((1, 3, 32, 32)).astype(np.float32)
    want = dict(zip(["features", "logits"], ReferenceEvaluator(model).run(None, {"image": x})))
    got = _outputs(m)
    for name, w in want.items():
        np.testing.assert_allclose(got[name].reshape(w.shape), w, atol=3e-3, rtol=1e-3)


def test_the_shipped_model_is_what_its_script_generates():
    from ipubuild.builtin.onnx_vit import PARAMS, vit_onnx
    assert (ROOT / "targets" / "models" / "vit_onnx.onnx").read_bytes() == vit_onnx(PARAMS, 0).SerializeToString()


def _decomposed(d=8, classes=3, opset=13):
    """Conv patch embedding, a ReduceMean/Sub/Pow/Sqrt/Div layer norm, MatMul+Add, the tanh GELU
    (Pow/Mul/Add/Tanh), a class-token Slice and a Gemm without transB; Dropout and Identity."""
    rng = np.random.default_rng(0)
    w = {"k": rng.standard_normal((d, 3, 16, 16)).astype(np.float32) * 0.05,
         "kb": rng.standard_normal(d).astype(np.float32) * 0.1,
         "g": (1 + 0.1 * rng.standard_normal(d)).astype(np.float32), "b": rng.standard_normal(d).astype(np.float32) * 0.1,
         "w1": rng.standard_normal((d, d)).astype(np.float32) * 0.3, "b1": rng.standard_normal(d).astype(np.float32) * 0.1,
         "wh": rng.standard_normal((d, classes)).astype(np.float32) * 0.3, "bh": np.zeros(classes, np.float32)}
    c = {"two": np.float32(2), "eps": np.float32(1e-5), "three": np.float32(3), "c1": np.float32(0.044715),
         "c2": np.float32(math.sqrt(2 / math.pi)), "one": np.float32(1), "half": np.float32(0.5),
         "shape3": np.array([1, d, -1], np.int64), "s0": np.array([0], np.int64), "s1": np.array([1], np.int64),
         "ax1": np.array([1], np.int64), "flat": np.array([1, d], np.int64)}
    mk = helper.make_node
    nodes = [mk("Conv", ["image", "k", "kb"], ["pe"], name="/pe/Conv", kernel_shape=[16, 16], strides=[16, 16]),
             mk("Reshape", ["pe", "shape3"], ["pe2"], name="/pe/Reshape"),
             mk("Transpose", ["pe2"], ["x"], name="/pe/Transpose", perm=[0, 2, 1]),
             mk("Dropout", ["x"], ["xd"], name="/drop"),
             mk("ReduceMean", ["xd"], ["mu"], name="/ln/ReduceMean", axes=[-1]),
             mk("Sub", ["xd", "mu"], ["xc"], name="/ln/Sub"),
             mk("Pow", ["xc", "two"], ["sq"], name="/ln/Pow"),
             mk("ReduceMean", ["sq"], ["var"], name="/ln/ReduceMean_1", axes=[-1]),
             mk("Add", ["var", "eps"], ["ve"], name="/ln/Add"),
             mk("Sqrt", ["ve"], ["sd"], name="/ln/Sqrt"),
             mk("Div", ["xc", "sd"], ["xn"], name="/ln/Div"),
             mk("Mul", ["xn", "g"], ["xg"], name="/ln/Mul"),
             mk("Add", ["xg", "b"], ["ln"], name="/ln/Add_1"),
             mk("MatMul", ["ln", "w1"], ["h0"], name="/fc/MatMul"),
             mk("Add", ["h0", "b1"], ["h"], name="/fc/Add"),
             mk("Pow", ["h", "three"], ["h3"], name="/act/Pow"),
             mk("Mul", ["h3", "c1"], ["h3c"], name="/act/Mul"),
             mk("Add", ["h", "h3c"], ["inner"], name="/act/Add"),
             mk("Mul", ["inner", "c2"], ["arg"], name="/act/Mul_1"),
             mk("Tanh", ["arg"], ["t"], name="/act/Tanh"),
             mk("Add", ["t", "one"], ["t1"], name="/act/Add_1"),
             mk("Mul", ["h", "half"], ["hh"], name="/act/Mul_2"),
             mk("Mul", ["hh", "t1"], ["y"], name="/act/Mul_3"),
             mk("Identity", ["y"], ["yi"], name="/Identity"),
             mk("Slice", ["yi", "s0", "s1", "ax1"], ["cls"], name="/Slice"),
             mk("Reshape", ["cls", "flat"], ["cls2"], name="/Reshape"),
             mk("Gemm", ["cls2", "wh", "bh"], ["logits"], name="/head/Gemm")]
    inits = [numpy_helper.from_array(np.asarray(v), k) for k, v in {**w, **c}.items()]
    g = helper.make_graph(nodes, "decomposed", [helper.make_tensor_value_info("image", TensorProto.FLOAT, [1, 3, 32, 32])],
                          [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1, classes])], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)], ir_version=8)


def test_decomposed_layer_norm_tanh_gelu_slice_and_gemm():
    from onnx.reference import ReferenceEvaluator
    model = _decomposed()
    m = _import(model, seed=3)
    assert [op.type for op in m.graph.ops] == ["patchify", "matmul", "layernorm", "matmul", "gelu", "slice_rows",
                                              "matmul"]
    assert [op.name for op in m.graph.ops][2] == "/ln/Add_1"
    x = np.random.default_rng(3).standard_normal((1, 3, 32, 32)).astype(np.float32)
    want = ReferenceEvaluator(model).run(None, {"image": x})[0]
    np.testing.assert_allclose(_outputs(m)["logits"].reshape(want.shape), want, atol=1e-4, rtol=1e-4)


def test_external_data_is_read_from_its_file(tmp_path):
    from ipubuild.builtin.onnx_vit import vit_onnx
    model = vit_onnx(SMALL, 2)
    embedded = _outputs(_import(model, seed=1))
    onnx.save_model(model, tmp_path / "vit.onnx", save_as_external_data=True, location="vit.weights",
                    size_threshold=0)
    target = {"path": str(tmp_path / "t.toml"), "model": {"family": "onnx", "file": "vit.onnx"}}
    sources = declared_sources(target, tmp_path)
    assert sorted(sources) == ["model/data/vit.weights", "model/file"]
    data = (tmp_path / "vit.onnx").read_bytes()
    assert len(data) < 100_000
    got = _outputs(_import(data, seed=1, external={"vit.weights": (tmp_path / "vit.weights").read_bytes()}))
    for k in embedded:
        np.testing.assert_array_equal(got[k], embedded[k])
    with pytest.raises(UserError, match="external data file 'vit.weights' is missing"):
        _import(data, seed=1)


def _odd(op="Frobnicate", domain="com.example"):
    x = helper.make_tensor_value_info("image", TensorProto.FLOAT, [1, 3, 32, 32])
    y = helper.make_tensor_value_info("out", TensorProto.FLOAT, [1, 3, 32, 32])
    n = helper.make_node(op, ["image"], ["out"], name="/blocks.0/attn/Foo", domain=domain)
    imports = [helper.make_opsetid("", 17)] + ([helper.make_opsetid(domain, 1)] if domain else [])
    return helper.make_model(helper.make_graph([n], "odd", [x], [y]), opset_imports=imports, ir_version=8)


def test_an_op_nobody_converts_is_one_line_naming_the_node():
    with pytest.raises(UserError) as e:
        _import(_odd("Foo", ""))
    assert str(e.value) == ("models/x.onnx: node /blocks.0/attn/Foo (op Foo, opset 17) has no converter; a plugin "
                            "can add one with ipubuild_onnx_converters (docs/plugins.md)")
    with pytest.raises(UserError, match=r"node /blocks.0/attn/Foo \(op com.example:Frobnicate, opset 1\) has no "
                                        "converter"):
        _import(_odd())


def test_a_form_ipubuild_has_no_operator_for_names_the_node():
    model = _decomposed()
    model.graph.node[1].input[1] = "flat"      # reshape the patch embedding to [1, D]: a lost axis
    with pytest.raises(UserError, match=r"^models/x.onnx: node /pe/Reshape \(op Reshape, opset 13\): "):
        _import(model)


def test_the_batch_comes_from_the_model_or_the_target():
    from ipubuild.builtin.onnx_vit import vit_onnx
    model = vit_onnx(SMALL, 0)          # a symbolic batch: model.batch = 1 by default
    assert _import(model).graph.values[0].shape == (32, 96)
    with pytest.raises(UserError, match="the batch is 2: ipubuild's operators take one image at a time"):
        _import(model, batch=2)
    fixed = _odd("Foo", "")
    with pytest.raises(UserError, match="has batch 1, not model.batch 3"):
        _import(fixed, batch=3)


def test_bound_program_equals_the_program_of_the_real_graph():
    """Planning on the plan graph (no scales) and binding the scales gives the program the real
    graph would have planned: what keeps vit_fp8's package byte-identical."""
    from ipubuild.frontend import build_model
    from ipubuild.compiler.planning.program import build_program, default_layout, program_blob
    from ipubuild.targets import load_target
    from ipubuild.compiler.weights import bind, plan_graph
    target = load_target("targets/vit_fp8.toml", root=ROOT)
    target["model"].update(image_size=32, width=32, heads=2, mlp=64, classes=5)
    g = build_model(get_plugin_manager(), target).graph
    assert any(v.scale_exp for v in g.values.values())
    layout = default_layout(g, 16)
    planned = build_program(plan_graph(g), layout, 16)
    real = build_program(g, layout, 16)
    assert program_blob(planned) != program_blob(real)
    assert program_blob(bind(planned, g, layout, 16)) == program_blob(real)


@pytest.mark.filterwarnings("ignore::DeprecationWarning")      # torch: the TorchScript exporter is legacy
def test_a_vit_exported_by_torch_imports_and_agrees_with_onnxruntime(tmp_path):
    """torch.onnx.export (TorchScript exporter, opset 17, symbolic batch) of a ViT written as
    timm writes it — Conv patch embedding, qkv reshape/permute/unbind, q·scale, softmax, nn.GELU
    (Erf), LayerNorm, x[:, 0], Linear head: the node types of the issue's list (Shape, Gather,
    ConstantOfShape, Equal, Where, Expand, …)."""
    torch = pytest.importorskip("torch")
    ort = pytest.importorskip("onnxruntime")
    nn = torch.nn

    class Attention(nn.Module):
        def __init__(self, d, h):
            super().__init__()
            self.h, self.dh = h, d // h
            self.scale = self.dh ** -0.5
            self.qkv, self.proj, self.attn_drop = nn.Linear(d, 3 * d), nn.Linear(d, d), nn.Dropout(0.1)

        def forward(self, x):
            b, n, c = x.shape
            q, k, v = self.qkv(x).reshape(b, n, 3, self.h, self.dh).permute(2, 0, 3, 1, 4).unbind(0)
            a = self.attn_drop((q * self.scale @ k.transpose(-2, -1)).softmax(dim=-1))
            return self.proj((a @ v).transpose(1, 2).reshape(b, n, c))

    class Block(nn.Module):
        def __init__(self, d, h, m):
            super().__init__()
            self.norm1, self.attn, self.norm2 = nn.LayerNorm(d, eps=1e-6), Attention(d, h), nn.LayerNorm(d, eps=1e-6)
            self.mlp = nn.Sequential(nn.Linear(d, m), nn.GELU(), nn.Linear(m, d))

        def forward(self, x):
            x = x + self.attn(self.norm1(x))
            return x + self.mlp(self.norm2(x))

    class ViT(nn.Module):
        def __init__(self, img=64, p=16, d=64, h=2, m=128, n=2, classes=10):
            super().__init__()
            self.patch_embed = nn.Conv2d(3, d, p, p)
            self.cls_token = nn.Parameter(torch.randn(1, 1, d) * 0.02)
            self.pos_embed = nn.Parameter(torch.randn(1, (img // p) ** 2 + 1, d) * 0.02)
            self.blocks = nn.Sequential(*[Block(d, h, m) for _ in range(n)])
            self.norm, self.head = nn.LayerNorm(d, eps=1e-6), nn.Linear(d, classes)

        def forward(self, x):
            x = self.patch_embed(x).flatten(2).transpose(1, 2)
            x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1) + self.pos_embed
            return self.head(self.norm(self.blocks(x))[:, 0])

    torch.manual_seed(0)
    model = ViT().eval()
    path = tmp_path / "vit.onnx"
    with torch.no_grad():
        torch.onnx.export(model, (torch.randn(1, 3, 64, 64),), str(path), opset_version=17, input_names=["image"],
                          output_names=["logits"], dynamic_axes={"image": {0: "batch"}, "logits": {0: "batch"}},
                          dynamo=False)
    data = path.read_bytes()
    m = _import(data, seed=2)
    assert [op.type for op in m.graph.ops][:11] == ["patchify", "matmul", "concat_rows", "add", "layernorm", "matmul",
                                                   "attention_scores", "softmax", "attention_context", "matmul", "add"]
    x = np.random.default_rng(2).standard_normal((1, 3, 64, 64)).astype(np.float32)
    want = ort.InferenceSession(data, providers=["CPUExecutionProvider"]).run(None, {"image": x})[0]
    np.testing.assert_allclose(_outputs(m)["logits"].reshape(want.shape), want, atol=2e-3)


# whole builds -----------------------------------------------------------------------------------
def _tree(tmp_path, targets=("vit_onnx",)) -> Path:
    tree = buildtree.make_tree(tmp_path / "tree", {t: (ROOT / "targets" / f"{t}.toml").read_text() for t in targets})
    (tree / "targets" / "models").mkdir()
    shutil.copyfile(ROOT / "targets" / "models" / "vit_onnx.onnx", tree / "targets" / "models" / "vit_onnx.onnx")
    return tree


def _scale_weights(path: Path, factor: float) -> None:
    m = onnx.load(str(path))
    for init in m.graph.initializer:
        a = numpy_helper.to_array(init)
        if a.dtype == np.float32 and a.size > 1:
            init.CopyFrom(numpy_helper.from_array((a * np.float32(factor)).astype(np.float32), init.name))
    onnx.save(m, str(path))


PLANNING = {"plan_package", "place_provisional_storage", "schedule_provisional_exchanges", "plan_kernels",
            "place_storage", "lower_exchanges", "optimize_exchange_placement", "compile_kernels", "link_runtime",
            "size_tile_code", "compile_runtime", "compile_kernels_counted"}


@pytest.mark.slow
def test_the_onnx_target_builds_and_new_weights_re_plan_nothing(tmp_path):
    """The shipped target builds to PASS with onnxruntime's figures; new weights in the same
    graph (×1.01: scales stay; ×2: every FP8 scale moves) re-run no planning phase, only what
    reads values; a no-op runs nothing."""
    environ = buildtree.snapshot(tmp_path)
    tree = _tree(tmp_path)
    run = buildtree.doit(tree, "build:vit_onnx", environ=environ)
    buildtree.assert_passed(run, "vit_onnx")
    assert "deviceTest=PASS" in run.stdout
    ort = pytest.importorskip("onnxruntime")
    assert ort and "onnxruntimeMinimumCosineSimilarity=0.99" in run.stdout, run.tail()
    first = buildtree.package(tree, "vit_onnx")
    again = buildtree.doit(tree, "build:vit_onnx", environ=environ)
    assert again.returncode == 0 and again.executed == [], again.tail()
    model = tree / "targets" / "models" / "vit_onnx.onnx"
    for factor, moved in ((1.01, False), (2.0, True)):
        _scale_weights(model, factor)
        run = buildtree.doit(tree, "build:vit_onnx", environ=environ)
        buildtree.assert_passed(run, "vit_onnx")
        ran = {t.split(":")[0] for t in run.executed}
        assert "lower_model" in ran and "write_package" in ran, run.tail()
        assert not ran & PLANNING, f"a weights-only change re-ran {sorted(ran & PLANNING)}"
        assert ("bind_values" in ran) == moved, run.tail()
    assert buildtree.package(tree, "vit_onnx") != first


@pytest.mark.slow
def test_another_seed_of_the_built_in_vit_re_plans_nothing(tmp_path):
    environ = buildtree.snapshot(tmp_path)
    tree = buildtree.make_tree(tmp_path / "tree")
    buildtree.assert_passed(buildtree.doit(tree, "build:small", environ=environ), "small")
    toml = tree / "targets" / "small.toml"
    toml.write_text(toml.read_text().replace("[target]\n", "[target]\nseed = 5\n"))
    run = buildtree.doit(tree, "build:small", environ=environ)
    buildtree.assert_passed(run, "small")
    ran = {t.split(":")[0] for t in run.executed}
    assert "lower_model" in ran and not ran & PLANNING, run.tail()


def test_an_unknown_op_fails_the_build_in_one_line_and_caches_nothing(tmp_path):
    environ = buildtree.snapshot(tmp_path)
    tree = _tree(tmp_path)
    onnx.save(_odd(), str(tree / "targets" / "odd.onnx"))
    text = (ROOT / "targets" / "vit_onnx.toml").read_text().replace('file = "models/vit_onnx.onnx"', 'file = "odd.onnx"')
    (tree / "targets" / "odd.toml").write_text(text)
    for _ in range(2):
        run = buildtree.doit(tree, "build:odd", environ=environ)
        assert run.returncode != 0 and "Traceback" not in run.output, run.tail()
        assert run.error_lines[-1:] == [
            "error: odd.onnx: node /blocks.0/attn/Foo (op com.example:Frobnicate, opset 1) has no converter; "
            "a plugin can add one with ipubuild_onnx_converters (docs/plugins.md)"], run.tail()
        assert "lower_model:odd" in run.executed      # not a cached result: nothing was recorded


def test_without_onnx_installed_bare_doit_skips_an_onnx_target_and_says_what_to_install(tmp_path):
    """onnx and onnxruntime are an extra: without them an ONNX target is named with the install
    command — skipped by bare ``doit``, one error line when built by name — never a traceback
    from the middle of ``lower_model``."""
    tree = buildtree.make_tree(tmp_path / "tree")
    shutil.copy(ROOT / "targets" / "vit_onnx.toml", tree / "targets")
    shutil.copytree(ROOT / "targets" / "models", tree / "targets" / "models")
    hide = tmp_path / "hide"          # a sitecustomize that makes onnx and onnxruntime unimportable
    hide.mkdir()
    (hide / "sitecustomize.py").write_text(
        "import sys, importlib.machinery as m\n"
        "class Hidden(m.PathFinder):\n"
        "    @classmethod\n"
        "    def find_spec(cls, name, path=None, target=None):\n"
        "        if name.split('.')[0] in ('onnx', 'onnxruntime'):\n"
        "            return None\n"
        "        return super().find_spec(name, path, target)\n"
        "sys.meta_path[:] = [Hidden if f is m.PathFinder else f for f in sys.meta_path]\n")
    environ = buildtree.env(tree)
    environ["PYTHONPATH"] = f"{hide}:{environ['PYTHONPATH']}"
    says = "model.family: the onnx family needs onnx and onnxruntime, which is not installed: pip install -e '.[onnx]'"
    bare = buildtree.doit(tree, environ=environ)
    assert bare.returncode == 0 and "Traceback" not in bare.output, bare.tail()
    assert f"skipped build:vit_onnx: targets/vit_onnx.toml: {says}" in bare.output, bare.tail()
    named = buildtree.doit(tree, "build:vit_onnx", environ=environ)
    assert named.returncode != 0 and named.error_lines == [f"error: targets/vit_onnx.toml: {says} (the onnx extra)"], \
        named.tail()
