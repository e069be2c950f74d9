"""The built-in graph passes that concern every model: ``prune`` removes what a rewrite left
unused; for the targets that list them, ``fold_activations`` folds a GELU into the matmul
before it and ``fold_adds`` an add (a residual add, a positional embedding) into the operation
before it. (The cast stage's ``fold_casts`` lives with the cast policies, in ``casts.py``.)"""
from __future__ import annotations

from .. import hookimpl
from ..compiler.targets import CAST_FUSIBLE
from ..graph.operators import registry
from ..graph.passes import GraphPass, prune, remove


def prune_model(model, target) -> None:
    """Remove the operations, constants and values nothing uses (a rewrite that replaced an
    operation leaves its old inputs behind), renumbering values in order."""
    prune(model)


def fold_adds(model, target) -> None:
    """Fold each ``add`` of two values of one shape into the operation that produces one of
    them, where that operation can take an addend (``Operator.fuses_addend``), nothing else
    reads its output and the other value exists before it runs: one step and one sync fewer.
    Bit-exact: the operation adds the addend last, as the add did. Not a default: the sum then
    takes the product's blocks, and where those split columns (a matmul grid) the next
    row-wise operation (a layer norm) exchanges what it would have found on its tiles, and
    ViT-B/16's greedy initial placement does worse with any change of its graph
    (``docs/architecture.md``, "Epilogues folded into producers")."""
    g = model.graph
    reg = registry()
    index = {id(op): i for i, op in enumerate(g.ops)}
    producer, readers = g.producer(), g.consumers()
    folded = []
    for add in g.ops:
        if add.type != "add" or len(add.inputs) != 2 or add.inputs[0] == add.inputs[1]:
            continue
        x, y = (g.values[v] for v in add.inputs)
        if x.shape != y.shape or x.dtype != "f32" or y.dtype != "f32":
            continue
        for vid, other in ((add.inputs[1], add.inputs[0]), (add.inputs[0], add.inputs[1])):
            p = producer.get(vid)
            if p is None or p.outputs != [vid] or vid in g.outputs or readers[vid] != [add] \
                    or not reg.get(p.type).fuses_addend(g, p):
                continue
            q = producer.get(other)
            if q is not None and index[id(q)] > index[id(p)]:
                continue                  # the addend is made after the product: it cannot wait
            p.inputs.append(other)
            p.attrs["addend"] = True
            p.outputs = list(add.outputs)
            folded.append(add)
            producer[add.outputs[0]] = p          # an add reading the sum may fold into p's reader
            readers[other] = [p if r is add else r for r in readers[other]]
            break
    remove(model, folded)


def fold_activations(model, target) -> None:
    """Fold each GELU into the operation that produces its input, where that operation can
    apply it (``Operator.fuses_activation``) and nothing else reads its output: one step and one
    sync fewer. A cast folded into the GELU moves with it (where ``[casts] fuse`` lets that
    operator write FP8, and it can; else the GELU stays). Bit-exact: the operation computes the
    GELU as the gelu kernel does. Not a default: it changes ViT-B/16's graph, and the greedy
    initial placement there is sensitive to any change of the operations' count (their code
    budgets are shares of the operations placed)."""
    g = model.graph
    reg = registry()
    fuse = set(target.get("casts", {}).get("fuse", CAST_FUSIBLE))
    producer, readers = g.producer(), g.consumers()
    folded = []
    for act in g.ops:
        if act.type != "gelu" or len(act.inputs) != 1:
            continue
        vid = act.inputs[0]
        p = producer.get(vid)
        if p is None or p.outputs != [vid] or vid in g.outputs or readers[vid] != [act] \
                or g.values[vid].shape != g.values[act.outputs[0]].shape \
                or not reg.get(p.type).fuses_activation(g, p, act.type):
            continue
        if "to" in act.attrs and (p.type not in fuse or not reg.get(p.type).fuses_cast(g, p, act.attrs["to"])):
            continue                  # the GELU's folded cast could not move with it
        p.attrs["activation"] = act.type
        if "to" in act.attrs:
            p.attrs.update(to=act.attrs["to"], scale_exp=act.attrs.get("scale_exp", 0))
        p.outputs = list(act.outputs)
        folded.append(act)
    remove(model, folded)


@hookimpl
def ipubuild_graph_passes():
    return [GraphPass("prune", prune_model, stage="float", order=1000, default=True),
            GraphPass("fold_activations", fold_activations, stage="cast", order=150),
            GraphPass("fold_adds", fold_adds, stage="cast", order=200)]
