"""Decoding the artifacts phases share: the machine description, the graph, its parameters."""
from __future__ import annotations

import functools
import tomllib

from ..engine import canonical
from . import tensors
from .ir import Graph


@functools.lru_cache(maxsize=8)
def _machine(data: bytes) -> dict:
    return tomllib.loads(data.decode())


def machine_of(ctx) -> dict:
    """The ``machine`` input of a phase, parsed (memoised by content)."""
    return _machine(ctx.bytes("machine"))


def graph_of(ctx) -> Graph:
    return Graph.from_json(ctx.json("graph"))


def params_of(ctx, graph: Graph):
    """(constants, inputs) by value id from the ``params`` input."""
    arrays = tensors.unpack(ctx.bytes("params"))
    return ({v: arrays[f"v{v}"] for v in graph.constants}, {v: arrays[f"v{v}"] for v in graph.inputs})


def to_plan_json(value) -> bytes:
    """A large planning artifact (program, exchange schedules and tables, placements, storage,
    code sizes, tile programs) as JSON: ``to_json``'s form (sorted keys, no whitespace) written by
    orjson, several times faster on these lists of integers. It differs from ``to_json`` only in
    writing non-ASCII text as UTF-8 rather than escapes (and floats in orjson's shortest form);
    deterministic, and read by any JSON reader. Package members keep ``to_json``."""
    import orjson
    out = canonical.Json(orjson.dumps(value, option=orjson.OPT_SORT_KEYS))
    out.value = value
    return out


def to_json(value) -> bytes:
    """A phase's JSON output (the value must be JSON-normal: see ``canonical.Json``)."""
    return canonical.encode(value)
