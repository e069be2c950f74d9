"""Tile memory: the address ranges a tile offers, and liveness-based buffer allocation.

Code (the host-exchange handler, kernels, the tile program, exchange tables) goes in the
executable region below ``executable_end``; data goes in the ranges the runtime leaves free and
above the code, up to the loader limit. Buffers whose lifetimes (in program steps) overlap never
share bytes; others may.
"""
from __future__ import annotations

import bisect

import numpy as np

from ...engine.errors import UserError
from ...engine import canonical
from ...graph.artifacts import buffer_codes, buffer_names
from ...graph.placement import placement_of
from ...graph.program_buffers import CODE, SIZE, START, END
from . import storage_native


def align_up(x: int, a: int) -> int:
    return -(-x // a) * a


def tile_ranges(machine: dict, code_bytes: int) -> dict:
    """The memory map of one tile whose generated code takes ``code_bytes``."""
    m, c = machine["memory"], machine["code"]
    data_start = align_up(m["runtime_linked_end"], 4096)
    (res_lo, res_hi), = m["runtime_reserved"]
    host = m["host_code_base"]
    code_address = align_up(host + c["host_code_bytes"], 64)
    code_end = code_address + code_bytes
    available = [[data_start, res_lo], [res_hi, host],
                 [align_up(code_end, m["element_bytes"]), m["loader_limit"]]]
    return {"linked_end": m["runtime_linked_end"], "host_code_base": host,
            "code_address": code_address, "code_end": code_end,
            "executable_ranges": [[code_address, m["executable_end"]]],
            "available_ranges": [r for r in available if r[0] < r[1]]}


def allocate(buffers: dict[str, dict], ranges, alignment: int, *, tile: int, names=None) -> dict[str, int]:
    """Addresses for ``{id: {"size", "start", "end"}}`` (first fit, earliest-born first; buffers
    live at the same time never share bytes). ``names`` (buffer id -> tensor name) is used for
    the error message only."""
    bids = list(buffers)
    size, start, end = (np.array([buffers[b][k] for b in bids], dtype=np.int64).reshape(-1)
                        for k in ("size", "start", "end"))
    try:
        codes = buffer_codes(bids)
    except ValueError:                       # names that are not a program's: placed as names sort
        codes = None
    return dict(sorted(zip(bids, _place(bids, codes, size, start, end, ranges, alignment, tile, names).tolist())))


def allocate_rows(rows: np.ndarray, ranges, alignment: int, *, tile: int, names=None) -> np.ndarray:
    """``allocate`` for one tile's rows of a program's buffer table (``program_buffers``): each
    row's address (read-only). Memoised by the sizes and lifetimes in placement order (what
    first fit depends on; not the buffers' numbers, which shift through the whole program when
    one operation's buffers change): a search candidate re-plans few tiles."""
    codes, size, start, end = np.ascontiguousarray(rows[:, [CODE, SIZE, START, END]], dtype=np.int64).T
    if storage_native.library() is None:       # the Python loop orders equal buffers by name
        return _place(None, codes, size, start, end, ranges, alignment, tile, names)
    order = np.lexsort((codes, -size, start))
    placed = np.ascontiguousarray(np.stack([size[order], start[order], end[order]]))
    key = (canonical.digest(placed.tobytes()), len(order), tuple(map(tuple, ranges)), alignment)
    in_order = _memo.get(key)
    if in_order is None:
        in_order = _place(None, codes, size, start, end, ranges, alignment, tile, names)[order]
        in_order.flags.writeable = False
        if len(_memo) > 8192:
            _memo.clear()
        _memo[key] = in_order
    found = np.empty(len(order), np.int64)
    found[order] = in_order
    found.flags.writeable = False
    return found


_memo: dict = {}


def _place(bids, codes, size, start, end, ranges, alignment, tile, names) -> np.ndarray:
    """Each buffer's address (in the order given), by first fit in C where it compiles
    (``storage_native``); the Python loop otherwise, and to say why a buffer does not fit.
    ``codes``: the buffers' ``buffer_code``, or None (then ``bids``, names placed as they sort,
    are needed; given codes, names are made only for the Python loop)."""
    n = len(size)
    if storage_native.library() is not None and n:
        if codes is not None:
            order = np.lexsort((codes, -size, start))
        else:
            order = np.array(sorted(range(n), key=lambda i: (start[i], -size[i], bids[i])), dtype=np.int64)
        aligned = -(-np.maximum(size[order], 1) // alignment) * alignment
        try:
            addr = storage_native.first_fit(aligned, start[order], end[order], ranges, alignment)
        except ValueError:
            addr = None
        if addr is not None:
            out = np.empty(n, np.int64)
            out[order] = addr
            return out
    if bids is None:
        bids = buffer_names(codes)
    records = {b: {"size": int(z), "start": int(a), "end": int(e)}
               for b, z, a, e in zip(bids, size.tolist(), start.tolist(), end.tolist())}
    placed = _allocate_python(records, ranges, alignment, tile, names)
    return np.array([placed[b] for b in bids], dtype=np.int64)


def _allocate_python(buffers, ranges, alignment, tile, names) -> dict[str, int]:
    placed: list[tuple[int, int, int, int]] = []   # addr, end address, start step, end step; by addr
    out = {}
    for bid in sorted(buffers, key=lambda b: (buffers[b]["start"], -buffers[b]["size"], b)):
        b = buffers[bid]
        start, end = b["start"], b["end"]
        size = align_up(max(b["size"], 1), alignment)
        addr = None
        for lo, hi in ranges:
            cursor = align_up(lo, alignment)
            for a, e, st, en in placed:
                if e <= cursor or st > end or start > en:
                    continue           # below the cursor, or never live at the same time
                if a >= hi or a - cursor >= size:
                    break
                cursor = max(cursor, align_up(e, alignment))
            if cursor + size <= hi:
                addr = cursor
                break
        if addr is None:
            live = sorted((a, e - a) for a, e, st, en in placed if st <= end and start <= en)
            name = (names or {}).get(bid, bid)
            raise UserError(f"tile {tile}", f"tensor {name} needs {size} bytes but the largest free "
                            f"block of tile memory is {_largest_gap(live, ranges, alignment)} bytes; raise "
                            "target.tile_count or choose a plan that splits it further")
        bisect.insort(placed, (addr, addr + size, start, end))
        out[bid] = addr
    return dict(sorted(out.items()))


def _gaps(live, lo, hi, alignment):
    cursor = align_up(lo, alignment)
    for a, s in live:
        if a + s <= cursor:
            continue
        if a >= hi:
            break
        yield cursor, min(a, hi)
        cursor = max(cursor, align_up(a + s, alignment))
    if cursor < hi:
        yield cursor, hi


def _largest_gap(live, ranges, alignment):
    return max((g1 - g0 for lo, hi in ranges for g0, g1 in _gaps(live, lo, hi, alignment)), default=0)


def headroom(placed, buffers, alignment: int) -> list[int]:
    """Per tile (tile order), the data memory no buffer of a placement ever uses: the largest
    of its ranges' free tops (above the last buffer placed in the range). ``placed`` is a
    ``storage`` artifact (``graph.placement``), ``buffers`` its program's
    (``program_buffers.ProgramBuffers``). One more buffer placed there fits beside the
    placement, whatever else is live; a changed layout is placed again by first fit, so for it
    this is an estimate of its room, not a bound."""
    placed = placement_of(placed)
    out = [0] * len(placed.tiles)
    for tile, p in placed.tiles.items():
        rows = buffers.rows(tile)
        start = placed.of(rows[:, CODE])
        size = rows[:, SIZE].astype(np.int64)
        end = start + -(-np.maximum(size, 1) // alignment) * alignment
        best = 0
        for lo, hi in p["ranges"]["available_ranges"]:
            inside = end[(start >= lo) & (start < hi)]
            top = align_up(int(inside.max()) if len(inside) else lo, alignment)
            best = max(best, hi - top)
        out[int(tile)] = best
    return out
