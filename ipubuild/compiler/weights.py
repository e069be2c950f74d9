"""New weights, same program: planning reads the graph's structure, not its values.

The graph ``lower_model`` gives carries, besides shapes, dtypes and operators, the FP8 scale of
every value (``scale_exp``, calibrated on the weights and the example input) — and the kernels'
vertex arguments carry those scales. If planning read that graph, a fine-tuned checkpoint whose
weights move a scale by one power of two would re-plan the whole package.

So planning reads the *plan graph* (``strip_values``: the same graph with every ``scale_exp``
set to 0), and the program it plans has zeros where the scales go; ``bind_values`` then lowers
each operation of the real graph under the planned layout — the same tiles, buffers and
transfers: lowering does not depend on scales — and copies the scale arguments into the
program that ``prepare_tile_code`` turns into tile code. A weights-only change (same graph,
other initializer values, or another ``[model] seed`` of the built-in ViT) re-runs
``lower_model``, the reference, ``bind_values`` and what reads values (tile data and code,
images, the package, the device run, the checks) — no planning or search phase.
"""
from __future__ import annotations

from ..engine.engine import phase
from ..engine.errors import UserError
from ..graph.artifacts import graph_of
from ..graph.ir import Graph

OPS = ("ipubuild_operators",)


def plan_graph(graph: Graph) -> Graph:
    """The graph without its values: every value's and operation's ``scale_exp`` 0."""
    g = Graph.from_json(graph.to_json())
    for v in g.values.values():
        v.scale_exp = 0
    for op in g.ops:
        if "scale_exp" in op.attrs:
            op.attrs["scale_exp"] = 0
    return g


@phase("strip_values", inputs=("graph",), outputs=("plan_graph",))
def strip_values(ctx):
    """The graph planning reads: its structure (shapes, dtypes, operators), no scales."""
    return {"plan_graph": plan_graph(graph_of(ctx)).to_bytes()}


@phase("bind_values", inputs=("graph", "layout", "program"), outputs=("program",),
       config=("target.tile_count",), hooks=OPS)
def bind_values(ctx):
    """The planned program with the real graph's scale arguments in its vertices."""
    from .planning.program import program_blob
    return {"program": program_blob(bind(ctx.json("program"), graph_of(ctx), ctx.json("layout"),
                                    ctx.config["target"]["tile_count"]))}


def bind(program: dict, graph: Graph, layout: dict, tile_count: int) -> dict:
    """``program`` (planned from the plan graph) with every vertex's numeric arguments taken
    from the lowering of ``graph`` under ``layout``; buffer references stay. The two lowerings
    must agree on everything else (an internal error names the operation if not)."""
    import numpy as np
    from .planning.program import PlanResolver, _ranges
    resolver = PlanResolver.of(graph, tile_count)
    resolved = resolver.resolve(layout)
    kernel_index = {k: i for i, k in enumerate(program["kernels"])}
    steps, s = [], 0
    for op in graph.ops:
        choice, offset = resolved[op.id]
        for stage in resolver.lowering(op, choice).stages:
            if s >= len(program["steps"]) or program["steps"][s]["op"] != op.id:
                raise UserError("bind_values", f"the program's steps are not those of operation {op.name}")
            step = program["steps"][s]
            s += 1
            # the stage's vertices as build_program lays them out: in tile order, each tile's in order
            vertices, values, refs = [], [], []
            for work in stage:
                tile = (offset + work.tile) % tile_count
                for kernel, args in work.vertices:
                    vertices.append((tile, kernel_index.get(kernel, -1), len(args)))
                    values.extend(0 if isinstance(a, tuple) else int(a) for a in args)
                    refs.extend(isinstance(a, tuple) for a in args)
            vertices = np.array(vertices, dtype=np.int64).reshape(-1, 3)
            order = np.argsort(vertices[:, 0], kind="stable")
            counts = vertices[order, 2]
            at = _ranges((np.cumsum(vertices[:, 2]) - vertices[:, 2])[order], counts)
            values, refs = np.asarray(values, dtype=np.int64)[at], np.asarray(refs, dtype=bool)[at]
            args = step["args"]
            if not np.array_equal(vertices[order], step["vertices"]) or not np.array_equal(refs, args[:, 1] > 0):
                raise UserError("bind_values", f"operation {op.name}: its lowering with the model's "
                                "scales differs from the planned one beyond scale arguments")
            bound = np.where(refs, args[:, 0], values)
            if not np.array_equal(bound, args[:, 0]):
                step = dict(step, args=np.stack([bound, args[:, 1]], axis=1))
            steps.append(step)
    if s != len(program["steps"]):
        raise UserError("bind_values", "the program has steps no operation of the graph lowers to")
    return dict(program, steps=steps)
