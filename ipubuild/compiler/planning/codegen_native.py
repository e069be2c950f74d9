"""Reading tile programs and exchange tables in C (``codegen``'s formats), compiled and loaded by
``native``. Both formats are sequences of variable-length records, so finding where each record
begins is a loop over the bytes: in Python it was 2.4 s of reading ViT-B/16's package (234 K
vertices and 1.4 M exchange entries on 1,472 tiles), here a few milliseconds. The loops only
scan and copy; every check on what they find (kernel indices, steps, tiles, addresses) is done
over the arrays they return. ``tests/test_package.py`` checks they read what the Python forms
read, and refuse what they refuse, on random and damaged tables."""
from __future__ import annotations

import ctypes

import numpy as np

from . import native

P = ctypes.c_void_p
I64 = ctypes.c_int64


def library():
    return native.library("codegen_read", SOURCE, {
        "tp_scan": (I64, [P, I64, P]),
        "tp_fill": (None, [P, I64, P, P, P, P]),
        "tx_scan": (I64, [P, I64, I64, P]),
        "tx_rows": (None, [P, I64, P, P, P]),
        "tx_outside": (None, [I64, P, I64, P, I64, I64, P])})


def program_arrays(data: bytes):
    """A tile program (``codegen.encode_program``'s bytes) as ``(kernel names, steps, vertex
    kernels, argument starts, arguments)``: ``steps`` ``[[step, first vertex, end vertex], ...]``
    (int64), each vertex's kernel index (int64), where its arguments start in ``arguments``
    (int64, one more than the vertices) and the arguments (uint32). None if the C form is not
    available; ValueError if the bytes are not exactly a program."""
    lib = library()
    if lib is None:
        return None
    raw = np.frombuffer(data, np.uint8)
    counts = np.zeros(5, np.int64)        # kernels, steps, vertices, arguments, where the names end
    if len(raw) < 16 or lib.tp_scan(raw.ctypes.data, len(raw), counts.ctypes.data) < 0:
        raise ValueError("not a tile program")
    nk, ns, nv, na, names_end = counts.tolist()
    names, pos = [], 16
    for _ in range(nk):
        n = int.from_bytes(data[pos:pos + 2], "little")
        names.append(data[pos + 2:pos + 2 + n].decode())
        pos += 2 + n
    steps = np.empty((ns, 3), np.int64)
    kernels = np.empty(nv, np.int64)
    starts = np.empty(nv + 1, np.int64)
    args = np.empty(na, np.uint32)
    lib.tp_fill(raw.ctypes.data, names_end, steps.ctypes.data, kernels.ctypes.data, starts.ctypes.data,
                args.ctypes.data)
    return names, steps, kernels, starts, args


def exchange_starts(words: np.ndarray, count: int) -> np.ndarray | None:
    """Where each of ``count`` entries of an exchange table begins in its ``words`` (the u32s
    after the magic: version, count, then entries of 7 words and 3 per destination); None if
    the C form is not available; ValueError as ``codegen.decode_exchange_arrays``."""
    lib = library()
    if lib is None:
        return None
    w = np.ascontiguousarray(words, dtype=np.uint32)
    at = np.empty(count, np.int64)
    found = lib.tx_scan(w.ctypes.data, len(w), count, at.ctypes.data)
    if found == -1:
        raise ValueError("truncated exchange table")
    if found == -2:
        raise ValueError("exchange table has trailing bytes")
    return at


def exchange_rows(words: np.ndarray, at: np.ndarray, n_rows: int) -> tuple[np.ndarray, np.ndarray] | None:
    """The entries of an exchange table that begin at ``at`` in its ``words`` (``exchange_starts``)
    as one row per destination — ``src_tile, src_addr, src_stride, dst_tile, dst_addr,
    dst_stride, rows, row_bytes`` (int64, ``[n_rows, 8]``) — and each row's entry; None if the C
    form is not available."""
    lib = library()
    if lib is None:
        return None
    w = np.ascontiguousarray(words, dtype=np.uint32)
    at = np.ascontiguousarray(at, dtype=np.int64)
    rows = np.empty((n_rows, 8), np.int64)
    entry = np.empty(n_rows, np.int64)
    lib.tx_rows(w.ctypes.data, len(at), at.ctypes.data, rows.ctypes.data, entry.ctypes.data)
    return rows, entry


def rows_outside(rows: np.ndarray, loaded: np.ndarray, lo: int, hi: int) -> np.ndarray | None:
    """Whether each of ``exchange_rows``' rows leaves the loaded tiles (``loaded``: a bool per
    tile of the machine and one past them, which any larger tile number reads) or the memory
    ``[lo, hi)`` on either side: its first byte below ``lo``, or its last row's end past ``hi``
    (counted without overflow). None if the C form is not available."""
    lib = library()
    if lib is None:
        return None
    r = np.ascontiguousarray(rows, dtype=np.int64)
    mask = np.ascontiguousarray(loaded, dtype=np.uint8)
    out = np.empty(len(r), np.uint8)
    lib.tx_outside(len(r), r.ctypes.data, len(mask) - 1, mask.ctypes.data, lo, hi, out.ctypes.data)
    return out.view(bool)


SOURCE = r"""/* Scanning codegen's formats (planning/codegen_native.py). A tile program: "TPRG", u32 version
 * (1), kernels, steps; per kernel u16 length and its name; per step u32 step and vertices; per
 * vertex u16 kernel, u16 argument count and the u32 arguments. An exchange table (after its
 * magic): u32 version, count, then per entry 7 words (the 7th: destinations, at least 1) and 3
 * per destination. Integers little-endian; nothing is read past the end. */
#include <stdint.h>
#include <string.h>

static uint32_t u32(const uint8_t *p) { uint32_t v; memcpy(&v, p, 4); return v; }
static uint16_t u16(const uint8_t *p) { uint16_t v; memcpy(&v, p, 2); return v; }

/* counts[]: kernels, steps, vertices, arguments, where the names end; 0 if the bytes are exactly
 * a program of version 1, else -1 */
int64_t tp_scan(const uint8_t *d, int64_t n, int64_t *counts) {
    if (n < 16 || u32(d + 4) != 1) return -1;
    int64_t nk = u32(d + 8), ns = u32(d + 12), pos = 16, nv = 0, na = 0;
    for (int64_t k = 0; k < nk; k++) {
        if (pos + 2 > n) return -1;
        pos += 2 + u16(d + pos);
        if (pos > n) return -1;
    }
    counts[4] = pos;
    for (int64_t s = 0; s < ns; s++) {
        if (pos + 8 > n) return -1;
        int64_t verts = u32(d + pos + 4);
        pos += 8;
        for (int64_t v = 0; v < verts; v++) {
            if (pos + 4 > n) return -1;
            int64_t args = u16(d + pos + 2);
            pos += 4 + 4 * args;
            if (pos > n) return -1;
            nv++;
            na += args;
        }
    }
    if (pos != n) return -1;
    counts[0] = nk; counts[1] = ns; counts[2] = nv; counts[3] = na;
    return 0;
}

/* after tp_scan: steps[] (step, first vertex, end vertex), each vertex's kernel index, where its
 * arguments start (one more than the vertices) and the arguments */
void tp_fill(const uint8_t *d, int64_t pos, int64_t *steps, int64_t *kernel, int64_t *starts, uint32_t *args) {
    int64_t ns = u32(d + 12), v = 0, a = 0;
    for (int64_t s = 0; s < ns; s++) {
        int64_t verts = u32(d + pos + 4);
        steps[3 * s] = u32(d + pos);
        steps[3 * s + 1] = v;
        pos += 8;
        for (int64_t i = 0; i < verts; i++, v++) {
            int64_t count = u16(d + pos + 2);
            kernel[v] = u16(d + pos);
            starts[v] = a;
            for (int64_t j = 0; j < count; j++) args[a++] = u32(d + pos + 4 + 4 * j);
            pos += 4 + 4 * count;
        }
        steps[3 * s + 2] = v;
    }
    starts[v] = a;
}

/* at[k] = where entry k begins (words[0] is the version, words[1] the count); the number of
 * entries, -1 if one is truncated or has no destination, -2 if words are left over */
int64_t tx_scan(const uint32_t *w, int64_t total, int64_t count, int64_t *at) {
    int64_t pos = 2;
    for (int64_t k = 0; k < count; k++) {
        if (pos + 7 > total || w[pos + 6] < 1 || pos + 7 + 3 * (int64_t)w[pos + 6] > total) return -1;
        at[k] = pos;
        pos += 7 + 3 * (int64_t)w[pos + 6];
    }
    return pos == total ? count : -2;
}

/* after tx_scan: each entry's destinations as rows (src_tile, src_addr, src_stride, dst_tile,
 * dst_addr, dst_stride, rows, row_bytes) and each row's entry */
/* out[i]: whether row i (as tx_rows writes them) leaves the loaded tiles (loaded[tile], tile
 * numbers past `tiles` reading loaded[tiles]) or [lo, hi) on its source or destination side */
void tx_outside(int64_t n, const int64_t *rows, int64_t tiles, const uint8_t *loaded, int64_t lo, int64_t hi,
                uint8_t *out) {
    for (int64_t i = 0; i < n; i++, rows += 8) {
        unsigned __int128 k = rows[6] > 1 ? (unsigned __int128)(rows[6] - 1) : 0;
        uint8_t o = 0;
        for (int side = 0; side < 6; side += 3) {
            int64_t tile = rows[side] < tiles ? rows[side] : tiles, addr = rows[side + 1];
            o |= !loaded[tile] || addr < lo
                 || (unsigned __int128)addr + k * (unsigned __int128)rows[side + 2] + (unsigned __int128)rows[7]
                    > (unsigned __int128)hi;
        }
        out[i] = o;
    }
}

void tx_rows(const uint32_t *w, int64_t count, const int64_t *at, int64_t *rows, int64_t *entry) {
    for (int64_t k = 0; k < count; k++) {
        const uint32_t *e = w + at[k];
        for (uint32_t d = 0; d < e[6]; d++, rows += 8) {
            rows[0] = e[1]; rows[1] = e[2]; rows[2] = e[3];
            rows[3] = e[7 + 3 * d]; rows[4] = e[8 + 3 * d]; rows[5] = e[9 + 3 * d];
            rows[6] = e[4]; rows[7] = e[5];
            *entry++ = k;
        }
    }
}
"""
