"""The layout search inside ``plan_package`` (see issue: layout search)."""
from __future__ import annotations

from .planning.program import default_layout


def search_layout(ctx, graph) -> dict:
    return default_layout(graph, ctx.config["target"]["tile_count"])
