"""The graph contracts docs/reference.md states, with its examples run: the built-in ViT graph's
operations, names and input order; a pass adding a weight; replace_op by name and with a new
name; infer() recomputing scale_exp from attributes, and validate() catching a stale one."""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from ipubuild.builtin.vit import build_vit

ROOT = Path(__file__).resolve().parent.parent
DOC = (ROOT / "docs" / "reference.md").read_text()
P = dict(image_size=32, channels=3, patch=16, width=16, heads=2, mlp=32, blocks=1, classes=10)


def _block(lang: str, after: str) -> str:
    return re.search(rf"{re.escape(after)}.*?```{lang}\n(.*?)```", DOC, re.S)[1]


def test_the_documented_vit_graph_is_the_one_built():
    g = build_vit(P, 0).graph
    lines = [f"{op.type} {op.name} <- {', '.join(g.values[v].name for v in op.inputs)}" for op in g.ops]
    assert _block("text", "### The built-in ViT graph").strip().splitlines() == lines
    assert [g.values[v].name for v in g.inputs] == ["image"]
    assert [g.values[v].name for v in g.outputs] == ["features", "logits"]


def test_the_documented_pass_that_adds_a_weight_builds_a_valid_graph():
    namespace = {"np": np}
    exec(_block("python", "A pass that adds a weight"), namespace)       # noqa: S102 - the doc's own example
    model = build_vit(P, 0)
    namespace["add_bias"](model, {})
    g = model.graph
    g.validate()
    (added,) = [op for op in g.ops if op.name == "head_bias"]
    assert [g.values[v].name for v in added.inputs] == ["logits", "head.extra_bias"]
    assert g.outputs[-1] == added.outputs[0] and set(model.constants) >= set(g.constants)


def test_replace_op_by_name_and_with_a_new_name():
    g = build_vit(P, 0).graph
    (ln,) = [op for op in g.ops if op.name == "block0.ln1"]
    out = ln.outputs[0]
    g.replace_op("block0.ln1", "layernorm", ln.inputs, name="block0.norm1", eps=1e-5)
    assert ln.name == "block0.norm1" and g.values[out].name == "block0.norm1" and ln.attrs == {"eps": 1e-5}
    g.replace_op(ln, "layernorm", ln.inputs, eps=1e-6)       # an Op, keeping its name
    assert ln.name == "block0.norm1"
    with pytest.raises(ValueError, match="no operation named 'nope'"):
        g.replace_op("nope", "gelu", [out])


def test_infer_recomputes_a_casts_scale_exp_and_validate_catches_a_stale_one():
    g = build_vit(P, 0).graph
    x = g.outputs[0]
    c = g.add("cast", [x], name="cast_features", to="f143", scale_exp=3)
    assert g.values[c].scale_exp == 3
    (cast,) = [op for op in g.ops if op.name == "cast_features"]
    cast.attrs["scale_exp"] = 5                                 # a policy changes its attribute ...
    with pytest.raises(ValueError, match=r"cast_features: value cast_features is .* scale_exp 3, but its "
                                         r"inputs and attributes give .* scale_exp 5: call graph.infer\(\)"):
        g.validate()                                           # ... and forgets infer(): named here
    g.infer()
    assert g.values[c].scale_exp == 5 and g.stale() == []
    g.validate()


def test_the_documented_percentile_cast_policy_reuses_the_built_in_placement():
    """The doc's policy casts the same operands as the built-in one, with its own exponents: at
    least those of the built-in rule (a percentile is at most the maximum), larger somewhere."""
    from ipubuild.builtin.casts import place_casts
    from ipubuild.graph import fp8
    namespace = {}
    exec(_block("python", "A percentile policy is a"), namespace)       # noqa: S102 - the doc's own example
    policy = namespace["ipubuild_cast_policies"]()["f143_p999"]
    params = {"policy": "f143_p999", "scaling": "amax_pow2", "storage": {}}
    ours, builtin = build_vit(P, 0), build_vit(P, 0)
    stored = policy(ours.graph, ours.constants, ours.inputs, params)
    place_casts(builtin.graph, builtin.constants, builtin.inputs, params, "f143")
    for g in (ours.graph, builtin.graph):
        g.validate()
    cast = lambda g: {op.name: op.attrs["scale_exp"] for op in g.ops if op.type == "cast"}  # noqa: E731
    fp8_constants = lambda g: {g.values[v].name: g.values[v].scale_exp for v in g.constants  # noqa: E731
                               if g.values[v].dtype in fp8.MAX}
    assert cast(ours.graph).keys() == cast(builtin.graph).keys() and cast(ours.graph)
    mine, theirs = {**cast(ours.graph), **fp8_constants(ours.graph)}, {**cast(builtin.graph), **fp8_constants(builtin.graph)}
    assert mine.keys() == theirs.keys()
    assert all(mine[k] >= theirs[k] for k in mine) and any(mine[k] > theirs[k] for k in mine), (mine, theirs)
    assert stored.default == "separate"
