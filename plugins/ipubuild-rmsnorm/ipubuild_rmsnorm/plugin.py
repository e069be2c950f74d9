"""The hooks of the ipubuild-rmsnorm plugin: the ``rmsnorm`` operator and its C kernel, the
``layernorm_to_rmsnorm`` graph pass, an ONNX converter (``SimplifiedLayerNormalization``), the
``vit_rms`` model family (a ViT with RMSNorm in place
of LayerNorm), the ``rmsnorm_follow`` layout-search heuristic and the ``vit_rms_small`` target.
The ``ipubuild`` entry point names this module."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from ipubuild import hookimpl
from ipubuild.log import get_logger
from ipubuild.operators import (KernelVariant, Lowering, Operator, TileWork, ceil_div, f32_bits,
                                key, split)
from ipubuild.passes import GraphPass
from ipubuild.search import Changes, Heuristic

KERNEL_SOURCE = Path(__file__).resolve().parent / "rmsnorm.c"
TARGETS = Path(__file__).resolve().parent / "targets"
log = get_logger("ipubuild_rmsnorm")


# the cycle estimator: cycles(args, machine) of one rmsnorm_f32 vertex -------------------------
def rmsnorm_cycles(args, machine):
    """Square-accumulate, divide, scale: 4 vector flops per element, one sqrt per row."""
    c = machine["compute"]
    rows, cols = args[3], args[4]
    return (c["vertex_overhead_cycles"] + ceil_div(rows * cols * 4, c["vector_flops_per_cycle"])
            + ceil_div(rows * c["transcendental_cycles"], machine["workers"]))


# the operator ----------------------------------------------------------------------------------
class RMSNorm(Operator):
    """``y = x / sqrt(mean(x^2) + eps) * gamma`` over the last axis; inputs ``x`` f32 ``[.., C]``
    and ``gamma`` f32 ``[C]``, attribute ``eps``."""
    name = "rmsnorm"

    def infer(self, graph, op):
        if len(op.inputs) != 2:
            raise ValueError(f"rmsnorm takes 2 inputs (x, gamma), got {len(op.inputs)}")
        x, g = (graph.values[i] for i in op.inputs)
        if x.dtype != "f32" or g.dtype != "f32":
            raise ValueError(f"rmsnorm takes f32 x and gamma, got {x.dtype} and {g.dtype}")
        if len(x.shape) < 1 or x.cols < 1:
            raise ValueError(f"rmsnorm needs x with a last axis, got shape {list(x.shape)}")
        if g.shape != (x.cols,):
            raise ValueError(f"rmsnorm needs gamma of shape [{x.cols}] (the last axis of "
                             f"{x.name}), got {list(g.shape)}")
        eps = op.attrs.get("eps")
        if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps > 0:
            raise ValueError(f"rmsnorm needs attribute eps, a number > 0, got {eps!r}")
        return [(x.shape, "f32", 0)]

    def reference(self, graph, op, inputs):
        x, g = inputs
        ms = (x * x).mean(axis=-1, keepdims=True, dtype=np.float32)
        return [(x / np.sqrt(ms + np.float32(op.attrs["eps"])) * g).astype(np.float32)]

    def plans(self, graph, op, tile_count):
        # like the built-in row-wise operators: all rows over min(rows, tiles) tiles, then halving
        counts, n = [], min(graph.values[op.outputs[0]].rows, tile_count)
        while n >= 1:
            counts.append(n)
            n //= 2
        return [{"rows": c} for c in counts]

    def lower(self, graph, op, plan):
        x, g = (graph.values[i] for i in op.inputs)
        y = graph.values[op.outputs[0]]
        eps = f32_bits(op.attrs["eps"])
        work = []
        for t, (r0, r1) in enumerate(split(x.rows, plan["rows"])):
            work.append(TileWork(
                t,
                reads=[(key(x.id), r0, r1, 0, x.cols), (key(g.id), 0, 1, 0, x.cols)],
                writes=[(key(y.id), r0, r1, 0, y.cols)],
                vertices=[("rmsnorm_f32", [("r", 0, 0), ("r", 1, 0), ("w", 0, 0),
                                           r1 - r0, x.cols, eps])]))
        return Lowering([work])

    def kernels(self):
        return [KernelVariant("rmsnorm_f32", KERNEL_SOURCE, (), rmsnorm_cycles)]


@hookimpl
def ipubuild_operators():
    return [RMSNorm()]


# the graph pass --------------------------------------------------------------------------------
def layernorm_to_rmsnorm(model, target):
    """Replace each layer normalisation by an RMSNorm with the same scale (gamma) and eps; its
    shift (beta) is dropped, and the built-in prune pass removes the unused constant."""
    g = model.graph
    for op in g.ops:
        if op.type == "layernorm":
            x, gamma, _beta = op.inputs
            g.replace_op(op, "rmsnorm", [x, gamma], eps=op.attrs["eps"])


@hookimpl
def ipubuild_graph_passes():
    return [GraphPass("layernorm_to_rmsnorm", layernorm_to_rmsnorm, stage="float")]


# the model family ------------------------------------------------------------------------------
# the ONNX converter: an exported RMSNorm (onnxruntime's SimplifiedLayerNormalization) ------------
def simplified_layer_normalization(ctx, node):
    """``SimplifiedLayerNormalization(X, scale)`` over the last axis (what exporters emit for an
    RMSNorm; onnxruntime runs it) as this plugin's ``rmsnorm`` operator."""
    x, scale = ctx.value(node.inputs[0]), ctx.constant(node.inputs[1])
    shape = ctx.shape(node.inputs[0])
    if node.attrs.get("axis", -1) % len(shape) != len(shape) - 1:
        raise ValueError("only a normalisation over the last axis has an rmsnorm operator")
    if scale is None or scale.size != shape[-1]:
        raise ValueError(f"needs a constant scale of {shape[-1]} elements")
    gamma = ctx.add_constant(scale.reshape(-1), node.inputs[1])
    return [ctx.add("rmsnorm", [x, gamma], eps=float(node.attrs.get("epsilon", 1e-5)))]


@hookimpl
def ipubuild_onnx_converters():
    return {"SimplifiedLayerNormalization": simplified_layer_normalization}


@hookimpl
def ipubuild_model_families():
    return ["vit_rms"]


@hookimpl
def ipubuild_build_model(family, params, seed, where):
    if family != "vit_rms":
        return None
    from ipubuild.builtin.vit import build_vit, vit_params
    model = build_vit(vit_params(params, where), seed)
    layernorm_to_rmsnorm(model, {})
    return model


# the targets it ships --------------------------------------------------------------------------
@hookimpl
def ipubuild_targets():
    return sorted(TARGETS.glob("*.toml"))


# the search heuristic --------------------------------------------------------------------------
def rmsnorm_follow(layout, sc):
    """Give each rmsnorm the row count and first tile of the operation that split its input —
    through any chain of follow plans, which run on their producer's tiles — so its rows are
    already on the tiles that read them. That split must be whole rows on consecutive tiles: a
    ``{"rows": n}`` plan, or a matmul's ``{"m": n, "n": 1, "k": 1}``."""
    out = []
    for op in sc.graph.ops:
        if op.type != "rmsnorm":
            continue
        producer, plan = sc.producer.get(op.inputs[0]), None
        while producer is not None:
            chosen = layout["ops"][str(producer.id)]
            plan = sc.plans[producer.id][chosen["plan"]]
            if "follow" not in plan:
                break
            producer = sc.producer.get(producer.inputs[plan["follow"]])
        if producer is None:
            continue
        rows = plan.get("rows") if set(plan) == {"rows"} else \
            plan.get("m") if (plan.get("n"), plan.get("k")) == (1, 1) else None
        mine = [p.get("rows") for p in sc.plans[op.id]]
        if rows in mine:
            out.append(Changes(plans=((op.id, mine.index(rows)),),
                               boundaries=((op.id, chosen["offset"]),)))
    log.info("proposed rmsnorm moves", changes=len(out))
    return out


@hookimpl
def ipubuild_search_heuristics():
    return [Heuristic("rmsnorm_follow", rmsnorm_follow)]
