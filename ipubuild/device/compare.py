"""The per-operation comparison: every operation's output, read back from the device after the
step that wrote it, against the operation's reference evaluated on the device's own inputs.

Each operation is judged by itself: its reference (``Operator.reference``) runs on the values
the device gave its inputs (constants and graph inputs as the host has them), so a difference
upstream never shows up downstream, and the first operation that fails is where the device went
wrong. How far the device may be from the reference is the operator's ``tolerance``: a bound on
the f32 (or f16) result that follows from its arithmetic — accumulation order over its reduction
length, library functions' last bits — and is zero where the kernel must be bit-exact (copies,
casts, adds). An FP8 output (a cast folded into the operation) must be a code that some value
within that bound of the f32 reference encodes to: the reference's code, or its neighbour where
the f32 value lies within the bound of a rounding boundary. An FP8 output without a folded cast
(a cast, a copy of FP8 values) must match code for code.

``map_values`` records, for every value an operation writes, the blocks that hold it after each
step (tile, address, matrix block, the vertices that wrote it and their kernel variant): the
device reads them back (``probes``), and a verdict names the tile, vertex and kernel variant that
computed an element.
"""
from __future__ import annotations

import numpy as np

from ..graph import fp8
from ..graph.artifacts import graph_of, to_json
from ..graph.placement import placement_of
from ..engine.engine import phase
from ..graph.ir import DTYPES, FP8, Graph, Op
from ..graph.operators import registry

# compare = "auto": operations when the values read back take at most this many bytes. The
# one-block targets read back 3.2 MiB (vit_fp8: about 0.25-0.5 s more a build); a 12-block ViT
# on 1472 tiles 31 MiB, ViT-B/16 123 MiB (about 10 s more a build: benchmarks/numerics.py), off
# unless the target says compare = "operations".
AUTO_LIMIT_BYTES = 16 << 20
MODES = ("auto", "operations", "outputs")


@phase("map_values", inputs=("graph", "program", "storage"), outputs=("value_map",), config=("numerics.compare",))
def map_values(ctx):
    """Where each value an operation computes lies when the step that writes it ends, and
    (``bytes``) how much they take; no values when the comparison is of the graph's outputs only
    (the map of a 12-block ViT on 1472 tiles takes seconds)."""
    g = graph_of(ctx)
    size = sum(int(np.prod(g.values[v].shape, dtype=np.int64)) * DTYPES[g.values[v].dtype]
               for op in g.ops for v in op.outputs)
    if mode(ctx.config["numerics"]["compare"], {"bytes": size})[0] == "outputs":
        return {"value_map": to_json({"values": [], "bytes": size})}
    return {"value_map": to_json({**value_map(g, ctx.json("program"), ctx.json("storage")), "bytes": size})}


def value_map(graph: Graph, program: dict, storage: dict) -> dict:
    """``{"values": [...]}`` in program order: per value written by an operation, its ``value``
    id, ``name``, ``op`` (name), ``dtype``, ``shape``, ``scale_exp``, ``kernels`` (the variants
    its operation ran, every stage) and ``blocks`` — ``[tile, address, r0, r1, c0, c1, step,
    first vertex, end vertex, kernel index]``: the block ``[r0:r1, c0:c1]`` of the value as a
    matrix, stored row-major at ``address`` on ``tile`` after ``step``, written by that tile's
    vertices ``[first, end)`` of that step, the first of which runs ``kernels[kernel index]``."""
    placed = placement_of(storage)
    names = program["kernels"]
    out: dict[int, dict] = {}
    for s, step in enumerate(program["steps"]):
        op = graph.ops[step["op"]]
        vertices = step["vertices"]
        kernels = sorted({names[k] for k in set(vertices[:, 1].tolist())})
        for tile, buffer, vid, r0, r1, c0, c1, v0, v1 in step["writes"].tolist():
            if vid < 0:
                continue            # an operation's temporary (partial sums): not a value
            v = graph.values[vid]
            entry = out.setdefault(vid, {"value": vid, "name": v.name, "op": op.name, "dtype": v.dtype,
                                         "shape": list(v.shape), "scale_exp": v.scale_exp, "kernels": [],
                                         "blocks": []})
            first = names[vertices[int(np.searchsorted(vertices[:, 0], tile)) + v0, 1]] if v0 < v1 else ""
            entry["blocks"].append([tile, int(placed.addresses[buffer]), r0, r1, c0, c1, s, v0, v1, first])
        for vid in op.outputs:
            if vid in out:
                out[vid]["kernels"] = sorted(set(out[vid]["kernels"]) | set(kernels))
    for entry in out.values():
        names = entry["kernels"]
        for b in entry["blocks"]:
            b[9] = names.index(b[9]) if b[9] in names else -1
    return {"values": [out[v] for op in graph.ops for v in op.outputs if v in out]}


def probes(vmap: dict) -> dict[int, list[dict]]:
    """What a device reads back, by step (``ipubuild_device_backends``): ``{step: [{"name",
    "dtype", "shape", "blocks": [[tile, address, r0, r1, c0, c1], ...]}]}``, each value named
    ``v<id>``."""
    out: dict[int, dict[str, dict]] = {}
    for v in vmap["values"]:
        key = f"v{v['value']}"
        for tile, addr, r0, r1, c0, c1, s, *_ in v["blocks"]:
            probe = out.setdefault(s, {}).setdefault(key, {"name": key, "dtype": v["dtype"], "shape": v["shape"],
                                                           "blocks": []})
            probe["blocks"].append([tile, addr, r0, r1, c0, c1])
    return {s: list(ps.values()) for s, ps in sorted(out.items())}


def read_back_bytes(vmap: dict) -> int:
    """Bytes of every value the per-operation comparison reads back (``bytes``: every value an
    operation computes, as ``map_values`` counts them)."""
    if "bytes" in vmap:
        return vmap["bytes"]
    return sum(int(np.prod(v["shape"], dtype=np.int64)) * DTYPES[v["dtype"]] for v in vmap["values"])


def mode(setting: str, vmap: dict) -> tuple[str, str]:
    """``(mode, why)``: ``"operations"`` or ``"outputs"`` for a ``numerics.compare`` setting, and
    why outputs only (empty when operations)."""
    if setting == "outputs":
        return "outputs", 'numerics.compare = "outputs"'
    size = read_back_bytes(vmap)
    if setting == "auto" and size > AUTO_LIMIT_BYTES:
        return "outputs", (f"numerics.compare = \"auto\": its operations' values take {size >> 20} MiB, "
                           f"more than {AUTO_LIMIT_BYTES >> 20} MiB")
    return "operations", ""


# the comparison -------------------------------------------------------------------------------
def _show(x) -> str:
    return f"{float(x):.9g}"


def _unfused(op: Op) -> Op:
    """The operation without its folded cast: its reference is the f32 value it encodes."""
    attrs = {k: v for k, v in op.attrs.items() if k not in ("to", "scale_exp")}
    return Op(op.id, op.type, op.name, list(op.inputs), list(op.outputs), attrs)


def _ordinal(codes: np.ndarray) -> np.ndarray:
    """FP8 codes as integers in value order (sign and magnitude; the NaN code 0x80 is 0 here)."""
    c = codes.astype(np.int64)
    return np.where(c & 0x80, -(c & 0x7F), c)


def _widen(x: np.ndarray, toward: float) -> np.ndarray:
    """float64 ``x`` as float32, rounded away from ``x`` toward ``toward`` (±inf) if inexact."""
    with np.errstate(over="ignore", invalid="ignore"):
        y = x.astype(np.float32)
        inexact = (y.astype(np.float64) != x) & np.isfinite(x)
        return np.where(inexact, np.nextafter(y, np.float32(toward)), y)


def judge(dev: np.ndarray, value, ref: np.ndarray, bound=None) -> dict:
    """One output: ``dev`` (the device's; FP8 as codes) against ``ref`` (the reference's). For a
    float output, and an FP8 one with a folded cast, ``bound()`` — called only if some element
    differs — gives ``(pre, tol)``: the f32/f16 reference before any cast and its tolerance;
    without it (an FP8 output without a folded cast) codes must match. The elements compared,
    those that differ from the reference and those that fail, and the failing element furthest
    outside its tolerance (``worst``: flat index, expected, got, and the tolerance, or for FP8
    the ulps outside it); ``ratio``, for a float output that differs, is the largest difference
    over its tolerance (below 1 passes)."""
    n = int(np.size(dev))
    fp8_out = value.dtype in FP8
    with np.errstate(invalid="ignore", over="ignore"):
        if fp8_out:
            d, want = np.asarray(dev, np.uint8).reshape(-1), np.asarray(ref, np.uint8).reshape(-1)
            odd = np.flatnonzero(d != want)
        else:
            g, want = np.asarray(dev, np.float64).reshape(-1), np.asarray(ref, np.float64).reshape(-1)
            odd = np.flatnonzero((g != want) & ~(np.isnan(g) & np.isnan(want)))
        out = {"elements": n, "differ": int(odd.size), "failed": 0}
        if not odd.size:
            return out
        if bound is None:
            pre = tol = None
        else:
            pre, tol = bound()
            pre = np.asarray(pre, np.float64).reshape(-1)[odd]
            tol = np.broadcast_to(np.asarray(tol, np.float64), np.shape(ref)).reshape(-1)[odd]
        if fp8_out:
            got, ref_nan, dev_nan = _ordinal(d[odd]), want[odd] == fp8.NAN_CODE, d[odd] == fp8.NAN_CODE
            if pre is None:
                lo = hi = _ordinal(want[odd])
            else:
                lo = _ordinal(fp8.encode(_widen(pre - tol, -np.inf), value.dtype, value.scale_exp))
                hi = _ordinal(fp8.encode(_widen(pre + tol, np.inf), value.dtype, value.scale_exp))
            excess = np.maximum(np.maximum(lo - got, got - hi), 0).astype(np.float64)
            excess = np.where(ref_nan | dev_nan, np.inf, excess)
        else:
            diff = np.abs(g[odd] - want[odd])
            diff = np.where(np.isnan(diff), np.inf, diff)
            excess = np.where(diff > tol, diff - tol, 0.0)
            fin = np.isfinite(diff) & (tol > 0)
            out["ratio"] = f"{float(np.max(diff[fin] / tol[fin])) if fin.any() else float('inf'):.4g}"
        failed = excess > 0
        out["failed"] = int(np.count_nonzero(failed))
        if out["failed"]:
            k = int(np.argmax(excess))
            i = int(odd[k])
            if fp8_out:
                decode = lambda c: _show(fp8.decode(np.uint8(c), value.dtype, value.scale_exp))  # noqa: E731
                out["worst"] = {"index": i, "expected": decode(want[i]), "got": decode(d[i]),
                                "ulps": "inf" if not np.isfinite(excess[k]) else str(int(excess[k])),
                                "expected_code": int(want[i]), "got_code": int(d[i])}
            else:
                out["worst"] = {"index": i, "expected": _show(want[i]), "got": _show(g[i]),
                                "tolerance": _show(tol[k]), "error": _show(diff[k])}
        return out


def where_computed(entry: dict, index: int) -> dict:
    """The tile, step, vertex and kernel variant that wrote element ``index`` (flat) of a value."""
    cols = entry["shape"][-1] if entry["shape"] else 1
    r, c = divmod(index, cols)
    for tile, _, r0, r1, c0, c1, step, v0, v1, k in entry["blocks"]:
        if r0 <= r < r1 and c0 <= c < c1:
            kernel = entry["kernels"][k] if k >= 0 else "?"
            return {"tile": tile, "step": step, "vertex": v0 if v1 - v0 == 1 else [v0, v1 - 1], "kernel": kernel}
    return {}


def operation_reference(graph: Graph, op, operator, args: list) -> tuple[bool, object, list, list]:
    """An operation's reference on ``args``: ``(folded, plain, outputs, expected)`` — whether a
    cast is folded into it, the operation without that cast, its reference outputs, and what the
    device must write (a folded cast's reference is the operation's, encoded: ``Operator.fuses_cast``)."""
    folded = (op.attrs.get("to") in FP8 and graph.values[op.outputs[0]].dtype in FP8
              and operator.fuses_cast(graph, op, op.attrs["to"]))
    plain = _unfused(op) if folded else op
    outputs = operator.reference(graph, plain, args)
    expected = ([fp8.encode(outputs[0], op.attrs["to"], op.attrs.get("scale_exp", 0)), *outputs[1:]]
                if folded else outputs)
    return folded, plain, outputs, expected


def check_operations(graph: Graph, constants: dict, inputs: dict, device: dict, vmap: dict) -> dict:
    """Every operation's output on the device (``device``: arrays by ``v<id>``) against its
    reference on the device's inputs: ``{"compared": n, "diverged": [names], "first": {...},
    "each": [...]}`` — ``first`` the first operation in program order that fails (its value,
    worst element, expected and got, and the tile, vertex and kernel variant that computed it)."""
    reg = registry()
    entries = {e["value"]: e for e in vmap["values"]}
    # aligned copies: arrays unpacked from a blob may sit at odd addresses, which BLAS refuses
    values = {v: np.require(a, requirements="AC") for v, a in {**constants, **inputs}.items()}
    device = {k: np.require(a, requirements="AC") for k, a in device.items()}
    each, diverged, first = [], [], None
    for op in graph.ops:
        operator = reg.get(op.type)
        args = [values[v] for v in op.inputs]
        folded, plain, pres, refs = operation_reference(graph, op, operator, args)
        tols = []

        def bound(i, plain=plain, args=args, pres=pres, tols=tols):
            if not tols:
                tols.extend(operator.tolerance(graph, plain, args, pres))
            return pres[i], tols[i]
        for i, vid in enumerate(op.outputs):
            v = graph.values[vid]
            ref = np.asarray(refs[i]).reshape(v.shape)
            got = device.get(f"v{vid}") if vid in entries else None
            values[vid] = np.asarray(got).reshape(v.shape) if got is not None else ref
            if got is None:
                continue
            exact_codes = v.dtype in FP8 and not (folded and i == 0)
            result = judge(got, v, ref, None if exact_codes else (lambda i=i: bound(i)))
            row = {"op": op.name, "type": op.type, "value": v.name, "dtype": v.dtype, **result}
            if "worst" in row:
                w = row["worst"]
                w["element"] = [int(x) for x in np.unravel_index(w.pop("index"), v.shape)]
                w.update(where_computed(entries[vid], int(np.ravel_multi_index(w["element"], v.shape))))
                w["kernels"] = entries[vid]["kernels"]
                diverged.append(op.name)
                first = first or row
            each.append(row)
    return {"compared": len(each), "diverged": diverged, "first": first, "each": each}
