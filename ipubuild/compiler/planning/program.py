"""Lowering a graph under a layout into a bulk-synchronous program over tile buffers.

The program is a list of steps. Each step is one exchange phase (transfers that gather the
blocks its tiles read into contiguous local buffers) followed by one compute phase (vertices:
kernel calls whose arguments point into those buffers). Buffers are per tile, with a size and a
lifetime in steps; constants are initialised by the tile image, graph inputs written by the host.
"""
from __future__ import annotations

import itertools
import threading
from array import array
from collections import OrderedDict, defaultdict
from typing import NamedTuple

import numpy as np

from ...engine.errors import UserError
from ...graph.artifacts import (BUFFER_KINDS, buffer_codes, buffer_codes_of, buffer_kinds, buffer_names,
                                buffer_numbers, to_plan_blob)
from ...graph.ir import Graph
from ...graph.program_buffers import ROW_FIELDS, table_of_rows
from ...graph.operators import key, registry


TRANSFER_FIELDS = ("src_tile", "src_buf", "src_off", "src_stride", "dst_tile", "dst_buf", "dst_off", "dst_stride",
                   "rows", "row_bytes")


def no_transfers() -> np.ndarray:
    return np.zeros((0, len(TRANSFER_FIELDS)), np.int32)


def row_keys(rows: np.ndarray) -> np.ndarray:
    """One uint64 per row of an int array (a polynomial hash of its fields), to compare rows as
    numbers."""
    key = np.zeros(len(rows), np.uint64)
    for column in rows.T:
        key = key * np.uint64(0x9E3779B97F4A7C15) + column.astype(np.uint64)
    return key


class Blocks:
    """Where the blocks of one value are stored — ``(tile, buffer, (r0, r1, c0, c1))`` — with
    fast lookup of the blocks reads overlap (``pairs``)."""

    def __init__(self):
        self.items: list = []
        self._codes: list = []          # buffer_code of the first len(_codes) items' buffers
        self._exact: dict = {}
        self._arr = self._tiles = self._grid = self._keys = None

    def add(self, tile, buf, blk) -> None:
        blk = tuple(blk)
        self.items.append((tile, buf, blk))
        self._exact.setdefault((tile, blk), buf)
        self._arr = self._tiles = self._grid = self._keys = None

    def extend(self, tile_blocks, buf) -> None:
        """``add(tile, buf, blk)`` for each ``(tile, blk)``."""
        self.add_all([(tile, buf, blk) for tile, blk in tile_blocks])

    def add_all(self, items: list) -> None:
        """``add(tile, buf, blk)`` for each ``(tile, buf, blk)`` (``blk`` a tuple)."""
        for tile, buf, blk in items:
            self.items.append((tile, buf, blk))
            self._exact.setdefault((tile, blk), buf)
        self._arr = self._tiles = self._grid = self._keys = None

    def prefix(self, count: int) -> "Blocks":
        """A copy holding the first ``count`` blocks stored."""
        out = Blocks()
        out.items = self.items[:count]
        out._codes = self._codes[:count]
        for tile, buf, blk in out.items:
            out._exact.setdefault((tile, blk), buf)
        return out

    def exact(self, tile, blk):
        return self._exact.get((tile, tuple(blk)))

    def keys(self) -> np.ndarray:
        """``row_keys`` of each stored ``(tile, r0, r1, c0, c1)``."""
        if self._keys is None:
            tiles, blks = self.arrays()
            self._keys = row_keys(np.concatenate([tiles[:, None], blks], axis=1))
        return self._keys

    def arrays(self) -> tuple:
        """(tiles, blocks): the stored blocks as arrays ``[n]`` and ``[n, 4]``."""
        if self._arr is None or len(self._arr) != len(self.items):
            self._arr = np.array([b for _, _, b in self.items], dtype=np.int64).reshape(-1, 4)
        if getattr(self, "_tiles", None) is None or len(self._tiles) != len(self.items):
            self._tiles = np.array([t for t, _, _ in self.items], dtype=np.int64)
        return self._tiles, self._arr

    def codes(self) -> np.ndarray:
        """The ``buffer_code`` of each stored block's buffer (a program's blocks: buffers by name)."""
        if len(self._codes) < len(self.items):
            self._codes.extend(buffer_codes([b for _, b, _ in self.items[len(self._codes):]]).tolist())
        return np.array(self._codes, dtype=np.int64)

    def pairs(self, reads: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(read index, stored index) of every stored block overlapping a read block (rows of
        ``reads``: ``[r0, r1, c0, c1]``). Stored blocks that form a grid (row intervals that
        do not overlap, nor do column intervals; replicas allowed) are looked up by binary
        search on the grid's bands; others against every stored block."""
        _, a = self.arrays()
        if self._grid is None:
            self._grid = _grid_of(a)
        if self._grid is False:
            hit = ((a[None, :, 0] < reads[:, None, 1]) & (a[None, :, 1] > reads[:, None, 0])
                   & (a[None, :, 2] < reads[:, None, 3]) & (a[None, :, 3] > reads[:, None, 2]))
            return np.nonzero(hit)
        rows, cols, starts, members = self._grid
        i0, i1 = np.searchsorted(rows[:, 1], reads[:, 0], "right"), np.searchsorted(rows[:, 0], reads[:, 1], "left")
        j0, j1 = np.searchsorted(cols[:, 1], reads[:, 2], "right"), np.searchsorted(cols[:, 0], reads[:, 3], "left")
        ni, nj = np.maximum(i1 - i0, 0), np.maximum(j1 - j0, 0)
        ri, q = _expand(ni * nj)
        cell = (i0[ri] + q // nj[ri]) * len(cols) + j0[ri] + q % nj[ri]
        ci, k = _expand(starts[cell + 1] - starts[cell])
        return ri[ci], members[starts[cell[ci]] + k]


def _grid_of(blocks: np.ndarray):
    """``(row bands, column bands, cell starts, stored indices by cell)`` if ``blocks`` (rows
    ``[r0, r1, c0, c1]``) lie on a grid of bands that do not overlap, else False."""
    bands = []
    span = int(blocks.max(initial=0)) + 1
    for lo, hi in ((0, 1), (2, 3)):
        k = np.unique(blocks[:, lo] * span + blocks[:, hi])     # the distinct intervals, sorted
        b = np.stack([k // span, k % span], axis=1)
        if len(b) > 1 and (b[1:, 0] < b[:-1, 1]).any():
            return False
        bands.append(b)
    rows, cols = bands
    i = np.searchsorted(rows[:, 0], blocks[:, 0])
    j = np.searchsorted(cols[:, 0], blocks[:, 2])
    cell = i * len(cols) + j
    members = np.argsort(cell, kind="stable")
    starts = np.searchsorted(cell[members], np.arange(len(rows) * len(cols) + 1))
    return rows, cols, starts, members


def _expand(counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For ``counts[i]`` items of each ``i``: each item's ``i`` and its index among them."""
    owner = np.repeat(np.arange(len(counts)), counts)
    first = np.cumsum(counts) - counts
    return owner, np.arange(len(owner)) - first[owner]


def default_layout(graph: Graph, tile_count: int) -> dict:
    """Every operation on its default (first) plan, starting at tile 0."""
    return {"ops": {str(op.id): {"plan": 0, "offset": 0} for op in graph.ops}}


def plans_of(graph: Graph, tile_count: int) -> dict[int, list[dict]]:
    reg = registry()
    return {op.id: reg.get(op.type).plans(graph, op, tile_count) for op in graph.ops}


#: how many lowerings a resolver keeps (the least recently asked for go first): one of
#: ViT-B/16's matmuls takes 1.4-12 MB as Python objects (by tracemalloc; the more K-slices, the
#: more), and those a search round's screening asked for grew the searching process by 4 GB
#: (the terms made from them are kept)
LOWERINGS_KEPT = 512


class PlanResolver:
    """What a layout makes of each operation's plans: a concrete plan and a tile offset.

    A layout gives every operation a plan index and an offset. A follow plan (``{"follow": i}``)
    becomes the concrete plan that runs the operation on the tiles where the producer of its
    input ``i`` wrote that input, at the producer's offset (its own offset is unused), so that
    input needs no exchange; chains of followers resolve in program order. Concrete plans and
    lowerings are cached by the choices they depend on."""

    _cache: dict = {}

    def __init__(self, graph: Graph, tile_count: int, plans: dict | None = None):
        self.graph, self.tile_count = graph, tile_count
        self.reg = registry()
        self.plans = plans if plans is not None else plans_of(graph, tile_count)
        self.producer = graph.producer()
        self._plan: dict = {}
        self._lowered: OrderedDict = OrderedDict()          # least recently used first
        self._lowered_lock = threading.Lock()
        self._reads: dict = {}
        self.builds: list = []                  # build_program's last builds (``_Build``)
        self.replayed = 0                       # operations build_program took from a kept build's middle
        self.building = threading.Lock()        # one build at a time: builds and value ids are shared
        self.value_ids: dict[str, int] = {}     # value key -> its number in the builds' buffer rows
        self.value_keys: list[str] = []

    @classmethod
    def of(cls, graph: Graph, tile_count: int) -> "PlanResolver":
        """The resolver of a graph, kept for the process: a search builds the programs of many
        layouts of one graph, and their plans and lowerings are the same."""
        key = (graph.digest(), tile_count, id(registry()))
        found = cls._cache.get(key)
        if found is None:
            if len(cls._cache) >= 4:
                cls._cache.clear()
            found = cls._cache[key] = cls(graph, tile_count)
        return found

    def resolve(self, layout: dict) -> dict[int, tuple]:
        """``{op id: (choice, offset)}``: ``choice`` names the concrete plan (the plan index,
        and for a follow plan the producer's choice); ``offset`` is where its tiles start."""
        out = {}
        for op in self.graph.ops:
            c = layout["ops"][str(op.id)]
            i = c["plan"]
            if not 0 <= i < len(self.plans[op.id]):
                raise UserError(f"layout of operation {op.name}", f"plan {i} out of range")
            plan = self.plans[op.id][i]
            if "follow" in plan:
                choice, offset = out[self.producer[op.inputs[plan["follow"]]].id]
                out[op.id] = ((i, choice), offset)
            else:
                out[op.id] = ((i,), c["offset"])
        return out

    def keep(self, layout: dict) -> None:
        """Forget every concrete plan and lowering but those ``layout`` uses."""
        wanted = {(op_id, choice) for op_id, (choice, _) in self.resolve(layout).items()}
        self._plan = {k: v for k, v in self._plan.items() if k in wanted}
        with self._lowered_lock:
            self._lowered = OrderedDict((k, v) for k, v in self._lowered.items() if k in wanted)

    def keep_choice(self, op, choice: tuple) -> None:
        """Forget the operation's concrete plans and lowerings but ``choice``'s (a placement that
        has chosen its plan; another is remade, the same, if asked for)."""
        with self._lowered_lock:
            for table in (self._plan, self._lowered):
                for k in [k for k in table if k[0] == op.id and k[1] != choice]:
                    del table[k]

    def plan(self, op, choice: tuple) -> dict:
        """The concrete plan of a choice; ValueError if it follows blocks it cannot follow."""
        k = (op.id, choice)
        if k not in self._plan:
            plan = self.plans[op.id][choice[0]]
            if "follow" in plan:
                v = op.inputs[plan["follow"]]
                producer = self.producer[v]
                blocks = [(w.tile, *b[1:]) for st in self.lowering(producer, choice[1]).stages
                          for w in st for b in w.writes if b[0] == key(v)]
                try:
                    plan = self.reg.get(op.type).follow(self.graph, op, plan["follow"], blocks)
                except ValueError as exc:
                    plan = exc
            self._plan[k] = plan
        if isinstance(self._plan[k], ValueError):
            raise self._plan[k]
        return self._plan[k]

    def lowering(self, op, choice: tuple):
        """The lowering of ``op`` with ``choice``; the ``LOWERINGS_KEPT`` most recently asked
        for are kept (another is made again, the same, if asked for)."""
        k = (op.id, choice)
        with self._lowered_lock:
            found = self._lowered.get(k)
            if found is not None:
                self._lowered.move_to_end(k)
                return found
        found = self.reg.get(op.type).lower(self.graph, op, self.plan(op, choice))
        with self._lowered_lock:
            self._lowered[k] = found
            while len(self._lowered) > LOWERINGS_KEPT:
                self._lowered.popitem(last=False)
        return found

    def reads(self, op, choice: tuple) -> list[str]:
        """The values (keys) the lowering of ``op`` with ``choice`` reads, sorted."""
        k = (op.id, choice)
        if k not in self._reads:
            self._reads[k] = sorted({blk[0] for stage in self.lowering(op, choice).stages
                                     for work in stage for blk in work.reads})
        return self._reads[k]


def work_of(graph: Graph) -> list[dict]:
    """Each operation's multiply-accumulates (with the dtype of its first input, which picks
    the AMP rate) and output elements: what the program-independent bound charges."""
    reg = registry()
    out = []
    for op in graph.ops:
        v = graph.values[op.outputs[0]]
        out.append({"op": op.name, "macs": int(reg.get(op.type).macs(graph, op)),
                    "dtype": graph.values[op.inputs[0]].dtype, "elements": v.rows * v.cols})
    return out


class _State(NamedTuple):
    """A build's growing parts (``_build_program``'s lists, arrays and tables)."""
    steps: list
    rows: array
    uses: array
    use_ends: list
    stored: dict
    const_bufs: dict
    input_bufs: dict


def _replay(base: "_Build", j: int, now: _State, gathered: list[str], value_keys: list) -> bool:
    """Append operation ``j`` of ``base`` to the build ``now`` (at the start of operation ``j``)
    as ``base`` made it, renumbered, if ``now`` holds what it reads as ``base`` did: the blocks
    stored of each value it gathers (``gathered``) on the same tiles, in the same order, in
    buffers of the same kinds (a cast in place writes over a gathered copy or an output), and the
    constant and input blocks it made not made yet. Its buffers are then renumbered (its own
    from ``now``'s next number, the others by the blocks and constants they hold) and its steps
    moved to ``now``'s step count: the operation a fresh lowering makes, without the per-buffer
    loop (a search candidate's change moves its consumers' reads; the operations after them
    read what they read before). False, changing nothing, if it cannot."""
    steps0, rows0, const0, input0, counts0 = base.marks[j]
    steps1, rows1, const1, input1, counts1 = base.marks[j + 1]
    old, new = [], []                          # external buffers: base's numbers, now's
    for vk in gathered:
        count = counts0.get(vk, 0)
        if count != (len(now.stored[vk].items) if vk in now.stored else 0):
            return False
        if count:
            (t0, b0), (t1, b1) = base.stored[vk].arrays(), now.stored[vk].arrays()
            if not (np.array_equal(t0[:count], t1) and np.array_equal(b0[:count], b1)):
                return False
            was, now_codes = base.stored[vk].codes()[:count], now.stored[vk].codes()
            if not np.array_equal(buffer_kinds(was), buffer_kinds(now_codes)):
                return False                   # a block held by a gathered copy in one, an output in the other
            old.append(buffer_numbers(was))
            new.append(buffer_numbers(now_codes))
    made_here = ((now.const_bufs, base.made("c")[const0:const1]), (now.input_bufs, base.made("i")[input0:input1]))
    for table, made in made_here:
        if any(key in table for key, _ in made):
            return False                       # made by an earlier operation now: read, not made
    shift = len(now.rows) // ROW_FIELDS - rows0
    uses0 = np.frombuffer(base.uses, np.int64)[base.use_ends[steps0 - 1] if steps0 else 0:base.use_ends[steps1 - 1]
                                               if steps1 else 0]
    table = np.frombuffer(base.rows, np.int64).reshape(-1, ROW_FIELDS)
    external = np.unique(uses0[uses0 < rows0])
    ci = external[np.isin(table[external, 1], _CI)]
    if len(ci):                                 # constants and inputs read: by their blocks
        old.append(ci)
        new.append(np.array([_ci_number(now, row, value_keys) for row in table[ci].tolist()], np.int64))
    old_n = np.concatenate(old) if old else np.zeros(0, np.int64)
    new_n = np.concatenate(new) if new else np.zeros(0, np.int64)
    order = np.argsort(old_n, kind="stable")
    old_n, new_n = old_n[order], new_n[order]
    if (new_n < 0).any() or ((old_n[1:] == old_n[:-1]) & (new_n[1:] != new_n[:-1])).any():
        return False
    if not np.isin(external, old_n).all():
        return False

    def renumber(numbers: np.ndarray) -> np.ndarray:
        numbers = np.asarray(numbers, np.int64)
        out = numbers.copy()
        own = numbers >= rows0
        out[own] += shift
        other = ~own & (numbers > 0)
        out[other] = new_n[np.searchsorted(old_n, numbers[other])]
        return out

    def recode(codes: np.ndarray) -> np.ndarray:
        codes = np.asarray(codes, np.int64)
        return buffer_codes_of(buffer_kinds(codes), renumber(buffer_numbers(codes)))

    step_shift = len(now.steps) - steps0
    made = table[rows0:rows1].copy()
    made[np.isin(made[:, 1], _GO), 3] += step_shift
    now.rows.frombytes(made.tobytes())
    ends = base.use_ends[steps0 - 1] if steps0 else 0
    for t in range(steps0, steps1):
        st = base.steps[t]
        transfers = st["transfers"].copy()
        if len(transfers):
            transfers[:, 1] = recode(transfers[:, 1])
            transfers[:, 5] = recode(transfers[:, 5])
        args, writes = st["args"].copy(), st["writes"].copy()
        args[:, 1] = renumber(args[:, 1])
        writes[:, 1] = renumber(writes[:, 1])
        now.steps.append({**st, "transfers": transfers, "args": args, "writes": writes})
        now.uses.frombytes(renumber(np.frombuffer(base.uses, np.int64)[ends:base.use_ends[t]]).tobytes())
        ends = base.use_ends[t]
        now.use_ends.append(len(now.uses))
    for vk, count in counts1.items():
        items = base.stored[vk].items[counts0.get(vk, 0):count]
        if items:
            numbers = renumber(buffer_numbers(base.stored[vk].codes()[counts0.get(vk, 0):count])).tolist()
            now.stored[vk].add_all([(tile, f"{bid[0]}{n}", blk) for (tile, bid, blk), n in zip(items, numbers)])
    for table, made in made_here:
        for key, (bid, n) in made:
            table[key] = (f"{bid[0]}{n + shift}", n + shift)
    return True


_CI = [BUFFER_KINDS.index("c"), BUFFER_KINDS.index("i")]
_GO = [BUFFER_KINDS.index("g"), BUFFER_KINDS.index("o")]


def _ci_number(now: _State, row: list, value_keys: list) -> int:
    """The number ``now`` gives the constant or input buffer of a buffer row, or -1."""
    tile, kind, _, _, vid, r0, r1, c0, c1 = row
    found = (now.const_bufs if kind == _CI[0] else now.input_bufs).get((tile, (value_keys[vid], r0, r1, c0, c1)))
    return -1 if found is None else found[1]


class _Build:
    """What ``build_program`` made of one layout, kept by the ``PlanResolver`` so that the next
    layout resumes where the two first differ: the operations before that are lowered the same,
    into the same steps, buffers and numbers (a search candidate changes one or two operations;
    on ViT-B/16 the program is most of a candidate's time). ``marks[i]``: the lengths of what
    was made before operation ``i`` (steps, buffer rows, constant and input buffers, each
    value's stored blocks)."""

    def __init__(self, resolved: list, steps, rows, uses, use_ends, stored, const_bufs, input_bufs, marks):
        self.resolved, self.steps, self.rows, self.uses, self.use_ends = resolved, steps, rows, uses, use_ends
        self.stored, self.const_bufs, self.input_bufs, self.marks = stored, const_bufs, input_bufs, marks
        self._made: dict = {}

    def made(self, kind: str) -> list:
        """The constant (``"c"``) or input buffers as ``[(key, (name, number))]``, in the order made."""
        if kind not in self._made:
            self._made[kind] = list((self.const_bufs if kind == "c" else self.input_bufs).items())
        return self._made[kind]

    def common(self, resolved: list) -> int:
        """How many leading operations ``resolved`` (choices and offsets in program order)
        shares with this build."""
        for i, (a, b) in enumerate(zip(self.resolved, resolved)):
            if a != b:
                return i
        return len(resolved)


KEPT_BUILDS = 2                 # the build the last one resumed (in a search, the incumbent's) and the last


def build_program(graph: Graph, layout: dict, tile_count: int, resolver: "PlanResolver | None" = None) -> dict:
    """The program of ``layout``. Its inner loop runs once per buffer read or written (1.4 M on
    ViT-B/16, in every search candidate), so it resumes the kept build of a layout that starts
    the same (``_Build``), takes the later operations that read what they read there from that
    build, renumbered (``_replay``), and keeps buffers as flat int rows, made into the buffer table once,
    at the end, with their last steps from the steps that use them. ``resolver``: the graph's
    (default ``PlanResolver.of``, kept per process, which keeps the builds)."""
    resolver = resolver or PlanResolver.of(graph, tile_count)
    with resolver.building:
        return _build_program(graph, layout, tile_count, resolver)


def _build_program(graph: Graph, layout: dict, tile_count: int, resolver: "PlanResolver") -> dict:
    by_op = resolver.resolve(layout)
    resolved = [by_op[op.id] for op in graph.ops]
    base = max(resolver.builds, key=lambda b: b.common(resolved), default=None)
    first = base.common(resolved) if base is not None else 0
    value_ids, value_keys = resolver.value_ids, resolver.value_keys
    temps: dict[str, tuple] = {}
    for op in graph.ops[:first]:
        temps.update(resolver.lowering(op, by_op[op.id][0]).temps)
    if first:
        n_steps, n_rows, n_const, n_input, counts = base.marks[first]
        steps = base.steps[:n_steps]
        rows = base.rows[:n_rows * ROW_FIELDS]
        use_ends = base.use_ends[:n_steps]
        uses = base.uses[:use_ends[-1] if use_ends else 0]
        stored: dict[str, Blocks] = defaultdict(Blocks, {vk: base.stored[vk].prefix(c) for vk, c in counts.items()})
        const_bufs = dict(itertools.islice(base.const_bufs.items(), n_const))
        input_bufs = dict(itertools.islice(base.input_bufs.items(), n_input))
        marks = base.marks[:first]
    else:
        steps, use_ends, marks = [], [], []
        rows = array("q", bytes(8 * ROW_FIELDS))          # buffer 0: none (buffers are numbered from 1)
        uses = array("q")                                 # the buffers each step reads, in step order
        stored, const_bufs, input_bufs = defaultdict(Blocks), {}, {}
    inputs, constants = set(graph.inputs), set(graph.constants)
    consumers = graph.consumers()
    kind_codes = {k: BUFFER_KINDS.index(k) for k in BUFFER_KINDS}
    kernel_names = kernels_of_registry()
    kernel_index = {k: i for i, k in enumerate(kernel_names)}

    info: dict[str, tuple] = {}

    def vinfo(vk):
        if vk not in info:
            if vk.startswith("v"):
                v = graph.values[int(vk[1:])]
                info[vk] = v.rows, v.cols, v.itemsize, v.name
            else:
                r, c, dtype = temps[vk]
                info[vk] = r, c, {"f32": 4, "f16": 2}.get(dtype, 1), vk
        return info[vk]

    def new_buf(tile, kind, blk, isz, start):
        """A new buffer on ``tile`` for ``blk`` (``(value, r0, r1, c0, c1)``): its name and number."""
        n = len(rows) // ROW_FIELDS
        vid = value_ids.get(blk[0])
        if vid is None:
            vid = value_ids[blk[0]] = len(value_keys)
            value_keys.append(blk[0])
        rows.extend((tile, kind_codes[kind], (blk[2] - blk[1]) * (blk[4] - blk[3]) * isz, start, vid, *blk[1:]))
        return f"{kind}{n}", n

    def mark():
        """The lengths of what is made so far (``_Build.marks``)."""
        return (len(steps), len(rows) // ROW_FIELDS, len(const_bufs), len(input_bufs),
                {vk: len(b.items) for vk, b in stored.items()})

    kinds: dict[str, tuple] = {}                   # value key -> (item size, "c" | "i" | "g")

    def kind_of(vk):
        vid = int(vk[1:]) if vk.startswith("v") else None
        kinds[vk] = found = (vinfo(vk)[2], "c" if vid in constants else "i" if vid in inputs else "g")
        return found

    state = _State(steps, rows, uses, use_ends, stored, const_bufs, input_bufs)
    for j, op in enumerate(graph.ops[first:], first):
        marks.append(mark())
        choice, offset = by_op[op.id]
        try:
            lowering = resolver.lowering(op, choice)
        except ValueError as exc:
            raise UserError(f"layout of operation {op.name}", f"its plan cannot follow its producer: {exc}") from None
        temps.update(lowering.temps)
        if base is not None and base.resolved[j] == resolved[j] and _replay(
                base, j, state, [vk for vk in resolver.reads(op, choice) if (kinds.get(vk) or kind_of(vk))[1] == "g"],
                value_keys):
            resolver.replayed += 1
            continue
        inplace = _casts_in_place(graph, op, consumers)
        for stage_index, stage in enumerate(lowering.stages):
            s = len(steps)
            step = {"name": f"{op.name}#{stage_index}" if len(lowering.stages) > 1 else op.name, "op": op.id}
            vertices = _VertexRows()
            writes = array("q")            # tile, buffer, value, r0, r1, c0, c1, first and end vertex
            on_tile: dict[int, int] = {}   # the tile's vertices so far in the step
            gathered: dict[tuple, tuple] = {}
            gathers: list[tuple] = []       # (value, read block, tile, buffer, item size, blocks stored so far)
            for work in stage:
                if not 0 <= work.tile < tile_count:
                    raise UserError(f"operation {op.name}", f"its plan {resolver.plans[op.id][choice[0]]} needs tile "
                                    f"{work.tile} but the target has {tile_count}; raise target.tile_count")
                tile = (offset + work.tile) % tile_count
                read_bufs, read_numbers = [], []
                for blk in work.reads:
                    vk = blk[0]
                    isz, kind = kinds.get(vk) or kind_of(vk)
                    if kind == "g":
                        bid = stored[vk].exact(tile, blk[1:]) if vk in stored else None
                        if bid is not None:
                            n = int(bid[1:])
                        else:
                            found = gathered.get((tile, blk))
                            if found is None:
                                gathered[(tile, blk)] = found = new_buf(tile, "g", blk, isz, s)
                                gathers.append((vk, blk, tile, found[0], isz, len(stored[vk].items)))
                            bid, n = found
                    else:
                        table = const_bufs if kind == "c" else input_bufs
                        found = table.get((tile, blk))
                        if found is None:
                            table[(tile, blk)] = found = new_buf(tile, kind, blk, isz, 0)
                        bid, n = found
                    uses.append(n)
                    read_bufs.append(bid)
                    read_numbers.append(n)
                write_numbers = []
                for blk in work.writes:
                    vk = blk[0]
                    if inplace and not read_bufs[0].startswith(("c", "i")):
                        bid, n = read_bufs[0], read_numbers[0]     # the cast overwrites its input's buffer
                    else:
                        isz = (kinds.get(vk) or kind_of(vk))[0]
                        bid, n = new_buf(tile, "o", blk, isz, s)
                    stored[vk].add(tile, bid, blk[1:])
                    write_numbers.append(n)
                first_vertex = on_tile.get(tile, 0)
                for kernel, args in work.vertices:
                    vertices.add(tile, kernel_index[kernel], args, read_numbers, write_numbers)
                on_tile[tile] = first_vertex + len(work.vertices)
                # which buffer holds each block written, and the vertices that wrote it (for read-back)
                for n, blk in zip(write_numbers, work.writes):
                    writes.extend((tile, n, int(blk[0][1:]) if blk[0].startswith("v") else -1, *blk[1:],
                                   first_vertex, on_tile[tile]))
            step["transfers"] = _gather(gathers, stored, uses, vinfo)
            step.update(vertices.arrays())
            step["writes"] = np.frombuffer(writes, np.int64).reshape(-1, len(WRITE_FIELDS)).astype(np.int32)
            steps.append(step)
            use_ends.append(len(uses))
    marks.append(mark())
    if first < len(resolved):      # kept: the build it resumed (the incumbent's, in a search) and it
        build = _Build(resolved, steps, rows, uses, use_ends, stored, const_bufs, input_bufs, marks)
        resolver.builds = [b for b in resolver.builds if b is base][:KEPT_BUILDS - 1] + [build]

    end = len(steps)
    table = np.frombuffer(rows, dtype=np.int64).reshape(-1, ROW_FIELDS)
    # a buffer lives from its first step to the last that reads it; constants persist across
    # runs, and the outputs' buffers until the program ends
    ends = table[:, 3].copy()
    used_at = np.repeat(np.arange(end, dtype=np.int64), np.diff(np.asarray(use_ends, dtype=np.int64), prepend=0))
    np.maximum.at(ends, np.frombuffer(uses, dtype=np.int64), used_at)
    ends[table[:, 1] == kind_codes["c"]] = end
    outputs = []
    for vid in graph.outputs:
        v = graph.values[vid]
        ranges = []
        for tile, bid, (r0, r1, c0, c1) in stored[f"v{vid}"].items:
            ends[int(bid[1:])] = end
            ranges.append([tile, bid, r0, r1, c0, c1])
        outputs.append({"value": vid, "name": v.name, "ranges": sorted(ranges)})
    in_ranges = defaultdict(list)
    for (tile, blk), (bid, _) in sorted(input_bufs.items()):
        in_ranges[int(blk[0][1:])].append([tile, bid, *blk[1:]])
    return {
        "tile_count": tile_count,
        "kernels": kernel_names,
        "steps": steps,
        "buffers": table_of_rows(table[1:], ends[1:], value_keys, tile_count),
        "inputs": [{"value": vid, "name": graph.values[vid].name, "ranges": in_ranges[vid]}
                   for vid in graph.inputs],
        "outputs": outputs,
        "names": {**{f"v{vid}": v.name for vid, v in graph.values.items()}, **{t: t for t in temps}},
        "work": work_of(graph),
    }


def program_blob(program: dict) -> bytes:
    """The ``program`` artifact: its steps' transfers, vertices and writes and its buffer table
    as arrays (``to_plan_blob``), the rest JSON."""
    return to_plan_blob(program, (*(("steps", "*", k) for k in STEP_ARRAYS), ("buffers", "table")))


#: what a step holds as arrays: its transfers (``TRANSFER_FIELDS``), its vertices (``VERTEX_FIELDS``)
#: and their arguments (``ARG_FIELDS``), and the blocks it writes (``WRITE_FIELDS``)
STEP_ARRAYS = ("transfers", "vertices", "args", "writes")
#: a vertex: its tile, its kernel (an index into the program's ``kernels``) and how many arguments
#: it takes (they follow the previous vertex's in ``args``); a step's vertices are in tile order,
#: each tile's in the order it runs them
VERTEX_FIELDS = ("tile", "kernel", "args")
#: an argument: a number, or (``buffer`` not 0) a byte offset into the buffer of that number
ARG_FIELDS = ("value", "buffer")
#: a written block: the tile and buffer that hold it, the value (its id; -1 for an operation's
#: temporary) and its block, and the tile's vertices of the step that wrote it
WRITE_FIELDS = ("tile", "buffer", "value", "r0", "r1", "c0", "c1", "first_vertex", "end_vertex")


def kernels_of_registry() -> list[str]:
    """Every kernel variant the plugins declare, sorted: what a program's vertices index."""
    return sorted(registry().kernels)


class _VertexRows:
    """One step's vertices as ``build_program`` makes them (in work order), made into the
    step's arrays (in tile order) at the end."""

    def __init__(self):
        self.tile, self.kernel, self.count = array("q"), array("q"), array("q")
        self.args = array("q")               # value, buffer; value, buffer; ...

    def add(self, tile: int, kernel: int, args: list, read_numbers: list, write_numbers: list) -> None:
        self.tile.append(tile)
        self.kernel.append(kernel)
        self.count.append(len(args))
        out = self.args
        for a in args:
            if isinstance(a, tuple):      # ("r" | "w", i, byte offset): the i-th buffer read or written
                out.append(a[2])
                out.append((read_numbers if a[0] == "r" else write_numbers)[a[1]])
            else:
                out.append(a)
                out.append(0)

    def arrays(self) -> dict:
        tile = np.frombuffer(self.tile, np.int64)
        count = np.frombuffer(self.count, np.int64)
        args = np.frombuffer(self.args, np.int64).reshape(-1, len(ARG_FIELDS))
        order = np.argsort(tile, kind="stable")
        vertices = np.stack([tile, np.frombuffer(self.kernel, np.int64), count], axis=1)[order]
        if not (order[1:] > order[:-1]).all():          # the arguments follow their vertices
            start = np.cumsum(count) - count
            args = args[_ranges(start[order], count[order])]
        return {"vertices": vertices.astype(np.int32), "args": np.ascontiguousarray(args)}


def _ranges(starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """The indices ``starts[0] … starts[0] + counts[0] - 1``, then the next range's, …"""
    owner = np.repeat(np.arange(len(counts)), counts)
    return starts[owner] + np.arange(len(owner)) - np.repeat(np.cumsum(counts) - counts, counts)


def _casts_in_place(graph: Graph, op, consumers) -> bool:
    """A cast stores its output over its input when the cast storage policy says ``inplace``
    for it, the cast narrows (the kernel then runs forward safely in place), and nothing else
    reads the input."""
    if op.type != "cast" or graph.cast_storage.for_site(op) != "inplace":
        return False
    src, dst = graph.values[op.inputs[0]], graph.values[op.outputs[0]]
    return (dst.itemsize <= src.itemsize and len(consumers[src.id]) == 1
            and src.id not in graph.outputs and src.id not in graph.inputs and src.id not in graph.constants)


def _gather(gathers: list[tuple], stored: dict, uses, vinfo) -> np.ndarray:
    """The transfers of one step, as an array (rows: ``TRANSFER_FIELDS``, buffers as
    ``buffer_code``): for each gathered read block in turn, a transfer from every block stored
    before it that it overlaps (in the order they were stored), each the rows of their
    intersection. Appends the source buffers' numbers to ``uses`` (they live until this step)."""
    if not gathers:
        return no_transfers()
    by_value: dict[str, list[int]] = {}
    for i, g in enumerate(gathers):
        by_value.setdefault(g[0], []).append(i)
    parts = []
    for vk, idx in by_value.items():
        src = stored[vk]
        reads = np.array([gathers[i][1][1:] for i in idx], dtype=np.int64).reshape(-1, 4)
        ri, si = src.pairs(reads)
        seen = np.array([gathers[i][5] for i in idx], dtype=np.int64)
        keep = si < seen[ri]                  # blocks stored later in this step are not there yet
        ri, si = ri[keep], si[keep]
        tiles, blocks = src.arrays()
        codes = src.codes()
        r, b = reads[ri], blocks[si]
        ir0, ir1 = np.maximum(r[:, 0], b[:, 0]), np.minimum(r[:, 1], b[:, 1])
        ic0, ic1 = np.maximum(r[:, 2], b[:, 2]), np.minimum(r[:, 3], b[:, 3])
        covered = np.bincount(ri, weights=(ir1 - ir0) * (ic1 - ic0), minlength=len(idx))
        want = (reads[:, 1] - reads[:, 0]) * (reads[:, 3] - reads[:, 2])
        if (covered != want).any():
            k = int(np.nonzero(covered != want)[0][0])
            raise AssertionError(f"block {gathers[idx[k]][1]} of {vinfo(vk)[3]} is not covered by its producer's blocks")
        isz = vinfo(vk)[2]
        order = np.asarray(idx, dtype=np.int64)[ri]
        dst_tile = np.array([gathers[i][2] for i in idx], dtype=np.int64)[ri]
        dst_buf = buffer_codes([gathers[i][3] for i in idx])[ri]
        rows = np.stack([tiles[si], codes[si], ((ir0 - b[:, 0]) * (b[:, 3] - b[:, 2]) + (ic0 - b[:, 2])) * isz,
                         (b[:, 3] - b[:, 2]) * isz, dst_tile, dst_buf,
                         ((ir0 - r[:, 0]) * (r[:, 3] - r[:, 2]) + (ic0 - r[:, 2])) * isz, (r[:, 3] - r[:, 2]) * isz,
                         ir1 - ir0, (ic1 - ic0) * isz], axis=1)
        parts.append((order, si, rows))
        uses.extend(int(src.items[i][1][1:]) for i in np.unique(si).tolist())
    order = np.concatenate([o for o, _, _ in parts])
    si = np.concatenate([x for _, x, _ in parts])
    rows = np.concatenate([x for _, _, x in parts])
    return np.ascontiguousarray(rows[np.lexsort((si, order))], dtype=np.int32)


def kernels_per_tile(program: dict) -> dict[str, list[str]]:
    """The kernel variants each tile runs (every tile of the target, possibly none)."""
    tiles, names = program["tile_count"], program["kernels"]
    pairs = np.unique(np.concatenate([s["vertices"][:, 0].astype(np.int64) * len(names) + s["vertices"][:, 1]
                                      for s in program["steps"]] + [np.zeros(0, np.int64)]))
    out: dict[str, list[str]] = {str(t): [] for t in range(tiles)}
    for tile, kernel in zip((pairs // len(names)).tolist(), (pairs % len(names)).tolist()):
        out[str(tile)].append(names[kernel])
    return out


def vertices_of(program: dict, step: dict) -> dict[str, list]:
    """A step's vertices as ``{tile: [[kernel, args], ...]}`` (tiles that run none left out), a
    buffer argument as ``["b", buffer name, byte offset]``: for reading a program, not for
    passes over all of it."""
    buffers = program["buffers"]["table"]
    names = buffer_names(buffers[:, 1])
    by_number = dict(zip(buffer_numbers(buffers[:, 1]).tolist(), names))
    out: dict[str, list] = {}
    args = step["args"].tolist()
    at = 0
    for tile, kernel, count in step["vertices"].tolist():
        out.setdefault(str(tile), []).append([program["kernels"][kernel], [
            ["b", by_number[b], v] if b else v for v, b in args[at:at + count]]])
        at += count
    return out