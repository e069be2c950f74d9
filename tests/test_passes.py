"""Graph passes (``ipubuild_graph_passes``): their order, who runs them, their errors, their
place in ``lower_model``'s action key, the Graph helpers they use, and the built-in ones (the
ViT's casts are folded by ``fold_casts``, bit for bit what a cast policy folding them gave)."""
from __future__ import annotations

import copy
import types
from pathlib import Path

import numpy as np
import pytest

from ipubuild import hookimpl, passes, targets
from ipubuild.engine.engine import PHASES
from ipubuild.errors import UserError
from ipubuild.frontend import Model, build_model
from ipubuild.ir import Graph
from ipubuild.passes import GraphPass
from ipubuild.plugins import PluginManager, get_plugin_manager

ROOT = Path(__file__).resolve().parent.parent
SMALL = {"image_size": 32, "patch": 16, "width": 16, "heads": 2, "mlp": 32, "classes": 4}


def target(**model):
    t = targets.load_target(str(ROOT / "targets" / "vit_fp8.toml"))
    t["model"].update(SMALL, **model)
    return t


def manager(**hooks) -> PluginManager:
    """The built-in plugins plus one test plugin with ``hooks``."""
    pm = PluginManager().load(autoload=False)
    m = types.ModuleType("test_pass_plugin")
    for name, fn in hooks.items():
        setattr(m, name, hookimpl(fn))
    pm.register(m, name=m.__name__)
    return pm


def recorder(log, name):
    def run(model, target):
        """Record that it ran."""
        log.append((name, sorted({v.dtype for v in model.graph.values.values()})))
    return run


def test_passes_run_by_stage_order_and_name_defaults_and_those_a_target_lists():
    ran = []
    declared = [GraphPass("b_late", recorder(ran, "b_late"), order=200, default=True),
                GraphPass("a_late", recorder(ran, "a_late"), order=200, default=True),
                GraphPass("early", recorder(ran, "early"), order=10),
                GraphPass("after_casts", recorder(ran, "after_casts"), stage="cast", order=0, default=True),
                GraphPass("unlisted", recorder(ran, "unlisted"))]
    pm = manager(ipubuild_graph_passes=lambda: declared)
    build_model(pm, target(passes=["early"]))
    assert [n for n, _ in ran] == ["early", "a_late", "b_late", "after_casts"]
    assert all(dtypes == ["f32"] for n, dtypes in ran if n != "after_casts")     # before the casts
    assert "f143" in dict(ran)["after_casts"]                                    # after them


def test_a_float_pass_changes_the_model_and_its_float32_reference():
    def double_gelu_input(model, target):
        """Scale the input of each GELU by 2 (through a new add)."""
        g = model.graph
        for op in list(g.ops):
            if op.type == "gelu":
                doubled = g.insert(op.id, "add", [op.inputs[0], op.inputs[0]], name=f"{op.name}.twice")
                op.inputs[0] = doubled
    plain = build_model(get_plugin_manager(), target(passes=[]))
    pm = manager(ipubuild_graph_passes=lambda: [GraphPass("twice", double_gelu_input)])
    changed = build_model(pm, target(passes=["twice"]))
    assert len(changed.graph.ops) == len(plain.graph.ops) + 1
    assert [op.id for op in changed.graph.ops] == list(range(len(changed.graph.ops)))
    logits = [v for v in changed.float_outputs if changed.graph.values[v].name == "logits"][0]
    plain_logits = [v for v in plain.float_outputs if plain.graph.values[v].name == "logits"][0]
    assert not np.allclose(changed.float_outputs[logits], plain.float_outputs[plain_logits])


def test_an_unknown_pass_is_an_error_at_load_and_at_build(tmp_path):
    p = tmp_path / "t.toml"
    p.write_text('[target]\ntile_count = 4\n[model]\nfamily = "vit"\npasses = ["prune", "nope"]\n')
    with pytest.raises(UserError, match=r"t.toml: model.passes\[1\]: unknown graph pass 'nope'; known: "
                                        r"fold_casts, prune; a plugin may provide it"):
        targets.load_target(p, known={"passes": ["fold_casts", "prune"]}, shown="t.toml")
    with pytest.raises(UserError, match=r"model.passes: unknown graph pass 'nope'"):
        build_model(get_plugin_manager(), target(passes=["nope"]))


@pytest.mark.parametrize("run, message", [
    (lambda m, t: (_ for _ in ()).throw(ValueError("cannot rewrite this")), "graph pass bad: cannot rewrite this"),
    (lambda m, t: 1 / 0, "plugin test_pass_plugin: graph pass bad raised ZeroDivisionError"),
    (lambda m, t: m, "graph pass bad: run must rewrite the model in place and return None"),
    (lambda m, t: m.graph.outputs.append(10**6), "graph pass bad: left an invalid graph"),
])
def test_a_failing_pass_is_a_one_line_error_naming_it(run, message):
    pm = manager(ipubuild_graph_passes=lambda: [GraphPass("bad", run, default=True)])
    with pytest.raises(UserError) as info:
        build_model(pm, target())
    assert message in str(info.value) and "\n" not in str(info.value)


def test_malformed_and_duplicate_passes_name_the_plugin():
    pm = manager(ipubuild_graph_passes=lambda: [GraphPass("x y", lambda m, t: None)])
    with pytest.raises(UserError, match="plugin test_pass_plugin: hook ipubuild_graph_passes must return"):
        passes.graph_passes(pm)
    pm = manager(ipubuild_graph_passes=lambda: [GraphPass("prune", lambda m, t: None)])
    with pytest.raises(UserError, match="graph pass 'prune' is already registered by ipubuild.builtin.passes"):
        passes.graph_passes(pm)
    pm = manager(ipubuild_graph_passes=lambda: [GraphPass("late", lambda m, t: None, stage="later")])
    with pytest.raises(UserError, match="must return"):
        passes.graph_passes(pm)


def test_pass_plugins_enter_lower_models_action_key():
    from ipubuild.engine.engine import Engine
    ph = PHASES["lower_model"]
    assert "ipubuild_graph_passes" in ph.hooks
    pm = manager(ipubuild_graph_passes=lambda: [GraphPass("mine", lambda m, t: None)])
    assert "test_pass_plugin" in pm.fingerprints(ph.hooks)
    cfg = target()
    without = Engine(None, lambda hooks: PluginManager().load(autoload=False).fingerprints(hooks)).signature(ph, cfg)
    with_it = Engine(None, lambda hooks: pm.fingerprints(hooks)).signature(ph, cfg)
    assert without != with_it
    listed = dict(cfg, model=dict(cfg["model"], passes=["mine"]))
    assert Engine(None, lambda hooks: pm.fingerprints(hooks)).signature(ph, listed) != with_it


def test_fold_casts_gives_the_graph_a_folding_policy_gave():
    """The cast policy places separate casts; the fold_casts pass folds them: the result is the
    graph, constants and inputs of the policy that folded as it placed (pinned by digest)."""
    t = targets.load_target(str(ROOT / "targets" / "vit_fp8.toml"))
    folded = build_model(get_plugin_manager(), t)
    separate_t = copy.deepcopy(t)
    separate_t["casts"]["fuse"] = []
    separate = build_model(get_plugin_manager(), separate_t)
    assert len(separate.graph.ops) > len(folded.graph.ops)
    from ipubuild.builtin.casts import fold_casts
    fold_casts(separate, t)
    assert separate.graph.to_bytes() == folded.graph.to_bytes()
    assert sorted(separate.constants) == sorted(folded.constants)
    assert all(np.array_equal(separate.constants[k], folded.constants[k]) for k in folded.constants)
    # pinned: vit_fp8's graph (its softmax's cast, its GELU and its adds folded too)
    assert folded.graph.digest() == "947834559f3491289955c30f1b3e12f3101d18393a17977ec6656e06562aab42"


# the Graph helpers passes use -------------------------------------------------------------------
def _chain():
    g = Graph()
    x = g.input("x", (4, 8))
    w = g.constant("w", (8,))
    unused = g.constant("unused", (8,))
    a = g.add("add", [x, x], name="a")
    b = g.add("gelu", [a], name="b")
    g.add("gelu", [a], name="dead")
    g.outputs = [b]
    consts = {w: np.ones(8, np.float32), unused: np.zeros(8, np.float32)}
    return g, Model(g, consts, {x: np.zeros((4, 8), np.float32)}), (x, w, unused, a, b)


def test_remove_unused_drops_dead_operations_and_values_and_renumbers():
    g, model, (x, w, unused, a, b) = _chain()
    removed = passes.prune(model)
    assert removed == 1 and [op.name for op in g.ops] == ["a", "b"] and [op.id for op in g.ops] == [0, 1]
    assert sorted(g.values) == list(range(len(g.values))) and g.constants == []
    assert [v.name for v in g.values.values()] == ["x", "a", "b"]
    assert model.constants == {} and list(model.inputs) == [0]
    assert g.outputs == [2] and g.ops[1].inputs == [1]
    g.validate()
    assert g.remove_unused() == {0: 0, 1: 1, 2: 2}          # nothing more to remove


def test_insert_replace_uses_and_replace_op():
    g, model, (x, w, unused, a, b) = _chain()
    scaled = g.insert(1, "add", [a, a], name="a2")
    assert [op.name for op in g.ops] == ["a", "a2", "b", "dead"] and [op.id for op in g.ops] == [0, 1, 2, 3]
    assert g.replace_uses(a, scaled, skip=[g.ops[1]]) == 2   # b and dead read a2; a2 still reads a
    assert g.ops[1].inputs == [a, a] and g.ops[2].inputs == [scaled]
    g.replace_op(g.ops[2], "softmax", [scaled], scale=1.0)
    assert g.ops[2].type == "softmax" and g.ops[2].outputs == [b] and g.values[b].dtype == "f32"
    with pytest.raises(UserError, match="operation b"):
        g.replace_op(g.ops[2], "cast", [scaled], to="nope")
    g.validate()


def test_fold_adds_folds_a_chain_of_adds_in_one_run():
    """An add whose operand another fold just made (``r + mm0``, then that sum ``+ mm1``) folds
    too: each product takes its add, in one run, and the reference is the same bits."""
    from ipubuild.builtin.passes import fold_adds
    from ipubuild.graph import reference

    def chain():
        g = Graph()
        x = g.input("x", (4, 8))
        w = g.constant("w", (8, 8))
        mm0 = g.add("matmul", [x, w], name="mm0")
        mm1 = g.add("matmul", [x, w], name="mm1")
        s0 = g.add("add", [x, mm0], name="s0")
        g.outputs = [g.add("add", [s0, mm1], name="s1")]
        r = np.random.default_rng(0)
        return Model(g, {w: r.standard_normal((8, 8)).astype(np.float32)},
                     {x: r.standard_normal((4, 8)).astype(np.float32)})
    plain, folded = chain(), chain()
    fold_adds(folded, {})
    g = folded.graph
    g.validate()
    assert [(o.name, o.attrs.get("addend")) for o in g.ops] == [("mm0", True), ("mm1", True)]
    want = reference.evaluate(plain.graph, plain.constants, plain.inputs)
    got = reference.evaluate(g, folded.constants, folded.inputs)
    np.testing.assert_array_equal(got[g.outputs[0]], want[plain.graph.outputs[0]])
