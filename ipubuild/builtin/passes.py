"""The built-in graph passes that concern every model: ``prune`` removes what a rewrite left
unused. (The cast stage's ``fold_casts`` lives with the cast policies, in ``casts.py``.)"""
from __future__ import annotations

from .. import hookimpl
from ..graph.passes import GraphPass, prune


def prune_model(model, target) -> None:
    """Remove the operations, constants and values nothing uses (a rewrite that replaced an
    operation leaves its old inputs behind), renumbering values in order."""
    prune(model)


@hookimpl
def ipubuild_graph_passes():
    return [GraphPass("prune", prune_model, stage="float", order=1000, default=True)]
