"""The built-in FP8 cast policies: matmul operands in F143 (default) or F152, each tensor with a
power-of-two scale chosen from its absolute maximum on the target's example input. Then the
``fold_casts`` graph pass (after casts, for every target): where the producer of an activation
can write FP8 itself (and every reader wants it in FP8), the cast is folded into the producer's
kernel — no separate step, no sync — for the operator types the target's ``casts.fuse`` lists
(by default every one that can)."""
from __future__ import annotations

from typing import Callable

import numpy as np

from ..graph import fp8
from .. import hookimpl
from ..graph.ir import FP8, CastStoragePolicy, Graph, Op
from ..graph.operators import registry
from ..graph.passes import GraphPass, remove
from ..compiler.targets import CAST_FUSIBLE

#: operators whose listed inputs are cast to FP8 (by input position)
FP8_OPERANDS = {"matmul": (0, 1), "attention_scores": (0,), "attention_context": (0, 1)}


def amax_scale(values: np.ndarray, fmt: str) -> int:
    """The built-in scale rule (``scaling = "amax_pow2"``): the power of two that puts the
    tensor's absolute maximum on the example input at the top of ``fmt``'s range."""
    return fp8.scale_exp_for(float(np.nanmax(np.abs(values))), fmt)


def place_casts(graph: Graph, constants: dict, inputs: dict, params: dict, fmt: str,
                scale_rule: Callable[[np.ndarray, str], int] | None = None,
                operands: dict[str, tuple[int, ...]] | None = None) -> CastStoragePolicy:
    """Cast every FP8 operand (``operands``: ``{operator type: input positions}``, by default
    ``FP8_OPERANDS``) to ``fmt``: constants are stored in FP8 directly; an activation gets a cast
    op right after its producer (the ``fold_casts`` pass then folds it into the producer where
    it can). Each tensor's scale exponent is ``scale_rule(values, fmt)`` over its float32 values
    on the example inputs (by default ``amax_scale``; 0 with ``scaling = "none"``). A cast
    policy of a plugin can call it with its own rule or operands."""
    from ..graph.frontend import float_values
    calibrated = float_values(graph, constants, inputs)
    rule = scale_rule or amax_scale
    operands = FP8_OPERANDS if operands is None else operands

    def scale(vid):
        if params.get("scaling") == "none":
            return 0
        return int(rule(calibrated[vid], fmt))

    casts: dict[int, int] = {}
    producer_index = {v: i for i, op in enumerate(graph.ops) for v in op.outputs}
    for op in list(graph.ops):
        for pos in operands.get(op.type, ()):
            vid = op.inputs[pos]
            v = graph.values[vid]
            if v.dtype != "f32":
                continue
            if vid in graph.constants:
                s = scale(vid)
                constants[vid] = fp8.encode(constants[vid], fmt, s)
                v.dtype, v.scale_exp = fmt, s
                continue
            if vid not in casts:
                s = scale(vid)
                out = graph.value(f"{v.name}.{fmt}", v.shape, fmt, s)
                cast = Op(0, "cast", f"cast_{v.name}", [vid], [out], {"to": fmt, "scale_exp": s})
                graph.insert_before(producer_index.get(vid, -1) + 1, cast)
                producer_index = {v2: i for i, o in enumerate(graph.ops) for v2 in o.outputs}
                casts[vid] = out
            op.inputs[pos] = casts[vid]
    graph.infer()   # operand dtypes changed
    st = params.get("storage", {})
    return CastStoragePolicy(st.get("default", "separate"), dict(st.get("operators", {})),
                             dict(st.get("sites", {})))


def fold_casts(model, target) -> None:
    """Fold each cast to FP8 into the operation that produces its input — no separate step, no
    sync — where the target's ``casts.fuse`` lists that operator, the operator can write the
    FP8 format itself (``Operator.fuses_cast``) and nothing else needs the f32 value (no other
    reader, not a graph output). Bit-exact: the producer's kernel encodes as the cast would."""
    g = model.graph
    fuse = set(target.get("casts", {}).get("fuse", CAST_FUSIBLE))
    producer, readers, reg = g.producer(), g.consumers(), registry()
    folded = []
    for cast in g.ops:
        fmt = cast.attrs.get("to")
        if cast.type != "cast" or fmt not in FP8:
            continue
        vid = cast.inputs[0]
        p = producer.get(vid)
        if p is None or p.type not in fuse or vid in g.outputs or p.outputs != [vid] or readers[vid] != [cast] \
                or not reg.get(p.type).fuses_cast(g, p, fmt):
            continue
        s = cast.attrs.get("scale_exp", 0)
        p.attrs.update(to=fmt, scale_exp=s)
        g.values[vid].dtype, g.values[vid].scale_exp = fmt, s
        folded.append(cast)
    for cast in folded:
        g.replace_uses(cast.outputs[0], cast.inputs[0])
    if folded:
        remove(model, folded)
        g.infer()


@hookimpl
def ipubuild_cast_policies():
    return {"f143": lambda g, c, i, p: place_casts(g, c, i, p, "f143"),
            "f152": lambda g, c, i, p: place_casts(g, c, i, p, "f152")}


@hookimpl
def ipubuild_graph_passes():
    return [GraphPass("fold_casts", fold_casts, stage="cast", order=100, default=True)]
