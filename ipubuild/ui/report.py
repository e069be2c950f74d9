"""The device profile as pictures: the data an HTML report draws, the phase that writes it, and
the plain-text table of ``doit profile:<target>``.

``report_data`` gathers, from the build's artifacts, what the page shows: cycles per BSP step
(exchange, slowest tile's compute, sync), compute cycles per tile and step (a heatmap, rows
grouped when there are many tiles), each used tile's memory map (reserved, code, constants, data
and exchange buffers, free), the search's convergence and the largest exchanges. It is a pure
function of its inputs and canonical, so the page (``report_page.render``) is byte-identical for
the same build.
"""
from __future__ import annotations

import heapq
import itertools
import json
from pathlib import Path

import numpy as np

from ..graph.artifacts import buffer_names, machine_of
from ..graph.placement import placement_of
from ..graph.program_buffers import CODE, SIZE, buffers_of
from ..engine.engine import phase
from ..engine.errors import UserError
from .report_page import render

MAX_HEATMAP_ROWS = 128        # more used tiles than this: rows are groups of consecutive tiles
MAX_HEATMAP_COLUMNS = 512     # more steps than this: columns are groups of consecutive steps
TOP_EXCHANGES = 25
TOP_EXCHANGE_STEPS = 10

# memory kinds; "shared": bytes that data and exchange buffers use at different times (buffers
# whose lifetimes do not overlap may share addresses)
KINDS = ("reserved", "code", "constants", "data", "exchange", "shared", "free")
_BUFFER_KIND = {"c": "constants", "i": "data", "o": "data", "g": "exchange"}


def has_steps(profile) -> bool:
    """Whether a device profile carries per-step figures as the simulator's does (``steps``: name,
    exchange, slowest, sync, ``compute`` per tile); a backend need only report totals."""
    steps = profile.get("steps") if isinstance(profile, dict) else None
    return isinstance(steps, list) and all(
        isinstance(s, dict) and isinstance(s.get("name"), str)
        and all(type(s.get(k)) is int for k in ("exchange", "slowest", "sync"))
        and isinstance(s.get("compute", {}), dict) and all(type(v) is int for v in s.get("compute", {}).values())
        for s in steps)


def step_series(steps: list[dict]) -> dict:
    """Per step: name, exchange cycles, slowest tile's compute cycles, sync cycles."""
    return {"names": [s["name"] for s in steps], "exchange": [s["exchange"] for s in steps],
            "compute": [s["slowest"] for s in steps], "sync": [s["sync"] for s in steps]}


def _groups(n: int, limit: int) -> list[tuple[int, int]]:
    """``[start, end)`` index ranges: one per item, or equal groups when there are more than ``limit``."""
    size = max(1, -(-n // limit))
    return [(i, min(i + size, n)) for i in range(0, n, size)]


def heatmap(steps: list[dict]) -> dict:
    """Compute cycles per (tile, step) for the tiles that compute; a cell of grouped rows or
    columns holds the group's maximum (the slowest tile is what a BSP step waits for)."""
    tiles = sorted({int(t) for s in steps for t in s.get("compute", {})})
    rows, cols = _groups(len(tiles), MAX_HEATMAP_ROWS), _groups(len(steps), MAX_HEATMAP_COLUMNS)
    values = []
    for r0, r1 in rows:
        keys = [str(t) for t in tiles[r0:r1]]
        for c0, c1 in cols:
            values.append(max((steps[s].get("compute", {}).get(k, 0) for s in range(c0, c1) for k in keys),
                              default=0))
    return {"tiles": len(tiles), "rows": [[tiles[r0], tiles[r1 - 1]] for r0, r1 in rows],
            "columns": [[c0, c1 - 1] for c0, c1 in cols],
            "tiles_per_row": rows[0][1] - rows[0][0] if rows else 1,
            "steps_per_column": cols[0][1] - cols[0][0] if cols else 1,
            "values": values, "max": max(values, default=0)}


def _complement(ranges, lo: int, hi: int) -> list[tuple[int, int]]:
    out, cursor = [], lo
    for a, b in sorted(tuple(r) for r in ranges):
        if a > cursor:
            out.append((cursor, a))
        cursor = max(cursor, b)
    if cursor < hi:
        out.append((cursor, hi))
    return out


def _kind(counts: list[int]) -> int:
    """The kind of bytes covered ``counts[kind]`` times."""
    data, exchange = KINDS.index("data"), KINDS.index("exchange")
    if counts[data] and counts[exchange]:
        return KINDS.index("shared")
    return next((k for k, c in enumerate(counts) if c > 0), KINDS.index("free"))


def _runs(pieces, lo: int, hi: int) -> list[int]:
    """``[kind, bytes, kind, bytes, …]`` covering ``[lo, hi)`` from ``(start, end, kind index)``
    pieces; where pieces overlap the lower kind index wins, except that data and exchange make
    "shared"; uncovered bytes are free."""
    events = sorted((p, k, d) for s, e, k in pieces if s < e for p, d in ((s, 1), (e, -1)))
    counts = [0] * len(KINDS)
    out: list[int] = []

    def emit(kind, length):
        if length <= 0:
            return
        if out and out[-2] == kind:
            out[-1] += length
        else:
            out.extend((kind, length))

    pos = lo
    for x, group in itertools.groupby(events, key=lambda ev: ev[0]):
        x = min(max(x, lo), hi)
        emit(_kind(counts), x - pos)
        for _, k, d in group:
            counts[k] += d
        pos = x
    emit(_kind(counts), hi - pos)
    return out


def memory_maps(program: dict, storage: dict, code_sizes: dict, machine: dict) -> dict:
    """Each used tile's memory from ``sram_base`` to ``sram_end`` as runs of ``KINDS``: reserved
    (runtime, host handler, alignment padding, beyond the loader limit), code (kernels, tile
    program, exchange tables), constants, data (inputs and outputs of operations), exchange
    (buffers the exchange gathers into), shared (data and exchange at different times), free."""
    mem = machine["memory"]
    lo, hi, align = mem["sram_base"], mem["sram_end"], mem["alignment"]
    k = {name: i for i, name in enumerate(KINDS)}
    tiles = []
    buffers = buffers_of(program)
    storage = placement_of(storage)
    for tile in sorted(storage.tiles, key=int):
        placed = storage.tiles[tile]
        rows = buffers.rows(tile) if tile in buffers else buffers.table[:0]
        if not len(rows) and not placed["code_bytes"]:
            continue
        r = placed["ranges"]
        code = (r["code_address"], r["code_end"])
        pieces = [(a, b, k["reserved"]) for a, b in _complement([*r["available_ranges"], code], lo, hi)]
        pieces.append((*code, k["code"]))
        for bid, addr, size in zip(buffer_names(rows[:, CODE]), storage.of(rows[:, CODE]).tolist(), rows[:, SIZE].tolist()):
            pieces.append((addr, addr + -(-max(size, 1) // align) * align, k[_BUFFER_KIND[bid[0]]]))
        sizes = code_sizes.get(tile, {})
        tiles.append({"tile": int(tile), "runs": _runs(pieces, lo, hi),
                      "code": [sizes.get("kernel_bytes", 0), sizes.get("program_bytes", 0),
                               sizes.get("exchange_table_bytes", 0)]})
    return {"base": lo, "end": hi, "kinds": list(KINDS), "tiles": tiles}


def _busiest(bytes_per_tile: np.ndarray) -> list[int]:
    """``[tile, bytes]`` of the tile with the most bytes (the lowest such tile)."""
    tile = int(np.argmax(bytes_per_tile))
    return [tile, int(bytes_per_tile[tile])]


def top_exchanges(program: dict, limit: int = TOP_EXCHANGES) -> dict:
    """The largest exchanges, bytes moved per (step, source tile, destination tile, value); and
    the steps that move the most bytes, with their busiest sending and receiving tiles (the
    busiest port bounds an exchange phase)."""
    buffers = buffers_of(program)
    per_step, steps, best, count = [], [], [], 0
    for s, step in enumerate(program["steps"]):
        t = np.asarray(step["transfers"], dtype=np.int64).reshape(-1, 10)
        nbytes = t[:, 8] * t[:, 9]
        per_step.append(int(nbytes.sum()))
        if not len(t):
            continue
        sent, received = np.bincount(t[:, 0], weights=nbytes), np.bincount(t[:, 4], weights=nbytes)
        steps.append({"step": s, "name": step["name"], "bytes": per_step[-1], "transfers": len(t),
                      "sender": _busiest(sent), "receiver": _busiest(received)})
        remote = t[t[:, 0] != t[:, 4]]          # the largest exchanges: between tiles, not on-tile copies
        if not len(remote):
            continue
        sources, which = _unique_rows(remote[:, [0, 1]])
        names = [program["names"].get(v, v) for v in buffers.values_of(sources[:, 0], sources[:, 1])]
        vnames, value_ids = np.unique(np.array(names, dtype=object), return_inverse=True)
        keys, total = _unique_rows(np.stack([remote[:, 0], remote[:, 4], value_ids[which]], axis=1))
        moved = np.bincount(total, weights=remote[:, 8] * remote[:, 9]).astype(np.int64)
        count += len(keys)
        # the step's largest, ties by (source, destination, value): keys are in that order
        largest = np.lexsort((np.arange(len(keys)), -moved))[:limit]
        best.extend((-int(moved[i]), (s, *keys[i, :2].tolist(), vnames[keys[i, 2]])) for i in largest.tolist())
    top = heapq.nsmallest(limit, best)
    return {"total_bytes": sum(per_step), "bytes_per_step": per_step, "count": count,
            "steps": heapq.nsmallest(TOP_EXCHANGE_STEPS, steps, key=lambda e: (-e["bytes"], e["step"])),
            "top": [{"step": s, "name": program["steps"][s]["name"], "from": src, "to": dst, "value": v,
                     "bytes": -n} for n, (s, src, dst, v) in top]}


def _unique_rows(a: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``np.unique(a, axis=0, return_inverse=True)`` of a non-negative int array, its columns
    packed into one int64 a row where they fit (``axis=0`` sorts rows as records: on ViT-B/16
    it was most of the report's 21 s)."""
    a = np.asarray(a, dtype=np.int64)
    bits = [max(int(c.max(initial=0)), 1).bit_length() for c in a.T]
    if sum(bits) > 62 or (a < 0).any():
        rows, inverse = np.unique(a, axis=0, return_inverse=True)
        return rows, inverse.ravel()
    packed = np.zeros(len(a), np.int64)
    for column, width in zip(a.T, bits):
        packed = (packed << width) | column
    keys, inverse = np.unique(packed, return_inverse=True)
    rows = np.empty((len(keys), a.shape[1]), np.int64)
    for j in range(a.shape[1] - 1, -1, -1):
        rows[:, j] = keys & ((1 << bits[j]) - 1)
        keys = keys >> bits[j]
    return rows, inverse.ravel()


def plan_rows(graph: dict, layout: dict, tile_count: int) -> list[list]:
    """Each operation's plan in ``layout``, as the page lists it: ``[operation, type, plan, tiles,
    first tile]``. A matmul's grid reads rows × columns × K-slices; a plan that follows its
    producer's blocks names the producer (its tiles are the producer's)."""
    from ..compiler.planning.program import plans_of
    from ..graph.ir import Graph
    g = Graph.from_json(graph)
    plans, producer, rows = plans_of(g, tile_count), g.producer(), []
    for op in g.ops:
        choice = layout["ops"][str(op.id)]
        plan = plans[op.id][choice["plan"]]
        if "follow" in plan:
            source = producer.get(op.inputs[plan["follow"]])
            rows.append([op.name, op.type, f"follows {source.name if source else 'its input'}'s blocks", "", ""])
        else:
            rows.append([op.name, op.type, describe_plan(plan), plan_tiles(plan), choice["offset"]])
    return rows


def describe_plan(plan: dict) -> str:
    """A plan in a few words: ``2 × 32 × 1 grid (rows × columns × K-slices)`` for a matmul's,
    ``61 × 2 grid a head (rows × columns)`` for attention's on a grid, ``64 row blocks`` for a
    row-wise one's, else its scalar settings."""
    if {"m", "n", "k"} <= set(plan):
        aligned = ", 32-column aligned" if plan.get("aligned") else ""
        return f"{plan['m']} × {plan['n']} × {plan['k']} grid (rows × columns × K-slices{aligned})"
    if {"rows", "cols", "tiles"} == set(plan):
        return f"{plan['rows']} × {plan['cols']} grid a head (rows × columns)"
    if set(plan) in ({"rows"}, {"patches"}):
        (key, count), = plan.items()
        return f"{count} {'row blocks' if key == 'rows' else 'runs of patches'}"
    return ", ".join(f"{k} {v}" for k, v in sorted(plan.items()) if isinstance(v, (int, str)) and not isinstance(v, bool)) \
        or _compact(plan)


def plan_tiles(plan: dict):
    """The tiles a plan spans, where the plan says it (a grid, or a count of rows or patches)."""
    if {"m", "n", "k"} <= set(plan):
        return plan["m"] * plan["n"] * plan["k"]
    if isinstance(plan.get("tiles"), int):          # attention: its heads' tiles together
        return plan["tiles"]
    counts = [v for k, v in plan.items() if k in ("rows", "patches") and isinstance(v, int)]
    return counts[0] if counts else ""


def _compact(plan: dict, limit: int = 60) -> str:
    text = json.dumps(plan, sort_keys=True, separators=(",", ":"))
    return text if len(text) <= limit else text[:limit - 1] + "…"


def report_data(name: str, device: str, profile: dict, cost: dict, program: dict, storage: dict,
                code_sizes: dict, machine: dict, search: dict, kernel_profile: dict | None = None,
                plans: list | None = None) -> dict:
    """Everything the report page shows (canonical JSON values only). Steps come from the device's
    profile; from the cost model (without per-tile compute) if the device reports only totals.
    ``plans``: ``plan_rows``."""
    measured = has_steps(profile)
    steps = profile["steps"] if measured else [
        {"name": s["name"], "exchange": s["exchange"], "slowest": s["compute"], "sync": s["sync"], "compute": {}}
        for s in cost["steps"]]
    memory = memory_maps(program, storage, code_sizes, machine)
    return {
        "target": name, "final_cycles": cost["final_cycles"], "lower_bound": cost["lower_bound"],
        "final_exchange": cost["final_exchange"], "device": device, "device_cycles": profile.get("total_cycles"),
        "tiles": profile.get("tiles"), "tile_count": program["tile_count"], "tiles_used": len(memory["tiles"]),
        "clock_hz": machine["clock_hz"], "steps_from": "device" if measured else "cost model",
        "steps": step_series(steps), "heatmap": heatmap(steps), "memory": memory,
        "search": {"initial_cycles": search["initial_cycles"], "history": search["history"],
                   "heuristics": search.get("heuristics", {})},
        "exchanges": top_exchanges(program),
        "kernels": kernel_profile or {"kernels": {}, "notes": [], "measure": ""},
        "plans": plans or []}


@phase("report_profile", inputs=("profile", "cost", "program", "storage", "code_sizes", "machine", "search",
                                 "kernel_profile", "graph", "layout"),
       outputs=("report",), config=("name", "target.device", "target.tile_count"), hooks=("ipubuild_operators",))
def report_profile(ctx):
    """The profile as one self-contained HTML page (``<target>.profile.html``)."""
    plans = plan_rows(ctx.json("graph"), ctx.json("layout"), ctx.config["target"]["tile_count"])
    data = report_data(ctx.config["name"], ctx.config["target"]["device"], ctx.json("profile"), ctx.json("cost"),
                       ctx.json("program"), ctx.json("storage"), ctx.json("code_sizes"), machine_of(ctx),
                       ctx.json("search"), ctx.json("kernel_profile"), plans)
    return {"report": render(data).encode()}


# doit profile:<target> -------------------------------------------------------------------------
def read_profile(path: Path, target: str, shown: str | None = None) -> dict:
    """A built profile (``<target>.profile.json``), or a one-line error naming it as ``shown``."""
    shown = shown or str(path)
    try:
        profile = json.loads(Path(path).read_bytes())
    except FileNotFoundError:
        raise UserError(shown, f"no profile yet; run `doit build:{target}` first") from None
    except (OSError, ValueError) as exc:
        raise UserError(shown, f"not a readable profile ({type(exc).__name__}); "
                        f"run `doit build:{target}` to rewrite it") from None
    if not has_steps(profile):
        raise UserError(shown, "holds no per-step figures (a device backend may report only totals); "
                        f"if it came from ipumodel, run `doit build:{target}` to rewrite it")
    return profile


def top_steps_table(profile: dict, top: int = 10) -> list[str]:
    """The ``top`` steps by cycles (exchange + compute + sync), as aligned text lines."""
    steps = [(i, s["name"], s["exchange"], s["slowest"], s["sync"], s["exchange"] + s["slowest"] + s["sync"])
             for i, s in enumerate(profile["steps"])]
    total = sum(s[5] for s in steps)
    picked = sorted(steps, key=lambda s: (-s[5], s[0]))[:top]
    head = ("step", "exchange", "compute", "sync", "total", "share")
    rows = [(f"{i} {name}", str(x), str(c), str(y), str(t), f"{100 * t / max(1, total):.1f} %")
            for i, name, x, c, y, t in picked]
    widths = [max(len(r[j]) for r in [head, *rows]) for j in range(len(head))]
    lines = ["  ".join(c.ljust(widths[j]) if j == 0 else c.rjust(widths[j]) for j, c in enumerate(r))
             for r in [head, *rows]]
    part = sum(s[5] for s in picked)
    lines.append(f"top {len(picked)} of {len(steps)} steps: {100 * part / max(1, total):.1f} % of {total} cycles")
    return lines
