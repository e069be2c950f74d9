"""Exchange phases: coalescing transfers, grouping them into broadcasts, scheduling them under
per-tile send and receive limits (ordinary, or paired over supertiles), and lowering them to
exchange tables.

A transfer is ``[src_tile, src_buf, src_off, src_stride, dst_tile, dst_buf, dst_off, dst_stride,
rows, row_bytes]`` (buffer-relative); after storage placement buffers become addresses. A
*broadcast* sends the same rows once to several tiles: its further destinations follow,
``[..., rows, row_bytes, dst_tile2, dst_buf2, dst_off2, dst_stride2, ...]``. It occupies the
source's send port once and every destination's receive port, for the time of one transfer
(the exchange fabric lets any number of tiles listen to one sender).

The planner works on arrays: a program's transfers are rows of an int32 array whose buffers are
``artifacts.buffer_code``s, and broadcasts, schedules and placed entries are ``Groups``. The list
functions (``coalesce``, ``broadcasts``, ``schedule_python``) are the reference the array ones
are tested against.
"""
from __future__ import annotations

import collections
import heapq
from typing import NamedTuple

import numpy as np

from ...graph.artifacts import buffer_code, buffer_codes, buffer_names, code_ranks

from ...graph.operators import ceil_div


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


def destination_tiles(t: list) -> list:
    """The destination tiles of a transfer (several for a broadcast)."""
    return [t[4], *t[10::4]]


def broadcasts(transfers: list[list], paired: bool) -> list[list]:
    """Group transfers that send the same source rows to different tiles into broadcasts.

    A broadcast's destinations use distinct receive ports (distinct tiles; distinct supertile
    pairs when ``paired``); on-tile copies stay single. Deterministic in the transfers' order."""
    groups: dict[tuple, list[list]] = {}
    seen: dict[tuple, int] = {}     # (source rows, port) -> groups of those rows holding the port
    out: list[list] = []
    for t in transfers:
        st, sb, so, ss, dt, db, do, ds, rows, rb = t[:10]
        if st == dt:
            out.append(list(t))
            continue
        source = (st, sb, so, ss, rows, rb)
        k = (source, dt // 2 if paired else dt)
        n = seen.get(k, 0)          # the first group of these rows without this port
        seen[k] = n + 1
        found = groups.setdefault(source, [])
        if n < len(found):
            found[n].extend([dt, db, do, ds])
        else:
            found.append([st, sb, so, ss, dt, db, do, ds, rows, rb])
            out.append(found[-1])
    return out


# the same over arrays (rows: program.TRANSFER_FIELDS, buffers as artifacts.buffer_code) --------
class Groups(NamedTuple):
    """Broadcasts as arrays: group ``g`` sends ``heads[g]`` (a transfer's fields) and also to the
    destinations ``extra[starts[g]:starts[g + 1]]`` (rows ``dst_tile, dst_buf, dst_off, dst_stride``).
    Placed entries (``resolve``) are the same with addresses: heads ``src_tile, src_addr,
    src_stride, dst_tile, dst_addr, dst_stride, rows, row_bytes``, extra ``dst_tile, dst_addr,
    dst_stride``."""

    heads: np.ndarray
    extra: np.ndarray
    starts: np.ndarray

    def __len__(self) -> int:
        return len(self.heads)

    def destinations(self) -> np.ndarray:
        """Each group's number of destination tiles."""
        return 1 + np.diff(self.starts)

    def take(self, order) -> "Groups":
        """The groups in ``order`` (indices)."""
        order = np.asarray(order, dtype=np.int64)
        counts = np.diff(self.starts)[order]
        owner = np.repeat(order, counts)
        first = np.cumsum(counts) - counts
        at = self.starts[owner] + np.arange(len(owner)) - np.repeat(first, counts)
        return Groups(self.heads[order], self.extra[at], np.concatenate([[0], np.cumsum(counts)]).astype(np.int64))

    def as_fields(self) -> dict:
        """The groups as an artifact's fields (int32 arrays; ``from_fields`` reads them)."""
        return {"heads": self.heads.astype(np.int32), "extra": self.extra.astype(np.int32),
                "starts": self.starts.astype(np.int64)}

    @classmethod
    def from_fields(cls, d: dict) -> "Groups":
        return cls(np.asarray(d["heads"], dtype=np.int64), np.asarray(d["extra"], dtype=np.int64),
                   np.asarray(d["starts"], dtype=np.int64))

    def entry_lists(self) -> list[list]:
        """Each group as one list, its head then its further destinations: placed entries as
        ``resolve`` gave them, ``[src_tile, src_addr, src_stride, dst_tile, dst_addr,
        dst_stride, rows, row_bytes, (dst_tile, dst_addr, dst_stride)...]``."""
        return _joined(self.heads.tolist(), self.extra.tolist(), self.starts.tolist())

    def lists(self) -> list[list]:
        """The groups as ``broadcasts`` gives them (buffers by name)."""
        h, extra = self.heads, self.extra
        rows, more = h.astype(object), extra.astype(object)
        codes = np.concatenate([h[:, 1], h[:, 5], extra[:, 1]])
        unique, index = np.unique(codes, return_inverse=True)
        names = np.array(buffer_names(unique), dtype=object)[index]
        n = len(h)
        rows[:, 1], rows[:, 5] = names[:n], names[n:2 * n]
        more[:, 1] = names[2 * n:]
        return _joined(rows.tolist(), more.tolist(), self.starts.tolist())


def _joined(heads: list, extra: list, starts: list) -> list[list]:
    for g, row in enumerate(heads):
        for d in extra[starts[g]:starts[g + 1]]:
            row.extend(d)
    return heads


def transfer_array(transfers) -> np.ndarray:
    """Transfers as an array (rows ``program.TRANSFER_FIELDS``, buffers by ``buffer_code``): an
    array as it is, or lists with buffer names (``o12``)."""
    if isinstance(transfers, np.ndarray):
        return transfers
    return np.array([[t[0], buffer_code(t[1]), *t[2:5], buffer_code(t[5]), *t[6:10]] for t in transfers],
                    dtype=np.int64).reshape(-1, 10)


def transfer_lists(transfers: np.ndarray) -> list[list]:
    """An array of transfers as lists with buffer names (``transfer_array``'s inverse)."""
    t = np.asarray(transfers, dtype=np.int64).reshape(-1, 10)
    return Groups(t, np.zeros((0, 4), np.int64), np.zeros(len(t) + 1, np.int64)).lists()


def coalesce_array(t: np.ndarray) -> np.ndarray:
    """``coalesce`` over an array of transfers."""
    t = np.array(t, dtype=np.int64).reshape(-1, 10)
    flat = (t[:, 8] > 1) & (t[:, 3] == t[:, 9]) & (t[:, 7] == t[:, 9])
    whole = t[flat, 8] * t[flat, 9]
    t[flat, 8], t[flat, 9], t[flat, 3], t[flat, 7] = 1, whole, whole, whole
    t = t[np.lexsort((t[:, 2], t[:, 5], t[:, 4], t[:, 1], t[:, 0]))]
    if len(t) < 2:
        return t
    p, q = t[:-1], t[1:]
    joins = ((p[:, 0] == q[:, 0]) & (p[:, 1] == q[:, 1]) & (p[:, 4] == q[:, 4]) & (p[:, 5] == q[:, 5])
             & (p[:, 8] == 1) & (q[:, 8] == 1) & (p[:, 2] + p[:, 9] == q[:, 2]) & (p[:, 6] + p[:, 9] == q[:, 6]))
    if not joins.any():
        return t
    head = np.concatenate([[True], ~joins])
    run = np.cumsum(head) - 1
    out = t[head].copy()
    total = np.bincount(run, weights=t[:, 9], minlength=len(out)).astype(np.int64)
    merged = np.bincount(run, minlength=len(out)) > 1
    out[merged, 9] = total[merged]
    out[merged, 3] = out[merged, 7] = total[merged]
    return out


def broadcast_groups(t: np.ndarray, paired: bool) -> Groups:
    """``broadcasts`` over an array of (coalesced) transfers."""
    t = np.asarray(t, dtype=np.int64).reshape(-1, 10)
    n = len(t)
    pos = np.arange(n)
    local = t[:, 0] == t[:, 4]
    # the source rows each transfer sends: one id per distinct (st, sb, so, ss, rows, rb)
    by_source = np.lexsort((t[:, 9], t[:, 8], t[:, 3], t[:, 2], t[:, 1], t[:, 0]))
    cols = t[by_source][:, [0, 1, 2, 3, 8, 9]]
    new = np.concatenate([[True], (cols[1:] != cols[:-1]).any(axis=1)]) if n else np.zeros(0, bool)
    source = np.empty(n, np.int64)
    source[by_source] = np.cumsum(new) - 1
    port = t[:, 4] // 2 if paired else t[:, 4]
    # a transfer joins the source's group numbered by how many before it had its port
    remote = pos[~local]
    order = remote[np.lexsort((remote, port[remote], source[remote]))]
    s, q = source[order], port[order]
    first = np.concatenate([[True], (s[1:] != s[:-1]) | (q[1:] != q[:-1])]) if len(order) else np.zeros(0, bool)
    run_start = np.maximum.accumulate(np.where(first, np.arange(len(order)), 0)) if len(order) else order
    nth = np.empty(n, np.int64)
    nth[order] = np.arange(len(order)) - run_start
    nth[local] = 0
    # items: a local copy on its own; a group (source, nth) at its first member, members in order
    group_key = np.where(local, -1 - pos, source * (n + 1) + nth)
    by_group = np.lexsort((pos, group_key))
    gk = group_key[by_group]
    lead = np.concatenate([[True], gk[1:] != gk[:-1]]) if n else np.zeros(0, bool)
    gid = np.cumsum(lead) - 1
    heads_at = by_group[lead]                      # each group's first member
    item_order = np.argsort(heads_at, kind="stable")
    rank = np.empty(len(heads_at), np.int64)
    rank[item_order] = np.arange(len(heads_at))
    members = by_group[~lead]
    member_rank = rank[gid[~lead]]
    members = members[np.lexsort((members, member_rank))]
    member_rank = np.sort(member_rank, kind="stable")
    starts = np.searchsorted(member_rank, np.arange(len(heads_at) + 1))
    return Groups(t[heads_at[item_order]], t[members][:, 4:8], starts.astype(np.int64))


def grouped_arrays(transfers: np.ndarray) -> tuple[np.ndarray, Groups, Groups]:
    """``(coalesce_array(transfers), its ordinary broadcasts, its paired broadcasts)``: what the
    provisional code size and the phase's schedule both start from."""
    merged = coalesce_array(transfers)
    return merged, broadcast_groups(merged, paired=False), broadcast_groups(merged, paired=True)


def _ports_and_duration(t: list, machine: dict, paired: bool) -> tuple[list, int]:
    x = machine["exchange"]
    st, rows, nbytes = t[0], t[8], t[8] * t[9]
    if st == t[4] and len(t) == 10:
        return [("local", st)], x["transfer_setup_cycles"] * rows + ceil_div(nbytes, x["local_copy_bytes_per_cycle"])
    if paired:
        return ([("send", st // 2), *sorted({("recv", d // 2) for d in destination_tiles(t)})],
                x["paired_setup_cycles"] + x["transfer_setup_cycles"] * rows
                + ceil_div(nbytes, x["paired_bytes_per_cycle"]))
    return ([("send", st), *(("recv", d) for d in destination_tiles(t))],
            x["transfer_setup_cycles"] * rows + ceil_div(nbytes, x["bytes_per_cycle"]))


def _replay(info: list, order: list[int]) -> int:
    """The horizon when transfers start in ``order``, each as soon as all its ports are free."""
    free: dict = {}
    horizon = 0
    for i in order:
        ports, dur = info[i]
        start = max(free.get(p, 0) for p in ports)
        for p in ports:
            free[p] = start + dur
        horizon = max(horizon, start + dur)
    return horizon


def _earliest_first(info: list, priority: list) -> list[int]:
    """Transfers in the order of their earliest possible start (ties: ``priority``, smaller
    first). Each waits on one port at a time — the one that last kept it from starting — so a
    phase of n transfers costs about n log n, however many share a port."""
    free: dict = collections.defaultdict(int)
    waiting: dict = collections.defaultdict(list)          # port -> heap of (priority, i)
    for i, (ports, _) in enumerate(info):
        heapq.heappush(waiting[ports[0]], (priority[i], i))
    ready = [(0, w[0][0], p) for p, w in waiting.items()]    # (port free at, top priority, port)
    heapq.heapify(ready)
    order = []
    while ready:
        at, top, port = heapq.heappop(ready)
        queue = waiting[port]
        if not queue or at != free[port] or top != queue[0][0]:
            continue                                        # superseded entry
        _, i = heapq.heappop(queue)
        ports, dur = info[i]
        start, block = at, port
        for q in ports:
            if free[q] > start:
                start, block = free[q], q
        if block != port:                                   # wait on the port that keeps it
            heapq.heappush(waiting[block], (priority[i], i))
            heapq.heappush(ready, (free[block], waiting[block][0][0], block))
        else:
            order.append(i)
            for q in ports:
                free[q] = start + dur
                if waiting[q] and q != port:
                    heapq.heappush(ready, (free[q], waiting[q][0][0], q))
        if queue:
            heapq.heappush(ready, (free[port], queue[0][0], port))
    return order


def schedule(transfers: list[list], machine: dict, paired: bool) -> tuple[int, list[int]]:
    """A list schedule of one exchange phase: each transfer occupies its source's send port and
    its destinations' receive ports (an on-tile copy: the tile's local port) for its duration.
    Two orders are tried and the shorter kept: largest first, and earliest start first (ties:
    the transfer on the busiest port, then the longest). Ties are broken by content, so any
    order of the same transfers gives the same horizon. Paired schedules pool a supertile's
    two ports at twice the bandwidth but pay a setup per transfer. Returns (horizon, order).
    The loops run in C over arrays (``exchange_native``) where a C compiler is at hand; the
    Python loops below are the reference they are tested against."""
    from . import exchange_native
    found = exchange_native.schedule(transfers, machine, paired)
    return found if found is not None else schedule_python(transfers, machine, paired)


def schedule_python(transfers: list[list], machine: dict, paired: bool) -> tuple[int, list[int]]:
    """``schedule`` in Python, per transfer."""
    info = [_ports_and_duration(t, machine, paired) for t in transfers]
    rank = sorted(range(len(transfers)), key=lambda i: (transfers[i], i))
    tie = [0] * len(transfers)
    for r, i in enumerate(rank):
        tie[i] = r
    largest = sorted(range(len(transfers)), key=lambda i: (-transfers[i][8] * transfers[i][9], tie[i]))
    load: dict = collections.defaultdict(int)
    for ports, dur in info:
        for p in ports:
            load[p] += dur
    first = (_replay(info, largest), largest)
    if first[0] == max(load.values(), default=0):
        return first                # the busiest port is never idle: nothing can be shorter
    priority = [(-max(load[p] for p in ports), -dur, tie[i]) for i, (ports, dur) in enumerate(info)]
    earliest = _earliest_first(info, priority)
    return min(first, (_replay(info, earliest), earliest))


def schedule_phase(transfers, machine: dict) -> dict:
    """Compare ordinary and paired schedules of one exchange phase (its transfers as
    ``transfer_array`` takes them; each schedule with its own broadcasts) and keep the shorter:
    its groups in the order they start (``as_fields``: ``scheduled`` reads them back), both
    horizons, and how many coalesced transfers they group."""
    from . import exchange_native
    merged, plain, pairs = grouped_arrays(transfer_array(transfers))
    found = [exchange_native.schedule_groups(g, machine, paired=p) for g, p in ((plain, False), (pairs, True))]
    if None in found:
        found = [schedule_python(g.lists(), machine, paired=p) for g, p in ((plain, False), (pairs, True))]
    (ordinary, order_o), (paired, order_p) = found
    use_paired = paired < ordinary
    chosen, order = (pairs, order_p) if use_paired else (plain, order_o)
    return {**chosen.take(order).as_fields(),
            "ordinary_horizon": ordinary, "paired_horizon": paired, "use_paired": use_paired,
            "horizon": min(ordinary, paired), "candidates": len(merged)}


def renumbered(transfers: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """One exchange phase's transfers with their buffers renumbered in order (the k-th smallest
    buffer code of the phase becomes that of ``g`` and k in eight digits), and the codes they
    stand for. Grouping, scheduling and table sizes only compare buffers (codes compare as
    names do), so the renumbered transfers give the same schedule up to the renumbering
    (``restore_buffers`` maps it back). Keyed by them, a step whose buffers a change upstream
    renumbered (buffers are numbered program-wide) is not scheduled again."""
    t = np.asarray(transfers)
    if not len(t):
        return t, np.zeros(0, np.int64)
    codes, inverse = code_ranks(np.concatenate([t[:, 1], t[:, 5]]))
    ranked = _ranked_codes(len(codes)).astype(t.dtype)
    out = np.array(t)
    out[:, 1], out[:, 5] = ranked[inverse[:len(t)]], ranked[inverse[len(t):]]
    return out, codes.astype(np.int64)


def restore_buffers(schedule: dict, codes: np.ndarray) -> dict:
    """A schedule of ``renumbered`` transfers with the buffers they stood for (``codes``)."""
    g = scheduled(schedule)
    ranked = _ranked_codes(len(codes))
    heads, extra = g.heads.copy(), g.extra.copy()
    for a, column in ((heads, 1), (heads, 5), (extra, 1)):
        a[:, column] = codes[np.searchsorted(ranked, a[:, column])]
    return {**schedule, **Groups(heads, extra, g.starts).as_fields()}


def _ranked_codes(n: int) -> np.ndarray:
    """The codes of ``g00000000``, ``g00000001``, ...: ``n`` of them, increasing."""
    global _ranked
    if len(_ranked) < n:
        size = 1 << max(n - 1, 1).bit_length()
        _ranked = buffer_codes([f"g{k:08d}" for k in range(size)])
    return _ranked[:n]


_ranked = np.zeros(0, np.int64)


def no_schedule() -> dict:
    """The schedule of a step that exchanges nothing."""
    empty = Groups(np.zeros((0, 10), np.int64), np.zeros((0, 4), np.int64), np.zeros(1, np.int64))
    return {**empty.as_fields(), "horizon": 0, "use_paired": False}


def scheduled(schedule: dict) -> Groups:
    """A step's scheduled groups, in the order they start."""
    return Groups.from_fields(schedule)


SCHEDULE_ARRAYS = (("*", "heads"), ("*", "extra"), ("*", "starts"))
"""Where a program's exchange schedule (and its tables) hold arrays: ``to_plan_blob``'s paths."""


def resolve(groups: Groups, placed) -> Groups:
    """Scheduled groups with buffer-relative offsets as placed entries (``Groups``'s second form):
    every buffer's address from ``placed`` (a ``graph.placement.Placement``)."""
    h, x = groups.heads, groups.extra
    heads = np.stack([h[:, 0], placed.of(h[:, 1]) + h[:, 2], h[:, 3],
                      h[:, 4], placed.of(h[:, 5]) + h[:, 6], h[:, 7], h[:, 8], h[:, 9]], axis=1)
    extra = np.stack([x[:, 0], placed.of(x[:, 1]) + x[:, 2], x[:, 3]], axis=1)
    return Groups(heads.reshape(-1, 8), extra.reshape(-1, 3), groups.starts)


def merge_adjacent(entries: Groups) -> Groups:
    """Merge single-row entries that became contiguous once placed (same source tile, same
    destination tiles, adjacent addresses on every side); the order of the rest is kept. Each
    entry is compared with the one before it: in a run of them, contiguous with the previous is
    contiguous with the run."""
    h, x, starts = entries.heads, entries.extra, entries.starts
    n = len(h)
    if n < 2:
        return entries
    counts = np.diff(starts)
    p, e = h[:-1], h[1:]
    joins = ((p[:, 0] == e[:, 0]) & (p[:, 6] == 1) & (e[:, 6] == 1) & (p[:, 1] + p[:, 7] == e[:, 1])
             & (counts[:-1] == counts[1:]) & (p[:, 3] == e[:, 3]) & (p[:, 4] + p[:, 7] == e[:, 4]))
    pairs = np.nonzero(joins)[0]                  # entry i + 1 may continue entry i
    k = counts[pairs]
    owner = np.repeat(pairs, k)
    j = np.arange(len(owner)) - np.repeat(np.cumsum(k) - k, k)
    a, b = x[starts[owner] + j], x[starts[owner + 1] + j]
    bad = (a[:, 0] != b[:, 0]) | (a[:, 1] + h[owner, 7] != b[:, 1])
    joins[np.unique(owner[bad])] = False
    if not joins.any():
        return entries
    lead = np.concatenate([[True], ~joins])
    run = np.cumsum(lead) - 1
    total = np.bincount(run, weights=h[:, 7]).astype(np.int64)
    merged = np.bincount(run) > 1
    keep = np.nonzero(lead)[0]
    out = entries.take(keep)
    heads, extra = out.heads.copy(), out.extra.copy()
    heads[merged, 7] = total[merged]
    heads[merged, 2] = heads[merged, 5] = total[merged]
    member = np.repeat(merged, np.diff(out.starts))
    extra[member, 2] = np.repeat(total, np.diff(out.starts))[member]
    return Groups(heads, extra, out.starts)


def placed_entries(entries: list[list]) -> Groups:
    """Placed entries given as lists (an exchange table's, ``codegen.decode_exchange`` less the
    step) as ``Groups``."""
    heads = np.array([e[:8] for e in entries], dtype=np.int64).reshape(-1, 8)
    extra = np.array([d for e in entries for d in zip(e[8::3], e[9::3], e[10::3])], dtype=np.int64).reshape(-1, 3)
    counts = np.fromiter(((len(e) - 8) // 3 for e in entries), dtype=np.int64, count=len(entries))
    return Groups(heads, extra, np.concatenate([[0], np.cumsum(counts)]).astype(np.int64))


def unicast(entries) -> np.ndarray:
    """Placed entries (``Groups``, or lists as ``placed_entries`` takes them), a broadcast sending
    to several tiles, as one row per destination (the same source rows copied to each): an
    ``[n, 8]`` array of ``src_tile, src_addr, src_stride, dst_tile, dst_addr, dst_stride, rows,
    row_bytes``, each entry's destinations in order."""
    g = entries if isinstance(entries, Groups) else placed_entries(entries)
    h, counts = g.heads, g.destinations()
    owner = np.repeat(np.arange(len(h)), counts)
    j = np.arange(len(owner)) - np.repeat(np.cumsum(counts) - counts, counts)    # 0: the first destination
    further = g.extra[np.where(j > 0, g.starts[owner] + j - 1, 0)] if len(g.extra) else np.zeros((len(owner), 3), np.int64)
    dest = np.where((j == 0)[:, None], h[owner, 3:6], further)
    return np.concatenate([h[owner, :3], dest, h[owner, 6:8]], axis=1).astype(np.int64).reshape(-1, 8)


def horizon_of(entries, machine: dict, paired: bool) -> int:
    """The horizon of placed entries (``Groups``, or lists as ``placed_entries`` takes them; same
    model as ``schedule``). Memoised by the entries' ``exchange_native.schedule_shape``: a search
    candidate moves buffers, so addresses change in most phases, their shapes in few."""
    from ...engine import canonical
    from . import exchange_native
    if not isinstance(entries, Groups):
        entries = placed_entries(entries)
    h, x = entries.heads, entries.extra
    zeros = np.zeros(len(h), np.int64)
    as_transfers = Groups(np.stack([h[:, 0], zeros, h[:, 1], h[:, 2], h[:, 3], zeros, h[:, 4], h[:, 5],
                                    h[:, 6], h[:, 7]], axis=1).reshape(-1, 10),
                          np.stack([x[:, 0], np.zeros(len(x), np.int64), x[:, 1], x[:, 2]], axis=1).reshape(-1, 4),
                          entries.starts)
    shape = np.ascontiguousarray(exchange_native.schedule_shape(as_transfers), dtype=np.int64)
    key = (canonical.digest(shape.tobytes()), shape.shape, paired, tuple(sorted(machine["exchange"].items())))
    found = _horizons.get(key)
    if found is None:
        done = exchange_native.schedule_groups(as_transfers, machine, paired)
        found = (done if done is not None else schedule_python(as_transfers.entry_lists(), machine, paired))[0]
        if len(_horizons) > 4096:
            _horizons.clear()
        _horizons[key] = found
    return found


_horizons: dict = {}
