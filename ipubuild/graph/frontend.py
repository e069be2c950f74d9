"""Front ends: a model family's builder gives a float32 graph, its constants and inputs; graph
passes rewrite it; the target's cast policy then places the FP8 casts, and passes of the cast
stage rewrite the result. All are plugins."""
from __future__ import annotations

import contextlib
import dataclasses

import numpy as np

from . import tensors
from ..engine.engine import phase
from ..engine.errors import UserError
from .ir import Graph


@dataclasses.dataclass
class Model:
    """What a model builder returns: the float32 graph, constants and example inputs by value id.
    ``build_model`` adds ``float_outputs``: the graph outputs of the float32 model before casts."""
    graph: Graph
    constants: dict[int, np.ndarray]
    inputs: dict[int, np.ndarray]
    float_outputs: dict[int, np.ndarray] = dataclasses.field(default_factory=dict)


_float_model: list = []     # (graph, constants, inputs, values) of the build_model under way
_sources: dict = {}         # slot -> bytes loader: the declared source files of the lower_model under way


@contextlib.contextmanager
def supplying_model_files(loaders: dict):
    """Hand a family the files it reads (``{slot: () -> bytes}``, what ``model_sources`` returns)
    while a model is built: ``lower_model`` supplies its verified sources, ``doit
    kernel:<variant>`` the tree's files."""
    _sources.update(loaders)
    try:
        yield
    finally:
        _sources.clear()


def model_sources() -> dict:
    """The files the running ``lower_model`` declared (``{slot: () -> bytes}``, e.g.
    ``model/file``): how a family that reads files (the ONNX one) gets their verified bytes."""
    return dict(_sources)


def float_values(graph: Graph, constants: dict, inputs: dict) -> dict[int, np.ndarray]:
    """Every value of the float32 model on its example inputs (one BLAS thread: reproducible).
    A cast policy calibrates its scales from these; inside ``build_model`` they are computed once,
    before the policy runs, and also give the float32 reference."""
    for g, c, i, values in _float_model:
        if g is graph and c is constants and i is inputs:
            return values
    from .reference import evaluate
    return evaluate(graph, constants, inputs, keep_all=True, threads=1)


def model_families(pm) -> list[str]:
    return sorted({f for _, f in pm.collect("ipubuild_model_families", lambda f: isinstance(f, str),
                                             "a list of model family names")})


def cast_policies(pm) -> dict:
    return pm.collect("ipubuild_cast_policies", callable, "a dict of policy names to callables", mapping=True)


#: keys of ``[model]`` that are ipubuild's, not the family builder's
MODEL_KEYS = ("family", "passes")


def build_model(pm, target: dict) -> Model:
    """Run the target's model builder, the float stage's graph passes, the cast policy and the
    cast stage's passes: the graph the compiler plans."""
    from . import passes
    where = target.get("path", target.get("name", "target"))
    params = {k: v for k, v in target["model"].items() if k not in MODEL_KEYS}
    family = target["model"]["family"]
    model = pm.call("ipubuild_build_model", family=family, params=params,
                    seed=target["target"]["seed"], where=where)
    if model is None:
        families = model_families(pm)
        raise UserError(f"{where}: model.family", f"unknown model family {family!r}; known: "
                        f"{', '.join(families)}")
    if not isinstance(model, Model):
        raise UserError(f"model family {family}", "ipubuild_build_model must return ipubuild.frontend.Model")
    policies = cast_policies(pm)
    name = target["casts"]["policy"]
    if name not in policies:
        raise UserError(f"{where}: casts.policy", f"unknown cast policy {name!r}; known: "
                        f"{', '.join(sorted(policies))}")
    chosen = passes.selected(passes.graph_passes(pm), target["model"].get("passes", []), where)
    try:
        model.graph.validate()
        passes.run(pm, model, chosen, "float", target)
        values = float_values(model.graph, model.constants, model.inputs)
        model.float_outputs = {v: values[v] for v in model.graph.outputs}
        _float_model.append((model.graph, model.constants, model.inputs, values))
        try:
            storage = policies[name](model.graph, model.constants, model.inputs, target["casts"])
        finally:
            _float_model.clear()
        model.graph.cast_storage = storage
        model.graph.validate()
        passes.run(pm, model, chosen, "cast", target)
    except ValueError as exc:
        raise UserError(f"{where}: model", str(exc)) from None
    return model


@phase("lower_model", inputs=("model/*",), outputs=("graph", "params", "float_reference"),
       config=("name", "path", "target.seed", "model", "casts"),
       hooks=("ipubuild_operators", "ipubuild_build_model", "ipubuild_model_families", "ipubuild_cast_policies",
              "ipubuild_graph_passes", "ipubuild_onnx_converters"))
def lower_model(ctx):
    """The target's model as the FP8 graph the compiler plans, with its constants and inputs,
    and the outputs of the float32 model before casts (after the float stage's graph passes:
    the quantisation error is measured against them). ``model/*``: the files a family reads
    (the ONNX family's model, data and input files), declared as the step's sources."""
    from ..plugins import get_plugin_manager
    with supplying_model_files({f"model/{k}": (lambda d=d: ctx.engine.fetch(d)) for k, d in ctx.family("model").items()}):
        model = build_model(get_plugin_manager(), ctx.config)
    arrays = {f"v{k}": v for k, v in {**model.constants, **model.inputs}.items()}
    g = model.graph
    return {"graph": g.to_bytes(), "params": tensors.pack(arrays),
            "float_reference": tensors.pack({g.values[v].name: a for v, a in model.float_outputs.items()})}
