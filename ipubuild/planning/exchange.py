"""Exchange phases: coalescing transfers, scheduling them under per-tile send and receive
limits (ordinary, or paired over supertiles), and lowering them to exchange tables.

A transfer is ``[src_tile, src_buf, src_off, src_stride, dst_tile, dst_buf, dst_off, dst_stride,
rows, row_bytes]`` (buffer-relative); after storage placement buffers become addresses.
"""
from __future__ import annotations

from ..operators import ceil_div


def coalesce(transfers: list[list]) -> list[list]:
    """Merge rows that are contiguous on both sides into one row, then merge transfers that
    continue one another between the same two buffers. Address-independent."""
    flat = []
    for st, sb, so, ss, dt, db, do, ds, rows, rb in transfers:
        if rows > 1 and ss == rb and ds == rb:
            rows, rb, ss, ds = 1, rows * rb, rows * rb, rows * rb
        flat.append([st, sb, so, ss, dt, db, do, ds, rows, rb])
    merged: list[list] = []
    for t in sorted(flat, key=lambda t: (t[0], t[1], t[4], t[5], t[2])):
        if merged:
            p = merged[-1]
            if (p[0], p[1], p[4], p[5]) == (t[0], t[1], t[4], t[5]) and p[8] == 1 and t[8] == 1 \
                    and p[2] + p[9] == t[2] and p[6] + p[9] == t[6]:
                p[9] += t[9]
                p[3] = p[7] = p[9]
                continue
        merged.append(list(t))
    return merged


def schedule(transfers: list[list], machine: dict, paired: bool) -> tuple[int, list[int]]:
    """Greedy list schedule (largest first): each transfer waits for its source's send port and
    its destination's receive port. Paired schedules pool a supertile's two ports at twice the
    bandwidth but pay a setup per transfer. Returns (horizon in cycles, order)."""
    x = machine["exchange"]
    free: dict = {}
    order = sorted(range(len(transfers)), key=lambda i: (-transfers[i][8] * transfers[i][9], i))
    horizon = 0
    for i in order:
        st, _, _, _, dt, _, _, _, rows, rb = transfers[i]
        nbytes = rows * rb
        if st == dt:
            ports = [("local", st)]
            dur = x["transfer_setup_cycles"] * rows + ceil_div(nbytes, x["local_copy_bytes_per_cycle"])
        elif paired:
            ports = [("send", st // 2), ("recv", dt // 2)]
            dur = (x["paired_setup_cycles"] + x["transfer_setup_cycles"] * rows
                   + ceil_div(nbytes, x["paired_bytes_per_cycle"]))
        else:
            ports = [("send", st), ("recv", dt)]
            dur = x["transfer_setup_cycles"] * rows + ceil_div(nbytes, x["bytes_per_cycle"])
        start = max(free.get(p, 0) for p in ports)
        for p in ports:
            free[p] = start + dur
        horizon = max(horizon, start + dur)
    return horizon, order


def schedule_phase(transfers: list[list], machine: dict) -> dict:
    """Compare ordinary and paired schedules of one exchange phase and keep the shorter."""
    merged = coalesce(transfers)
    ordinary, order_o = schedule(merged, machine, paired=False)
    paired, order_p = schedule(merged, machine, paired=True)
    use_paired = paired < ordinary
    return {"transfers": [merged[i] for i in (order_p if use_paired else order_o)],
            "ordinary_horizon": ordinary, "paired_horizon": paired, "use_paired": use_paired,
            "horizon": min(ordinary, paired), "candidates": len(merged)}


def resolve(transfers: list[list], addresses: dict[str, dict[str, int]]) -> list[list]:
    """Buffer-relative transfers to absolute ``[src_tile, src_addr, src_stride, dst_tile,
    dst_addr, dst_stride, rows, row_bytes]`` entries."""
    return [[st, addresses[str(st)][sb] + so, ss, dt, addresses[str(dt)][db] + do, ds, rows, rb]
            for st, sb, so, ss, dt, db, do, ds, rows, rb in transfers]


def merge_adjacent(entries: list[list]) -> list[list]:
    """Merge single-row entries that became contiguous once placed (same tiles, adjacent
    addresses on both sides); the order of the rest is kept."""
    out: list[list] = []
    for e in entries:
        if out:
            p = out[-1]
            if p[0] == e[0] and p[3] == e[3] and p[6] == 1 and e[6] == 1 \
                    and p[1] + p[7] == e[1] and p[4] + p[7] == e[4]:
                p[7] += e[7]
                p[2] = p[5] = p[7]
                continue
        out.append(list(e))
    return out


def horizon_of(entries: list[list], machine: dict, paired: bool) -> int:
    """The horizon of placed entries (same model as ``schedule``; memoised: a search candidate
    changes few exchange phases)."""
    key = (tuple(map(tuple, entries)), paired, tuple(sorted(machine["exchange"].items())))
    found = _horizons.get(key)
    if found is None:
        as_transfers = [[st, 0, sa, ss, dt, 0, da, ds, rows, rb] for st, sa, ss, dt, da, ds, rows, rb in entries]
        found = schedule(as_transfers, machine, paired)[0]
        if len(_horizons) > 4096:
            _horizons.clear()
        _horizons[key] = found
    return found


_horizons: dict = {}
