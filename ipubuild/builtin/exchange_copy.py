"""The simulator's exchange phase in C: the copies an exchange table says, row by row, with
``simulator.run_exchange``'s checks and its semantics (every read before any write; an entry out
of range, or two entries writing one byte, leave the memory as it was).

numpy moves a phase as gathers and scatters over one index per row copied, which it must make,
sort and check first: on ViT-B/16 that was 5.1 s of a 14.6 s device run, 2.2 s here (most of
it the double-write stamping). Here the rows are ``memcpy``'d into a staging buffer (the reads), checked for
double writes by stamping each destination tile's bytes, then ``memcpy``'d out (the writes).
Compiled by the system C compiler as the planner's loops are (``compiler.planning.native``);
without one, or where ``$IPUBUILD_NATIVE_SIM_EXCHANGE=0``, the numpy form runs (the tests run
both on the same phases).
"""
from __future__ import annotations

import ctypes

import numpy as np

from ..compiler.planning import native

P = ctypes.c_void_p
I64 = ctypes.c_int64


def library(nice: int = 0):
    """The compiled copier (a ctypes library), or None (no compiler, or switched off)."""
    return native.library("sim_exchange", SOURCE, {
        "xc_check": (I64, [I64, P, P, I64, I64]),
        "xc_gather": (None, [I64, P, P, I64, P, P]),
        "xc_overlap": (I64, [I64, P, P, I64, P]),
        "xc_scatter": (None, [I64, P, P, I64, P, P]),
        "xc_inside": (None, [I64, P, I64, I64, P, P, P]),
        "xc_rows_by_step": (None, [I64, P, P, P, I64, P, P])},
        switch="IPUBUILD_NATIVE_SIM_EXCHANGE", nice=nice)


#: a phase moving fewer bytes is copied on one thread (handing work to a second costs more)
PARALLEL_BYTES = 4 << 20


def copy_phase(memory: np.ndarray, row_of: np.ndarray, entries: np.ndarray, pool=None):
    """Perform the phase ``entries`` (``[n, 8]``: ``src_tile, src_addr, src_stride, dst_tile,
    dst_addr, dst_stride, rows, row_bytes``) over ``memory`` (one C-contiguous row of bytes per
    loaded tile). Returns None when done, ``("range", i)`` when the source of entry ``i``
    (``i < n``) or the destination of entry ``i - n`` is out of range, ``("overlap", -1)`` when two entries write one
    byte (memory untouched in both cases), or False when the C form is not available. With a
    ``pool`` (a thread pool), a phase of ``PARALLEL_BYTES`` or more is copied in two halves at
    once (the C calls let go of the GIL): the reads, then the destination tiles' checks, then the
    writes, each half of the entries (or tiles) on its own thread."""
    lib = library()
    if lib is None or not memory.flags.c_contiguous or memory.dtype != np.uint8:
        return False
    e = np.ascontiguousarray(entries, dtype=np.int64)
    rows_of = np.ascontiguousarray(row_of, dtype=np.int64)
    n, size = len(e), memory.shape[1]
    c = lambda a: a.ctypes.data  # noqa: E731
    bad = lib.xc_check(n, c(e), c(rows_of), len(rows_of), size)
    if bad >= 0:
        return ("range", int(bad))
    live = (e[:, 6] > 0) & (e[:, 7] > 0)
    ends = np.cumsum(np.where(live, e[:, 6] * e[:, 7], 0))        # where each entry's staged rows end
    total = int(ends[-1]) if n else 0
    stage = np.empty(max(1, total), np.uint8)
    order = np.ascontiguousarray(np.argsort(e[:, 3], kind="stable"), dtype=np.int64)   # by destination tile
    halves = [(0, n)]
    if pool is not None and total >= PARALLEL_BYTES:
        cut = int(np.searchsorted(ends, total // 2))
        halves = [(0, cut), (cut, n)]
        tiles = e[order, 3]                   # the checks split where a destination tile begins
        at = int(np.searchsorted(tiles, tiles[n // 2]))
        tile_halves = [(0, at), (at, n)]
    else:
        tile_halves = halves

    def both(work, parts):
        """``work(lo, hi)`` on each part, the second on the pool; their results."""
        later = pool.submit(work, *parts[1]) if len(parts) > 1 else None
        return [work(*parts[0])] + ([later.result()] if later else [])

    def staged(lo):
        return c(stage) + (int(ends[lo - 1]) if lo else 0)

    def check(lo, hi):
        stamp = np.zeros(size, np.uint8)      # each thread's own, alive through its call
        return lib.xc_overlap(hi - lo, c(e), c(order) + 8 * lo, size, c(stamp))

    both(lambda lo, hi: lib.xc_gather(hi - lo, c(e) + 64 * lo, c(rows_of), size, c(memory), staged(lo)), halves)
    if max(both(check, tile_halves)) >= 0:
        return ("overlap", -1)
    both(lambda lo, hi: lib.xc_scatter(hi - lo, c(e) + 64 * lo, c(rows_of), size, c(memory), staged(lo)), halves)
    return None


def inside(entries: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> np.ndarray | None:
    """``[2, n]``: whether each entry's source rows (0) and destination rows (1) lie inside one
    of their tile's ranges ``[lo[tile, j], hi[tile, j])`` (an entry that moves nothing is inside;
    a tile past the tables is not); None if the C form is not available."""
    lib = library()
    if lib is None:
        return None
    e = np.ascontiguousarray(entries, dtype=np.int64)
    lo, hi = (np.ascontiguousarray(a, dtype=np.int64) for a in (lo, hi))
    out = np.empty((2, len(e)), np.uint8)
    lib.xc_inside(len(e), e.ctypes.data, lo.shape[0], lo.shape[1], lo.ctypes.data, hi.ctypes.data, out.ctypes.data)
    return out.astype(bool)


def rows_by_step(tables: list, steps: np.ndarray, n_steps: int) -> tuple[np.ndarray, np.ndarray] | None:
    """The rows of ``tables`` (each ``[n, 8]`` int64, tile by tile) copied into one array in step
    order — one step's rows in table order, then row order — and where each step's rows begin
    (``n_steps + 1`` bounds); ``steps`` is each row's step, in table order (each in ``[0,
    n_steps)``). None if the C form is not available. A counting sort that writes every row once,
    straight from its table: concatenating the tables first and gathering each step's rows when
    it runs moved ViT-B/16's 6 M rows (384 MB) twice."""
    lib = library()
    if lib is None:
        return None
    tables = [np.ascontiguousarray(t, dtype=np.int64).reshape(-1, 8) for t in tables]
    s = np.ascontiguousarray(steps, dtype=np.int64)
    counts = np.array([len(t) for t in tables], np.int64)
    if int(counts.sum()) != len(s):
        raise ValueError(f"{len(s)} steps for {int(counts.sum())} rows")
    pointers = np.array([t.ctypes.data for t in tables], np.uint64)
    rows = np.empty((len(s), 8), np.int64)
    bounds = np.empty(n_steps + 1, np.int64)
    lib.xc_rows_by_step(len(tables), pointers.ctypes.data, counts.ctypes.data, s.ctypes.data, n_steps,
                        rows.ctypes.data, bounds.ctypes.data)
    return rows, bounds


SOURCE = r"""/* The simulator's exchange phase (builtin/exchange_copy.py): entries are int64 rows of
 * src_tile, src_addr, src_stride, dst_tile, dst_addr, dst_stride, rows, row_bytes; row_of maps a
 * tile to its row of the memory (-1: not loaded); every row of memory is `size` bytes. */
#include <stdint.h>
#include <string.h>

static int out_of_range(const int64_t *row_of, int64_t tiles, int64_t size, int64_t tile,
                        int64_t addr, int64_t stride, int64_t rows, int64_t rb) {
    if (tile < 0 || tile >= tiles || row_of[tile] < 0 || addr < 0) return 1;
    return addr + (rows - 1) * stride + rb > size;
}

/* the first entry whose source is out of range (i), else whose destination is (n + i), else -1 */
int64_t xc_check(int64_t n, const int64_t *e, const int64_t *row_of, int64_t tiles, int64_t size) {
    for (int side = 0; side < 2; side++)
        for (int64_t i = 0; i < n; i++) {
            const int64_t *x = e + 8 * i + 3 * side;
            if (out_of_range(row_of, tiles, size, x[0], x[1], x[2], e[8 * i + 6], e[8 * i + 7]))
                return side * n + i;
        }
    return -1;
}

/* every source row, entry by entry, into stage (the reads, before any write) */
void xc_gather(int64_t n, const int64_t *e, const int64_t *row_of, int64_t size, const uint8_t *mem,
               uint8_t *stage) {
    for (int64_t i = 0; i < n; i++) {
        const int64_t *x = e + 8 * i;
        if (x[6] <= 0 || x[7] <= 0) continue;
        const uint8_t *src = mem + row_of[x[0]] * size + x[1];
        for (int64_t r = 0; r < x[6]; r++, stage += x[7]) memcpy(stage, src + r * x[2], (size_t)x[7]);
    }
}

/* -1, or the first entry (in `order`: by destination tile) writing a byte one before it wrote.
 * stamp (one tile's bytes, zeroed) holds at b the mark of the destination tile that last wrote
 * byte b: marks count 1..255 and the stamps are cleared when they wrap, so the stamps of one
 * tile never match another's. A row is checked whole with memchr (the C library's vector
 * search: on ViT-B/16's phases 0.18 s, where a byte loop took 0.94 s), then stamped with memset. */
int64_t xc_overlap(int64_t n, const int64_t *e, const int64_t *order, int64_t size, uint8_t *stamp) {
    int64_t tile = -1;
    uint8_t mark = 0;
    for (int64_t k = 0; k < n; k++) {
        const int64_t *x = e + 8 * order[k];
        if (x[6] <= 0 || x[7] <= 0) continue;
        if (x[3] != tile) {
            tile = x[3];
            if (mark == 255) { memset(stamp, 0, (size_t)size); mark = 0; }
            mark++;
        }
        for (int64_t r = 0; r < x[6]; r++) {
            uint8_t *s = stamp + x[4] + r * x[5];
            if (memchr(s, mark, (size_t)x[7])) return order[k];
            memset(s, mark, (size_t)x[7]);
        }
    }
    return -1;
}

/* inside[side * n + i]: whether entry i's rows on that side (0: source, 1: destination) lie in
 * one of its tile's k ranges [lo, hi) (rows of tiles x k); an entry moving nothing is inside */
void xc_inside(int64_t n, const int64_t *e, int64_t tiles, int64_t k, const int64_t *lo, const int64_t *hi,
               uint8_t *inside) {
    for (int64_t i = 0; i < n; i++) {
        const int64_t *x = e + 8 * i;
        for (int side = 0; side < 2; side++) {
            int64_t tile = x[3 * side], addr = x[3 * side + 1], end = addr + (x[6] - 1) * x[3 * side + 2] + x[7];
            uint8_t in = x[6] <= 0 || x[7] <= 0;
            if (!in && tile >= 0 && tile < tiles)
                for (int64_t j = 0; j < k && !in; j++)
                    in = lo[tile * k + j] <= addr && end <= hi[tile * k + j];
            inside[side * n + i] = in;
        }
    }
}

/* the rows of `tables` tables (table t: counts[t] rows of 8 int64 at rows[t]) into `out` in step
 * order (stable), step[i] being the step of the i-th row in table order; bounds[s]: where step s
 * begins in `out` (n_steps + 1 of them) */
void xc_rows_by_step(int64_t tables, const int64_t *const *rows, const int64_t *counts, const int64_t *step,
                     int64_t n_steps, int64_t *out, int64_t *bounds) {
    int64_t n = 0;
    for (int64_t t = 0; t < tables; t++) n += counts[t];
    for (int64_t s = 0; s <= n_steps; s++) bounds[s] = 0;
    for (int64_t i = 0; i < n; i++) bounds[step[i] + 1]++;
    for (int64_t s = 0; s < n_steps; s++) bounds[s + 1] += bounds[s];
    for (int64_t t = 0, i = 0; t < tables; t++)
        for (int64_t j = 0; j < counts[t]; j++, i++)
            memcpy(out + 8 * bounds[step[i]]++, rows[t] + 8 * j, 8 * sizeof(int64_t));
    for (int64_t s = n_steps; s > 0; s--) bounds[s] = bounds[s - 1];
    bounds[0] = 0;
}

/* every staged row to its destination (the writes) */
void xc_scatter(int64_t n, const int64_t *e, const int64_t *row_of, int64_t size, uint8_t *mem,
                const uint8_t *stage) {
    for (int64_t i = 0; i < n; i++) {
        const int64_t *x = e + 8 * i;
        if (x[6] <= 0 || x[7] <= 0) continue;
        uint8_t *dst = mem + row_of[x[3]] * size + x[4];
        for (int64_t r = 0; r < x[6]; r++, stage += x[7]) memcpy(dst + r * x[5], stage, (size_t)x[7]);
    }
}
"""
