"""The built-in FP8 cast policies: matmul operands in F143 (default) or F152, each tensor with a
power-of-two scale chosen from its absolute maximum on the target's example input. Where the
producer of an activation can write FP8 itself (and every reader wants it in FP8), the cast is
folded into the producer's kernel — no separate step, no sync — for the operator types the
target's ``casts.fuse`` lists (by default every one that can)."""
from __future__ import annotations

import numpy as np

from .. import fp8, hookimpl
from ..ir import CastStoragePolicy, Graph, Op
from ..operators import registry
from ..targets import CAST_FUSIBLE

#: operators whose listed inputs are cast to FP8 (by input position)
FP8_OPERANDS = {"matmul": (0, 1), "attention_scores": (0,), "attention_context": (0, 1)}


def _fold(graph: Graph, producer: Op | None, vid: int, fmt: str, fuse) -> bool:
    """Whether the cast of ``vid`` to ``fmt`` can be folded into its producer: the policy
    allows it for the producer's operator, the operator can write ``fmt``, and every reader of
    ``vid`` wants it in FP8 (none needs the f32 value, and it is not a graph output)."""
    if producer is None or producer.type not in fuse or vid in graph.outputs or producer.outputs != [vid]:
        return False
    if not registry().get(producer.type).fuses_cast(graph, producer, fmt):
        return False
    readers = [(op, i) for op in graph.ops for i, v in enumerate(op.inputs) if v == vid]
    return all(i in FP8_OPERANDS.get(op.type, ()) for op, i in readers)


def place_casts(graph: Graph, constants: dict, inputs: dict, params: dict, fmt: str) -> CastStoragePolicy:
    """Cast every FP8 operand: constants are stored in FP8 directly; an activation's producer
    writes FP8 itself where the cast can be folded into it (see ``_fold``), else the
    activation gets a cast op right after its producer. Scales come from calibration on the
    example inputs."""
    from ..frontend import float_values
    calibrated = float_values(graph, constants, inputs)

    def scale(vid):
        if params.get("scaling") == "none":
            return 0
        return fp8.scale_exp_for(float(np.nanmax(np.abs(calibrated[vid]))), fmt)

    casts: dict[int, int] = {}
    fuse = set(params.get("fuse", CAST_FUSIBLE))
    producer_index = {v: i for i, op in enumerate(graph.ops) for v in op.outputs}
    for op in list(graph.ops):
        for pos in FP8_OPERANDS.get(op.type, ()):
            vid = op.inputs[pos]
            v = graph.values[vid]
            if v.dtype != "f32":
                continue
            if vid in graph.constants:
                s = scale(vid)
                constants[vid] = fp8.encode(constants[vid], fmt, s)
                v.dtype, v.scale_exp = fmt, s
                continue
            producer = graph.ops[producer_index[vid]] if vid in producer_index else None
            if vid not in casts and _fold(graph, producer, vid, fmt, fuse):
                s = scale(vid)
                producer.attrs.update(to=fmt, scale_exp=s)
                v.dtype, v.scale_exp = fmt, s
                casts[vid] = vid
            if vid not in casts:
                s = scale(vid)
                out = graph.value(f"{v.name}.{fmt}", v.shape, fmt, s)
                cast = Op(0, "cast", f"cast_{v.name}", [vid], [out], {"to": fmt, "scale_exp": s})
                graph.insert_before(producer_index.get(vid, -1) + 1, cast)
                producer_index = {v2: i for i, o in enumerate(graph.ops) for v2 in o.outputs}
                casts[vid] = out
            op.inputs[pos] = casts[vid]
    reg = registry()
    for op in graph.ops:   # re-infer: operand dtypes changed
        for vid, (shape, dtype, s) in zip(op.outputs, reg.get(op.type).infer_types(graph, op)):
            graph.values[vid].shape, graph.values[vid].dtype = tuple(shape), dtype
            if op.type != "cast":
                graph.values[vid].scale_exp = s
    st = params.get("storage", {})
    return CastStoragePolicy(st.get("default", "separate"), dict(st.get("operators", {})),
                             dict(st.get("sites", {})))


@hookimpl
def ipubuild_cast_policies():
    return {"f143": lambda g, c, i, p: place_casts(g, c, i, p, "f143"),
            "f152": lambda g, c, i, p: place_casts(g, c, i, p, "f152")}
