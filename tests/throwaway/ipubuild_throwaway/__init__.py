"""A throw-away ipubuild plugin for the tests: one of everything a plugin can register — an
operator with its C kernel, a graph pass (opt-in), a model family, a cast policy, a search
heuristic, a device, a cache backend and a target — written only from docs/reference.md.
``tests/test_plugin_isolation.py`` installs it (an entry point on ``PYTHONPATH``) beside the
rmsnorm example and runs the project's tests: they must pass with any well-formed plugin."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from ipubuild import hookimpl
from ipubuild.log import get_logger
from ipubuild.operators import KernelVariant, Lowering, Operator, TileWork, ceil_div, key, split
from ipubuild.passes import GraphPass
from ipubuild.search import Changes, Heuristic

HERE = Path(__file__).resolve().parent
log = get_logger("ipubuild_throwaway")


def square_cycles(args, machine):
    c = machine["compute"]
    return c["vertex_overhead_cycles"] + ceil_div(args[2], c["vector_flops_per_cycle_by_dtype"]["f32"])


class Square(Operator):
    """``y = x * x``, f32, by rows."""
    name = "throwaway_square"

    def infer(self, graph, op):
        x = graph.values[op.inputs[0]]
        if x.dtype != "f32":
            raise ValueError(f"throwaway_square takes f32, got {x.dtype}")
        return [(x.shape, "f32", 0)]

    def reference(self, graph, op, inputs):
        return [(inputs[0] * inputs[0]).astype(np.float32)]

    def plans(self, graph, op, tile_count):
        return [{"rows": n} for n in (min(tile_count, graph.values[op.outputs[0]].rows), 1)]

    def lower(self, graph, op, plan):
        x, y = graph.values[op.inputs[0]], graph.values[op.outputs[0]]
        return Lowering([[TileWork(t, [(key(x.id), r0, r1, 0, x.cols)], [(key(y.id), r0, r1, 0, y.cols)],
                                   [("throwaway_square_f32", [("r", 0, 0), ("w", 0, 0), (r1 - r0) * x.cols])])
                          for t, (r0, r1) in enumerate(split(x.rows, plan["rows"]))]])

    def kernels(self):
        return [KernelVariant("throwaway_square_f32", HERE / "square.c", (), square_cycles)]


def gelu_to_square(model, target):
    """Replace each GELU by a square."""
    for op in model.graph.ops:
        if op.type == "gelu":
            model.graph.replace_op(op, "throwaway_square", op.inputs)


def square_only(layout, sc):
    """Each throwaway_square on its other plans (nothing for graphs without one)."""
    return [Changes(plans=((op.id, p),)) for op in sc.graph.ops if op.type == "throwaway_square"
            for p in range(len(sc.plans[op.id])) if p != layout["ops"][str(op.id)]["plan"]]


class MemoryCache:
    """An in-memory cache backend."""

    def __init__(self, url):
        self.entries = {}

    def get(self, kind, key):
        return self.entries.get((kind, key))

    def put(self, kind, key, data):
        self.entries[(kind, key)] = data


def _device():
    from ipubuild.builtin.simulator import Simulator
    return Simulator()


@hookimpl
def ipubuild_operators():
    return [Square()]


@hookimpl
def ipubuild_graph_passes():
    return [GraphPass("throwaway_gelu_to_square", gelu_to_square)]


@hookimpl
def ipubuild_model_families():
    return ["throwaway_vit"]


@hookimpl
def ipubuild_build_model(family, params, seed, where):
    if family != "throwaway_vit":
        return None
    from ipubuild.builtin.vit import build_vit, vit_params
    return build_vit(vit_params(params, where), seed)


@hookimpl
def ipubuild_cast_policies():
    from ipubuild.builtin.casts import place_casts
    return {"throwaway_f152": lambda g, c, i, p: place_casts(g, c, i, p, "f152")}


@hookimpl
def ipubuild_search_heuristics():
    return [Heuristic("throwaway_square_only", square_only)]


@hookimpl
def ipubuild_device_backends():
    return {"throwaway_device": _device}


@hookimpl
def ipubuild_cache_backends():
    return {"throwaway": MemoryCache}


@hookimpl
def ipubuild_targets():
    return sorted((HERE / "targets").glob("*.toml"))
