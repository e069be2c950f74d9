"""The vit_fp8 target's graph (ipubuild/builtin/vit.py, casts.py, frontend.py, reference.py)."""
from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import pytest

from ipubuild.engine import canonical
from ipubuild import fp8, frontend, plugins, targets
from ipubuild.graph import reference
from ipubuild.builtin.vit import build_vit
from ipubuild.errors import UserError
from ipubuild.ir import Graph

ROOT = Path(__file__).resolve().parents[1]
FP8_OPERANDS = {"matmul": (0, 1), "attention_scores": (0,), "attention_context": (0, 1)}


@pytest.fixture(scope="module")
def target():
    """vit_fp8 with every cast a separate operation (``casts.fuse = []``) and its residual adds
    too (no ``fold_adds``): the tests of cast placement check those; the tests of folded
    casts and adds (below) fold them."""
    t = targets.load_target(str(ROOT / "targets" / "vit_fp8.toml"))
    t["casts"]["fuse"] = []
    t["model"]["passes"] = []
    return t


def build(target, mod=None):
    t = copy.deepcopy(target)
    if mod:
        mod(t)
    return frontend.build_model(plugins.get_plugin_manager(), t)


@pytest.fixture(scope="module")
def model(target):
    return build(target)


@pytest.fixture(scope="module")
def raw(target):
    """The float32 model before cast placement."""
    p = {k: v for k, v in target["model"].items() if k != "family"}
    return build_vit(p, target["target"]["seed"])


def by_name(graph, values):
    return {graph.values[k].name: v for k, v in values.items()}


def structure(g: Graph):
    return ([(o.type, o.name, o.inputs, o.outputs, o.attrs) for o in g.ops],
            [(v.id, v.name, v.shape, v.dtype) for v in g.values.values()],
            g.inputs, g.outputs, g.constants)


# the graph ------------------------------------------------------------------------------------
def test_op_count_and_order(model):
    g = model.graph
    assert len(g.ops) == 27
    assert [o.id for o in g.ops] == list(range(27))
    g.validate()
    counts = {}
    for o in g.ops:
        counts[o.type] = counts.get(o.type, 0) + 1
    assert counts == {"patchify": 1, "cast": 8, "matmul": 6, "concat_rows": 1, "add": 3, "layernorm": 3,
                      "attention_scores": 1, "softmax": 1, "attention_context": 1, "gelu": 1,
                      "slice_rows": 1}
    assert len(g.inputs) == 1 and g.values[g.inputs[0]].shape == (224, 672)


def test_casts_are_f143_with_calibrated_scales(model, raw):
    g = model.graph
    casts = [o for o in g.ops if o.type == "cast"]
    assert len(casts) == 8
    calibrated = by_name(raw.graph, reference.evaluate(raw.graph, raw.constants, raw.inputs, keep_all=True))
    producer = g.producer()
    for c in casts:
        src, out = g.values[c.inputs[0]], g.values[c.outputs[0]]
        assert c.attrs["to"] == "f143" and out.dtype == "f143" and src.dtype == "f32"
        assert out.shape == src.shape and out.scale_exp == c.attrs["scale_exp"]
        # placed right after its producer
        assert g.ops[c.id - 1] is producer[src.id]
        # power-of-two scale from the activation's absolute max on the example input
        amax = float(np.abs(calibrated[src.name]).max())
        s = out.scale_exp
        assert amax * 2.0 ** s <= fp8.MAX["f143"] < 2 * amax * 2.0 ** s, (c.name, amax, s)


def test_matmul_like_operands_are_fp8(model):
    g = model.graph
    seen = 0
    for o in g.ops:
        for pos in FP8_OPERANDS.get(o.type, ()):
            seen += 1
            v = g.values[o.inputs[pos]]
            assert v.dtype == "f143", (o.name, pos, v.name, v.dtype)
        if o.type == "matmul":
            bias = g.values[o.inputs[2]]
            assert bias.dtype == "f32" and bias.shape == (g.values[o.inputs[1]].shape[1],)
            assert g.values[o.outputs[0]].dtype == "f32"
    assert seen == 6 * 2 + 1 + 2


def test_fp8_weights_are_stored_as_codes_of_the_f32_weights(model, raw):
    g = model.graph
    raw_by_name = {raw.graph.values[v].name: a for v, a in raw.constants.items()}
    fp8_consts = 0
    for vid in g.constants:
        v, arr = g.values[vid], model.constants[vid]
        assert arr.shape == v.shape
        if v.dtype == "f143":
            fp8_consts += 1
            assert arr.dtype == np.uint8
            w = raw_by_name[v.name]
            amax = float(np.abs(w).max())
            assert amax * 2.0 ** v.scale_exp <= 240 < 2 * amax * 2.0 ** v.scale_exp
            np.testing.assert_array_equal(arr, fp8.encode(w, "f143", v.scale_exp))
            back = fp8.decode(arr, "f143", v.scale_exp)
            assert np.all(np.abs(back - w) <= np.abs(w) / 16 + 2.0 ** (-10 - v.scale_exp))
        else:
            assert v.dtype == "f32" and arr.dtype == np.float32
            np.testing.assert_array_equal(arr, raw_by_name[v.name])
    assert fp8_consts == 6


def test_outputs(model):
    g = model.graph
    outs = [(g.values[v].name, g.values[v].shape, g.values[v].dtype) for v in g.outputs]
    assert outs == [("features", (197, 192), "f32"), ("logits", (1, 1000), "f32")]
    values = reference.evaluate(g, model.constants, model.inputs)
    assert set(values) == set(g.outputs)
    for v in g.outputs:
        assert values[v].shape == g.values[v].shape and values[v].dtype == np.float32
        assert np.all(np.isfinite(values[v]))


# determinism -------------------------------------------------------------------------------------
def _const_bytes(m):
    return {v: a.tobytes() for v, a in sorted(m.constants.items())}


def test_same_seed_same_graph_and_bytes(target, model):
    again = build(target)
    assert again.graph.digest() == model.graph.digest()
    assert again.graph.to_bytes() == model.graph.to_bytes()
    assert _const_bytes(again) == _const_bytes(model)
    assert {k: v.tobytes() for k, v in again.inputs.items()} == {k: v.tobytes() for k, v in model.inputs.items()}


def test_other_seed_other_constants_same_structure(target, model):
    def seed1(t):
        t["target"]["seed"] = 1
    other = build(target, seed1)
    assert structure(other.graph) == structure(model.graph)
    a, b = _const_bytes(model), _const_bytes(other)
    assert a.keys() == b.keys()
    assert all(a[k] != b[k] for k in a)
    img = model.graph.inputs[0]
    assert not np.array_equal(model.inputs[img], other.inputs[img])


def test_graph_json_round_trip(model):
    g = model.graph
    data = g.to_bytes()
    back = Graph.from_json(canonical.loads(data))
    assert back.to_bytes() == data
    assert back.digest() == g.digest() == canonical.digest(data)
    assert structure(back) == structure(g)
    assert back.cast_storage == g.cast_storage
    assert [v.scale_exp for v in back.values.values()] == [v.scale_exp for v in g.values.values()]
    # the round-tripped graph evaluates to the same bits
    a = reference.evaluate(g, model.constants, model.inputs)
    b = reference.evaluate(back, model.constants, model.inputs)
    for k in a:
        np.testing.assert_array_equal(a[k], b[k])


def test_graph_digest_changes_with_any_attr(model):
    g = Graph.from_json(canonical.loads(model.graph.to_bytes()))
    d = g.digest()
    g.ops[10].attrs["scale"] = 0.25
    assert g.digest() != d


# numerics ----------------------------------------------------------------------------------------
def _scaling_none(t):
    t["casts"]["scaling"] = "none"


def _f152(t):
    t["casts"]["policy"] = "f152"


@pytest.mark.parametrize("mod,fmt,min_cos", [(None, "f143", 0.99), (_scaling_none, "f143", 0.99),
                                             (_f152, "f152", 0.98)])
def test_fp8_reference_close_to_f32(target, raw, mod, fmt, min_cos):
    m = build(target, mod)
    g = m.graph
    casts = [o for o in g.ops if o.type == "cast"]
    assert len(casts) == 8 and all(g.values[o.outputs[0]].dtype == fmt for o in casts)
    if mod is _scaling_none:
        assert all(v.scale_exp == 0 for v in g.values.values())
    out = by_name(g, reference.evaluate(g, m.constants, m.inputs))
    want = by_name(raw.graph, reference.evaluate(raw.graph, raw.constants, raw.inputs))
    assert set(out) == set(want) == {"features", "logits"}
    for k in out:
        assert np.all(np.isfinite(out[k]))
    cos, err = reference.compare(out, want)
    assert cos >= min_cos and np.isfinite(err) and err < 1.0, (cos, err)


def test_unknown_policy_is_a_user_error(target):
    def bad(t):
        t["casts"]["policy"] = "f999"
    with pytest.raises(UserError, match="casts.policy"):
        build(target, bad)


def test_compare_basics():
    rng = np.random.default_rng(0)
    x = {"a": rng.standard_normal((4, 5)).astype(np.float32), "b": rng.standard_normal((1, 7)).astype(np.float32)}
    cos, err = reference.compare(x, x)
    assert cos == pytest.approx(1.0, abs=1e-12) and err == 0.0
    neg = {k: -v for k, v in x.items()}
    cos, err = reference.compare(neg, x)
    assert cos == pytest.approx(-1.0)
    assert err == pytest.approx(2 * max(float(np.abs(v).max()) for v in x.values()))
    # a single flipped row gives -1 (the minimum over rows)
    y = {k: v.copy() for k, v in x.items()}
    y["a"][2] *= -1
    assert reference.compare(y, x)[0] == pytest.approx(-1.0)
    # zero rows: equal zeros count as 1, a zero against non-zero as 0
    z = {"a": np.zeros((2, 3), np.float32)}
    assert reference.compare(z, z) == (1.0, 0.0)
    cos, err = reference.compare(z, {"a": np.ones((2, 3), np.float32)})
    assert cos == 0.0 and err == 1.0
    # scaled copy: cosine 1, error = the difference
    cos, err = reference.compare({"a": 2 * x["a"]}, {"a": x["a"]})
    assert cos == pytest.approx(1.0) and err == pytest.approx(float(np.abs(x["a"]).max()))
    # non-finite device output
    bad = {"a": x["a"].copy(), "b": x["b"]}
    bad["a"][0, 0] = np.nan
    cos, err = reference.compare(bad, x)
    assert np.isnan(cos) and err == float("inf")


# casts folded into their producers -----------------------------------------------------------------
def _fuse(*ops):
    def mod(t):
        t["casts"]["fuse"] = list(ops)
    return mod


def assert_same_bits(folded, plain):
    """The reference of a graph with operations folded gives every value it shares with the
    unfolded graph (fewer: the folded operations' own outputs are gone) the same bits."""
    a = by_name(folded.graph, reference.evaluate(folded.graph, folded.constants, folded.inputs, keep_all=True))
    b = by_name(plain.graph, reference.evaluate(plain.graph, plain.constants, plain.inputs, keep_all=True))
    assert set(a) < set(b)
    for name, arr in a.items():
        np.testing.assert_array_equal(arr, b[name], err_msg=name)


def test_adds_fold_into_the_operations_before_them_bit_exact(target, model):
    """``fold_adds``: each residual add becomes its matmul's addend, the positional embedding
    the class token's concat's (their outputs the adds' values), and the reference gives every
    value both graphs have the same bits."""
    fused = build(target, lambda t: t["model"].update(passes=["fold_adds"]))
    g, u = fused.graph, model.graph
    assert [o.name for o in u.ops if o.type == "add"] == ["pos_embed", "block0.residual1", "block0.residual2"]
    assert not [o for o in g.ops if o.type == "add"]
    assert len(g.ops) == len(u.ops) - 3
    ops = {o.name: o for o in g.ops}
    for name, sum_name, addend in (("prepend_cls", "pos_embed", "pos_embed"),
                                   ("block0.proj", "block0.residual1", "pos_embed"),
                                   ("block0.fc2", "block0.residual2", "block0.residual1")):
        op = ops[name]
        assert op.attrs.get("addend") and g.values[op.outputs[0]].name == sum_name
        assert g.values[op.inputs[-1]].name == addend
    assert op.inputs[-1] not in g.constants and ops["prepend_cls"].inputs[-1] in g.constants
    assert_same_bits(fused, model)


def test_the_gelu_folds_into_its_matmul_with_its_cast_bit_exact(target):
    """``fold_activations`` after ``fold_casts``: fc1 applies the GELU and writes FP8 itself;
    the reference gives the FP8 codes the separate GELU gave."""
    plain = build(target, lambda t: t["casts"].pop("fuse"))
    fused = build(target, lambda t: (t["casts"].pop("fuse"), t["model"].update(passes=["fold_activations"])))
    g, u = fused.graph, plain.graph
    assert [o.name for o in u.ops if o.type == "gelu"] == ["block0.gelu"] and not [o for o in g.ops if o.type == "gelu"]
    fc1 = next(o for o in g.ops if o.name == "block0.fc1")
    assert fc1.attrs["activation"] == "gelu" and fc1.attrs["to"] == "f143"
    assert g.values[fc1.outputs[0]].name == "block0.gelu" and g.values[fc1.outputs[0]].dtype == "f143"
    assert len(g.ops) == len(u.ops) - 1
    assert_same_bits(fused, plain)


def test_the_gelu_stays_where_its_cast_could_not_move_into_the_matmul(target):
    """``[casts] fuse`` without matmul: the GELU keeps its folded cast, and so stays."""
    fused = build(target, lambda t: (t["casts"].update(fuse=["gelu"]), t["model"].update(passes=["fold_activations"])))
    ops = {o.name: o for o in fused.graph.ops}
    assert ops["block0.gelu"].attrs["to"] == "f143" and "activation" not in ops["block0.fc1"].attrs


def test_a_residual_add_is_not_folded_where_the_product_has_another_reader(target):
    from ipubuild.builtin.passes import fold_adds
    m = build(target)
    g = m.graph
    proj = next(o for o in g.ops if o.name == "block0.proj")
    add = next(o for o in g.ops if o.name == "block0.residual1")
    g.outputs.append(g.add("gelu", [proj.outputs[0]], name="another_reader"))
    fold_adds(m, target)
    assert any(o is add for o in g.ops) and not proj.attrs.get("addend")
    assert next(o for o in g.ops if o.name == "block0.fc2").attrs.get("addend")     # the other still folds


def test_casts_fold_into_producers_bit_exact(target, model):
    fused = build(target, _fuse("attention_context", "gelu", "layernorm", "matmul", "patchify", "slice_rows",
                                "softmax"))
    g, u = fused.graph, model.graph
    folded = {o.name: o for o in g.ops if "to" in o.attrs and o.type != "cast"}
    assert sorted(folded) == ["block0.context", "block0.gelu", "block0.ln1", "block0.ln2", "block0.qkv",
                              "block0.softmax", "cls_slice", "patchify"]
    assert [o.name for o in g.ops if o.type == "cast"] == []
    assert len(g.ops) == len(u.ops) - 8
    unfused_casts = {u.values[o.inputs[0]].name: u.values[o.outputs[0]] for o in u.ops if o.type == "cast"}
    for name, op in folded.items():
        v = g.values[op.outputs[0]]
        assert (v.dtype, v.scale_exp) == ("f143", unfused_casts[name].scale_exp) == (op.attrs["to"], op.attrs["scale_exp"])
    # the reference of the fused graph is the unfused one's, bit for bit, on every value both have
    a = by_name(g, reference.evaluate(g, fused.constants, fused.inputs, keep_all=True))
    b = by_name(u, reference.evaluate(u, model.constants, model.inputs, keep_all=True))
    for name, arr in a.items():
        other = b[unfused_casts[name].name] if name in folded else b[name]
        np.testing.assert_array_equal(arr, other, err_msg=name)


def test_the_policy_folds_only_into_the_operators_it_lists(target):
    g = build(target, _fuse("matmul")).graph
    assert sorted(o.name for o in g.ops if "to" in o.attrs and o.type != "cast") == ["block0.qkv"]
    assert len([o for o in g.ops if o.type == "cast"]) == 7
