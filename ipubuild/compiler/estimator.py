"""The search's cheap cost model of a layout, and what it holds on each tile.

Per operation stage: the slowest tile's compute, the busiest exchange port's time (each
transfer's setup per row and its bytes, at the sender and at every receiver; a block several
tiles read from one source is sent once: a broadcast) and a sync. Per tile: the bytes of
constants it holds, an estimate of its generated code (its kernels' reservations, its tile
program, its exchange table) and the buffers each operation allocates there (what it gathers
and writes: against the room an exact evaluation left free, see ``Baseline``). Terms are cached
by the choices they depend on (the operation's and its producers', follow chains included), so
a change costs only the operations it touches (``Baseline``).
"""
from __future__ import annotations

import collections
from typing import NamedTuple

import numpy as np

from ..engine import canonical
from .planning.cost import scalar_args
from .planning.program import Blocks, PlanResolver, row_keys


class Term(NamedTuple):
    """One operation's share of a layout's estimate. Per-tile figures are sparse: an array of
    tiles and an array of bytes."""
    cycles: int
    pressure: int            # bytes through the busiest exchange port, over its stages
    const_tiles: np.ndarray
    const_bytes: np.ndarray  # constants it reads on each tile
    code_tiles: np.ndarray
    code_bytes: np.ndarray   # its tile program and exchange-table entries on each tile
    kernels: tuple           # ((kernel name, tiles that run it), ...)
    work_tiles: np.ndarray
    work_bytes: np.ndarray   # the buffers it allocates on each tile: blocks gathered, written

    def constants(self) -> dict[int, int]:
        return dict(zip(self.const_tiles.tolist(), self.const_bytes.tolist()))


class Estimator:
    """A cheap cost estimate of a layout (see the module's docstring). A layout whose follow
    plans cannot follow their producers is invalid (``estimate`` None)."""

    def __init__(self, graph, tile_count, machine, plans, reservations: dict[str, int] | None = None):
        self.g, self.T, self.m, self.plans = graph, tile_count, machine, plans
        self.resolver = PlanResolver(graph, tile_count, plans)
        self.producer = {v: op for op in graph.ops for v in op.outputs}
        self.fixed = set(graph.constants) | set(graph.inputs)
        self.const_keys = {f"v{v}" for v in graph.constants}
        self._producers = {op.id: sorted({self.producer[v].id for v in op.inputs if v not in self.fixed})
                           for op in graph.ops}
        self._consumers = collections.defaultdict(set)
        for op in graph.ops:
            for p in self._producers[op.id]:
                self._consumers[p].add(op.id)
        mem, code = machine["memory"], machine["code"]
        self.cap = int((mem["loader_limit"] - mem["sram_base"]) * mem["constant_fraction"])
        # generated code lives in the executable region after the host-exchange handler
        code_address = -(-(mem["host_code_base"] + code["host_code_bytes"]) // 64) * 64
        self.code_cap = mem["executable_end"] - code_address
        self.kernel_bytes = code["reservation_quantum"]     # a kernel's reservation, at least
        # what the kernels' reservations (compile_kernels') take beyond one quantum each: at
        # most this much more code on a tile than the estimate counts
        self.reservation_excess = sum(max(0, r - self.kernel_bytes) for r in (reservations or {}).values())
        self._isz = collections.defaultdict(lambda: 4)   # temporaries are f32
        self._isz.update({f"v{v}": val.itemsize for v, val in graph.values.items()})
        self._terms, self._writes, self._work, self._footprints = {}, {}, {}, {}
        self.kernel_index: dict[str, int] = {}           # kernel name -> row of Loads.kernels

    def forget(self, keep: dict | None = None) -> None:
        """Drop the cached terms, writes, work and footprints, and every lowering but ``keep``'s
        (a layout), and give the memory back to the system. The search calls it once its
        initial layout is chosen and when a round's screening ends: on ViT-B/16 the placement's
        2,300 lowerings and the terms are 3.3 GB that the evaluation never reads, and forked
        workers would inherit. Estimates do not depend on what is cached."""
        self._terms, self._writes, self._work, self._footprints = {}, {}, {}, {}
        if keep is not None:
            self.resolver.keep(keep)
        give_back_memory()

    def resolve(self, layout: dict) -> dict:
        return self.resolver.resolve(layout)

    def lowering(self, op, layout: dict, resolved: dict | None = None):
        """The operation's lowering under ``layout`` (ValueError if its plan cannot follow)."""
        resolved = resolved or self.resolve(layout)
        return self.resolver.lowering(op, resolved[op.id][0])

    def estimate(self, layout: dict) -> int | None:
        res = self.resolve(layout)
        terms = [self.term(op, layout, res) for op in self.g.ops]
        return None if any(t is None for t in terms) else sum(t.cycles for t in terms)

    def delta(self, layout: dict, resolved: dict, changes: dict[int, int]) -> int | None:
        """How much the estimate of ``layout`` (resolved as ``resolved``) changes if each
        operation in ``changes`` takes its plan there; None if that makes the layout invalid.
        Only the terms the change touches are computed: the operations changed, those that
        follow them (their blocks move with them), and their consumers."""
        new = dict(resolved)
        moved = set(changes)
        for op in self.g.ops[min(changes):]:
            i = changes.get(op.id, layout["ops"][str(op.id)]["plan"])
            p = self.plans[op.id][i]
            if "follow" in p:
                src = self.producer[op.inputs[p["follow"]]].id
                if op.id in changes or src in moved:
                    moved.add(op.id)
                    new[op.id] = ((i, new[src][0]), new[src][1])
            elif op.id in changes:
                new[op.id] = ((i,), layout["ops"][str(op.id)]["offset"])
        touched = moved | {c for m in moved for c in self._consumers[m]}
        before = after = 0
        for i in sorted(touched):
            op = self.g.ops[i]
            a, b = self.term(op, layout, resolved), self.term(op, layout, new)
            if b is None:
                return None
            before += a.cycles if a else 0
            after += b.cycles
        return after - before

    def consumers(self, op_id: int) -> set[int]:
        """The operations that read an output of ``op_id``."""
        return self._consumers[op_id]

    def followers(self, layout: dict, op_id: int) -> set[int]:
        """The operations that follow ``op_id``'s blocks under ``layout``, directly or through
        other followers."""
        out = {op_id}
        for op in self.g.ops[op_id + 1:]:
            p = self.plans[op.id][layout["ops"][str(op.id)]["plan"]]
            if "follow" in p and self.producer[op.inputs[p["follow"]]].id in out:
                out.add(op.id)
        return out - {op_id}

    def pressure(self, layout: dict) -> int:
        """Bytes through the busiest exchange port, summed over exchange phases."""
        res = self.resolve(layout)
        return sum(t.pressure for op in self.g.ops if (t := self.term(op, layout, res)) is not None)

    def constant_load(self, layout: dict) -> collections.Counter:
        """Bytes of constants (weights) each tile holds under this layout."""
        loads = Baseline(self, layout).loads
        return collections.Counter({t: int(b) for t, b in enumerate(loads.const.tolist()) if b})

    def code_load(self, layout: dict) -> collections.Counter:
        """An estimate of each tile's generated code: its kernels' reservations (one quantum
        each, at least), its tile program and its exchange table (an entry per fragment it
        sends, before coalescing: an upper bound)."""
        code = Baseline(self, layout).loads.code_with_kernels()
        return collections.Counter({t: int(b) for t, b in enumerate(code.tolist()) if b})

    def fits(self, layout: dict) -> bool:
        """Whether the layout is valid, every tile's constants stay under the planning cap of
        tile memory, and its code (estimated) fits the executable region."""
        base = Baseline(self, layout)
        return base.total is not None and base.loads.fit()

    def footprints(self, op) -> list[int | None]:
        """For each plan of ``op``: the bytes of constants its tiles hold in all, copies
        included (None for a follow plan, whose blocks depend on its producer). Worked out
        once per operation shape: a model's blocks repeat."""
        g = self.g
        sig = (op.type, tuple((g.values[v].shape, g.values[v].dtype, v in g.constants) for v in op.inputs),
               canonical.encode(self.plans[op.id]))
        if sig not in self._footprints:
            impl, out = self.resolver.reg.get(op.type), []
            for plan in self.plans[op.id]:
                if "follow" in plan or not any(v in g.constants for v in op.inputs):
                    out.append(None if "follow" in plan else 0)
                    continue
                held = {(w.tile, blk): (blk[2] - blk[1]) * (blk[4] - blk[3]) * self._isz[blk[0]]
                        for st in impl.lower(g, op, plan).stages for w in st for blk in w.reads
                        if blk[0] in self.const_keys}
                out.append(sum(held.values()))
            self._footprints[sig] = out
        return self._footprints[sig]

    def _term_key(self, op, resolved: dict) -> tuple:
        """What one operation's ``Term`` depends on: its resolved choice and its producers'."""
        return (op.id, resolved[op.id], tuple((p, resolved[p]) for p in self._producers[op.id]))

    def term(self, op, layout, resolved: dict | None = None) -> Term | None:
        """One operation's ``Term``, or None if its plan cannot follow its producer."""
        res = resolved or self.resolve(layout)
        key = self._term_key(op, res)
        if key not in self._terms:
            try:
                self._terms[key] = self._compute(op, res)
            except ValueError:
                self._terms[key] = None
        return self._terms[key]

    def _written(self, op, choice, offset) -> dict:
        """Where an operation's lowering leaves its blocks: ``{value key: Blocks}``."""
        k = (op.id, choice, offset)
        if k not in self._writes:
            written = collections.defaultdict(list)
            for st in self.resolver.lowering(op, choice).stages:
                for w in st:
                    for blk in w.writes:
                        written[blk[0]].append(((offset + w.tile) % self.T, tuple(blk[1:])))
            self._writes[k] = {vk: _blocks(tb) for vk, tb in written.items()}
        return self._writes[k]

    def _stages(self, op, choice) -> tuple:
        """What an operation does under a plan, whatever its offset: per stage, the slowest
        logical tile's compute cycles, the blocks read of each value that is not a constant (an
        array of ``[logical tile, r0, r1, c0, c1]`` rows, each gathered once) and the blocks
        written; the bytes of constants each logical tile holds; each logical tile's program
        bytes; the logical tiles running each kernel; and the bytes each logical tile writes."""
        k = (op.id, choice)
        if k not in self._work:
            kernels = self.resolver.reg.kernels
            stages, consts = [], {}
            program, names = collections.Counter(), collections.defaultdict(set)   # per logical tile
            written = collections.Counter()
            for st in self.resolver.lowering(op, choice).stages:
                compute = collections.Counter()
                reads: dict[str, dict] = {}
                for w in st:
                    program[w.tile] += 8 + sum(4 + 4 * len(a) for _, a in w.vertices)
                    for n, a in w.vertices:
                        names[n].add(w.tile)
                        compute[w.tile] += int(kernels[n].cycles(scalar_args(a), self.m))
                    for blk in w.writes:
                        written[w.tile] += (blk[2] - blk[1]) * (blk[4] - blk[3]) * self._isz[blk[0]]
                    for blk in w.reads:
                        if blk[0] in self.const_keys:
                            consts[(w.tile, blk)] = (blk[2] - blk[1]) * (blk[4] - blk[3]) * self._isz[blk[0]]
                        else:
                            reads.setdefault(blk[0], {})[(w.tile, *blk[1:])] = None
                stages.append((max(compute.values(), default=0),
                               {vk: np.array(list(r), dtype=np.int64).reshape(-1, 5) for vk, r in reads.items()},
                               [(w.tile, blk) for w in st for blk in w.writes]))
            for n in names:
                self.kernel_index.setdefault(n, len(self.kernel_index))
            self._work[k] = (stages, _array([t for t, _ in consts]), _array(list(consts.values())),
                             _array(list(program)), _array(list(program.values())),
                             tuple((n, _array(sorted(ts))) for n, ts in sorted(names.items())),
                             _array(list(written)), _array(list(written.values())))
        return self._work[k]

    def _compute(self, op, res) -> Term:
        stored = {}
        for p in self._producers[op.id]:
            stored.update(self._written(self.g.ops[p], *res[p]))
        own = collections.defaultdict(Blocks)        # what earlier stages of this operation wrote
        choice, offset = res[op.id]
        sync = self.m["exchange"]["sync_cycles"]
        total = pressure = 0
        stages, const_tiles, const_bytes, program_tiles, program_bytes, kernels, out_tiles, out_bytes = \
            self._stages(op, choice)
        table = np.zeros(self.T, np.int64)           # exchange-table bytes each tile adds
        work = np.bincount((offset + out_tiles) % self.T, weights=out_bytes, minlength=self.T)
        for compute, reads, writes in stages:
            port = _Ports(self.T, table)
            for vk, logical in reads.items():
                blocks = own.get(vk) or stored.get(vk)
                if blocks is None:
                    continue
                wanted = logical.copy()
                wanted[:, 0] = (offset + wanted[:, 0]) % self.T
                wanted = wanted[~np.isin(row_keys(wanted), blocks.keys())]   # already on the tile
                if len(wanted):
                    self._exchange(port, wanted, blocks, vk)
                    np.add.at(work, wanted[:, 0],
                              (wanted[:, 2] - wanted[:, 1]) * (wanted[:, 4] - wanted[:, 3]) * self._isz[vk])
            written = collections.defaultdict(list)
            for t, blk in writes:
                written[blk[0]].append(((offset + t) % self.T, tuple(blk[1:])))
            for vk, tb in written.items():
                own[vk].extend(tb, True)
            pressure += port.pressure()
            total += port.horizon() + compute + sync
        code = np.bincount((offset + program_tiles) % self.T, weights=program_bytes, minlength=self.T) + table
        code_tiles = np.flatnonzero(code)
        const_at = (offset + const_tiles) % self.T
        if len(const_at) and len(np.unique(const_at)) < len(const_at):
            load = np.bincount(const_at, weights=const_bytes, minlength=self.T)
            const_at = np.flatnonzero(load)
            const_bytes = load[const_at].astype(np.int64)
        work_tiles = np.flatnonzero(work)
        return Term(int(total), int(pressure), const_at, const_bytes, code_tiles, code[code_tiles].astype(np.int64),
                    tuple((n, (offset + ts) % self.T) for n, ts in kernels), work_tiles,
                    work[work_tiles].astype(np.int64))

    def _exchange(self, port: "_Ports", reads: np.ndarray, blocks: Blocks, vk: str) -> None:
        """Charge the ports for gathering ``reads`` (rows ``[tile, r0, r1, c0, c1]``) from where
        ``blocks`` hold the value: per fragment (a read block's intersection with a stored one),
        its setup per row (rows coalesce into one transfer only when they span both blocks'
        width) plus its bytes at the port's rate — at the receiver, and once at the sender for
        every tile that reads the same fragment (a broadcast); on-tile copies at local speed."""
        x = self.m["exchange"]
        s_tiles, s_blks = blocks.arrays()
        ri, si = blocks.pairs(reads[:, 1:])
        if not len(ri):
            return
        r, sb = reads[ri], s_blks[si]
        ir0, ir1 = np.maximum(r[:, 1], sb[:, 0]), np.minimum(r[:, 2], sb[:, 1])
        ic0, ic1 = np.maximum(r[:, 3], sb[:, 2]), np.minimum(r[:, 4], sb[:, 3])
        nbytes = (ir1 - ir0) * (ic1 - ic0) * self._isz[vk]
        whole = (ic0 == sb[:, 2]) & (ic1 == sb[:, 3]) & (sb[:, 2] == r[:, 3]) & (sb[:, 3] == r[:, 4])
        rows = np.where(whole, 1, ir1 - ir0)
        setup = x["transfer_setup_cycles"] * rows
        dst, src = r[:, 0], s_tiles[si]
        local = src == dst
        port.add("local", dst[local], setup[local] - (-nbytes[local] // x["local_copy_bytes_per_cycle"]), None)
        far = ~local
        cycles = setup[far] - (-nbytes[far] // x["bytes_per_cycle"])
        port.add("recv", dst[far], cycles, nbytes[far])
        # one send per distinct fragment: the stored block it comes from (which fixes the
        # source tile), the intersection and whether its rows coalesce
        key = _fragment_keys(si[far], ir0[far], ir1[far], ic0[far], ic1[far], whole[far], len(s_blks))
        _, first, receivers = np.unique(key, return_index=True, return_counts=True)
        port.add("send", src[far][first], cycles[first], nbytes[far][first])
        # the sender's table: an entry per fragment, and each of its receivers
        np.add.at(port.table, src[far][first], 28 + 12 * receivers)


def _fragment_keys(stored, r0, r1, c0, c1, whole, n_stored: int) -> np.ndarray:
    """One int64 per fragment, equal for equal fields: the fields in mixed radix when they fit
    (exact, and cheaper than hashing stacked rows: a third of the initial placement's time on
    ViT-B/16), else ``row_keys`` of them."""
    if not len(stored):
        return np.zeros(0, np.int64)
    rows, cols = int(r1.max()) + 1, int(c1.max()) + 1
    if n_stored * rows * rows * cols * cols * 2 < 2 ** 63:
        return ((((stored * rows + r0) * rows + r1) * cols + c0) * cols + c1) * 2 + whole
    return row_keys(np.stack([stored, r0, r1, c0, c1, whole.astype(np.int64)], axis=1)).view(np.int64)


def _blocks(tile_blocks: list) -> Blocks:
    out = Blocks()
    out.extend(tile_blocks, True)
    return out


def _array(values: list) -> np.ndarray:
    return np.array(values, dtype=np.int64)


class _Ports:
    """Per-tile busy cycles (local copies, receive and send ports) and bytes of one exchange
    phase, as the estimator charges them; and the exchange-table bytes each tile adds."""

    def __init__(self, tiles: int, table: np.ndarray):
        self.busy = {k: np.zeros(tiles, np.int64) for k in ("local", "recv", "send")}
        self.moved = {k: np.zeros(tiles, np.int64) for k in ("recv", "send")}
        self.table = table

    def add(self, kind: str, tiles: np.ndarray, cycles: np.ndarray, nbytes: np.ndarray | None) -> None:
        np.add.at(self.busy[kind], tiles, cycles)
        if nbytes is not None:
            np.add.at(self.moved[kind], tiles, nbytes)

    def horizon(self) -> int:
        return int(max(b.max(initial=0) for b in self.busy.values()))

    def pressure(self) -> int:
        return int(max(m.max(initial=0) for m in self.moved.values()))


class Loads:
    """What a set of terms puts on each tile: constants, code besides kernels, and how many
    operations run each kernel there (a kernel's code is reserved once per tile)."""

    def __init__(self, est: Estimator):
        self.est = est
        self.const = np.zeros(est.T, np.int64)
        self.code = np.zeros(est.T, np.int64)
        self.kernels = np.zeros((max(1, len(est.kernel_index)), est.T), np.int32)

    def copy(self) -> "Loads":
        out = Loads.__new__(Loads)
        out.est, out.const, out.code, out.kernels = self.est, self.const.copy(), self.code.copy(), self.kernels.copy()
        return out

    def add(self, term: Term, sign: int = 1) -> None:
        np.add.at(self.const, term.const_tiles, sign * term.const_bytes)
        np.add.at(self.code, term.code_tiles, sign * term.code_bytes)
        index = self.est.kernel_index
        if len(index) > len(self.kernels):
            self.kernels = np.vstack([self.kernels, np.zeros((len(index) - len(self.kernels), self.est.T), np.int32)])
        for name, tiles in term.kernels:
            np.add.at(self.kernels[index[name]], tiles, sign)

    def code_with_kernels(self) -> np.ndarray:
        return self.code + (self.kernels > 0).sum(axis=0) * self.est.kernel_bytes

    def fit(self) -> bool:
        return int(self.const.max(initial=0)) <= self.est.cap and self.code_fits()

    def code_fits(self) -> bool:
        return int(self.code_with_kernels().max(initial=0)) <= self.est.code_cap


class Baseline:
    """A layout's estimate and per-tile loads, against which other layouts are estimated by
    re-costing only the operations whose choices differ and their consumers.

    ``headroom`` (per tile, the bytes of data memory the layout's exact storage placement left
    free: ``storage.headroom``), when known, bounds what another layout may add on each tile:
    the constants it adds, and for each operation it re-costs the buffers it allocates there
    beyond the layout's (an operation's buffers are live around its own step: their growth
    bounds the growth of the tile's peak). A layout over it does not fit. ``code_room`` (per
    tile, the executable memory the layout's provisional code left free: ``search.code_room``),
    when known, bounds the growth of the estimated code likewise. Without ``headroom``, a layout
    must keep within the estimator's caps (``Loads.fit``); with it, only within the code cap
    and the headroom."""

    def __init__(self, est: Estimator, layout: dict, headroom=None, code_room=None):
        self.est, self.layout = est, layout
        self.headroom = None if headroom is None else np.asarray(headroom, dtype=np.int64)
        self.res = est.resolve(layout)
        self.terms = {op.id: est.term(op, layout, self.res) for op in est.g.ops}
        valid = all(t is not None for t in self.terms.values())
        self.total = sum(t.cycles for t in self.terms.values()) if valid else None
        self.loads = Loads(est)
        for t in self.terms.values():
            if t is not None:
                self.loads.add(t)
        # per tile, the estimated code a layout may reach: the layout's own plus its room
        self.code_limit = None if code_room is None else \
            self.loads.code_with_kernels() + np.asarray(code_room, dtype=np.int64)
        self.asked: set[tuple] = set()        # the terms compare() has asked for (cached or not)

    def compare(self, layout: dict) -> tuple[int | None, bool]:
        """(estimate of ``layout``, whether it is valid and within the caps)."""
        est = self.est
        res = est.resolve(layout)
        moved = [i for i, r in res.items() if r != self.res[i]]
        touched = sorted({*moved, *(c for m in moved for c in est.consumers(m))})
        total, loads = self.total, self.loads.copy()
        if total is None:
            return None, False
        grown = None if self.headroom is None else np.zeros(est.T, np.int64)
        for i in touched:
            self.asked.add(est._term_key(est.g.ops[i], res))
            new = est.term(est.g.ops[i], layout, res)
            if new is None:
                return None, False
            old = self.terms[i]
            total += new.cycles - old.cycles
            loads.add(old, -1)
            loads.add(new)
            if grown is not None:
                delta = np.zeros(est.T, np.int64)
                delta[new.work_tiles] += new.work_bytes
                delta[old.work_tiles] -= old.work_bytes
                grown += np.maximum(delta, 0)
        # with the exact placement's headroom known, what each tile adds is held to that, not
        # to the planning cap on constants, a proxy of it: ViT-B/16's QKV on head-aligned grids
        # in every block puts 4 % over the cap on some tiles, 87 k cycles fewer, and builds
        fits = loads.fit() if grown is None else loads.code_fits()
        if fits and grown is not None:
            grown += np.maximum(loads.const - self.loads.const, 0)
            fits = not (grown > self.headroom).any()
        if fits and self.code_limit is not None:
            fits = not (loads.code_with_kernels() > self.code_limit).any()
        return total, fits


def give_back_memory() -> None:
    """Return the heap's free pages to the system (glibc's ``malloc_trim``; elsewhere nothing):
    freed Python objects otherwise keep their pages, which a forked worker then inherits."""
    import ctypes
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass
