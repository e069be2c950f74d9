"""The host reference: the graph evaluated with numpy in device precision, and the numerical test."""
from __future__ import annotations

import contextlib
import time

import numpy as np
from threadpoolctl import threadpool_limits

from . import tensors
from .artifacts import graph_of, params_of
from ..engine.engine import phase
from .ir import Graph
from ..engine.log import log, progress
from .operators import registry


def evaluate(graph: Graph, constants: dict[int, np.ndarray], inputs: dict[int, np.ndarray],
             *, threads: int | None = None, keep_all: bool = False) -> dict[int, np.ndarray]:
    """Every value (or just the graph outputs) by id, computed by the operators' references."""
    reg = registry()
    values = {**constants, **inputs}
    with threadpool_limits(limits=threads, user_api="blas") if threads else contextlib.nullcontext():
        for n, op in enumerate(graph.ops):
            progress("reference operations", n, len(graph.ops))
            outs = reg.get(op.type).reference(graph, op, [values[i] for i in op.inputs])
            for vid, arr in zip(op.outputs, outs):
                v = graph.values[vid]
                values[vid] = np.asarray(arr).reshape(v.shape)
        progress("reference operations", len(graph.ops), len(graph.ops))
    return values if keep_all else {vid: values[vid] for vid in graph.outputs}


def compare(device: dict[str, np.ndarray], reference: dict[str, np.ndarray]) -> tuple[float, float]:
    """(minimum cosine similarity over output rows, maximum absolute error) over all outputs."""
    cos, err = 1.0, 0.0
    for name, ref in reference.items():
        got = np.asarray(device[name], dtype=np.float64).reshape(-1, ref.shape[-1])
        want = np.asarray(ref, dtype=np.float64).reshape(-1, ref.shape[-1])
        if not np.all(np.isfinite(got)):
            return float("nan"), float("inf")
        num = (got * want).sum(axis=1)
        den = np.linalg.norm(got, axis=1) * np.linalg.norm(want, axis=1)
        rows = np.where(den > 0, num / np.where(den > 0, den, 1), np.where(
            np.linalg.norm(got - want, axis=1) == 0, 1.0, 0.0))
        cos = min(cos, float(rows.min()))
        err = max(err, float(np.abs(got - want).max()))
    return cos, err


def timed_reference(graph, constants, inputs, threads):
    t0 = time.perf_counter()
    log.info("configured host reference BLAS", threads=threads)
    out = evaluate(graph, constants, inputs, threads=threads)
    log.info("evaluated host reference", elapsed_ms=int((time.perf_counter() - t0) * 1000))
    return out


@phase("evaluate_reference", inputs=("graph", "params"), outputs=("reference",),
       config=("numerics.blas_threads",), hooks=("ipubuild_operators",))
def evaluate_reference(ctx):
    """The graph's outputs computed on the host in device precision."""
    g = graph_of(ctx)
    t0 = time.perf_counter()
    consts, inputs = params_of(ctx, g)
    log.info("prepared reference inputs", elapsed_ms=int((time.perf_counter() - t0) * 1000))
    log.plain("referencePrecision=device")
    out = timed_reference(g, consts, inputs, ctx.config["numerics"]["blas_threads"])
    return {"reference": tensors.pack({g.values[v].name: a for v, a in out.items()})}
