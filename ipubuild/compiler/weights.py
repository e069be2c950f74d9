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
    """``program`` (planned from the plan graph) with every vertex's integer arguments taken
    from the lowering of ``graph`` under ``layout``; buffer references stay. The two lowerings
    must agree on everything else (an internal error names the operation if not)."""
    from .planning.program import PlanResolver
    resolver = PlanResolver.of(graph, tile_count)
    resolved = resolver.resolve(layout)
    steps, s = [], 0
    for op in graph.ops:
        choice, offset = resolved[op.id]
        for stage in resolver.lowering(op, choice).stages:
            step = program["steps"][s]
            s += 1
            if step["op"] != op.id:
                raise UserError("bind_values", f"the program's step {step['name']} is not of operation {op.name}")
            verts = dict(step["vertices"])
            seen: dict[str, int] = {}
            changed: dict[str, list] = {}
            for work in stage:
                tile = str((offset + work.tile) % tile_count)
                for kernel, args in work.vertices:
                    i = seen.get(tile, 0)
                    seen[tile] = i + 1
                    pk, pargs = verts[tile][i]
                    if pk != kernel or len(pargs) != len(args):
                        raise UserError("bind_values", f"operation {op.name}: its lowering with the model's "
                                        "scales differs from the planned one beyond scale arguments")
                    bound = [pa if isinstance(pa, list) else int(a) for pa, a in zip(pargs, args)]
                    if bound != pargs:
                        row = changed.setdefault(tile, list(verts[tile]))
                        row[i] = [pk, bound]
            if changed:
                verts.update(changed)
                step = dict(step, vertices=verts)
            steps.append(step)
    if s != len(program["steps"]):
        raise UserError("bind_values", "the program has steps no operation of the graph lowers to")
    return dict(program, steps=steps)
