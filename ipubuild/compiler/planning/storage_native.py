"""Storage placement's first-fit loop in C (``storage._place``'s, over arrays), compiled and
loaded by ``native``. ``tests/test_storage_native.py`` checks it places every buffer where the
Python loop does, on random tiles and on a real program's."""
from __future__ import annotations

import ctypes

import numpy as np

from . import native

P = ctypes.c_void_p


def library():
    return native.library("storage_alloc", SOURCE, {
        "sa_first_fit": (ctypes.c_int64, [ctypes.c_int64, P, P, P, ctypes.c_int64, P, ctypes.c_int64, P, P])})


def first_fit(size: np.ndarray, start: np.ndarray, end: np.ndarray, ranges, alignment: int) -> np.ndarray | None:
    """Addresses of buffers given in placement order (aligned sizes, first and last live steps):
    each at the lowest aligned address of the first range where it overlaps no buffer live at
    the same time. None if the C loop is not available; ValueError naming the index of the first
    buffer that does not fit."""
    lib = library()
    if lib is None:
        return None
    n = len(size)
    arrays = [np.ascontiguousarray(a, dtype=np.int64) for a in (size, start, end)]
    rng = np.ascontiguousarray(np.asarray(ranges, dtype=np.int64).reshape(-1, 2))
    addr = np.empty(n, np.int64)
    work = np.empty((max(n, 1), 4), np.int64)
    c = lambda a: a.ctypes.data  # noqa: E731
    failed = lib.sa_first_fit(n, c(arrays[0]), c(arrays[1]), c(arrays[2]), len(rng), c(rng), alignment, c(addr), c(work))
    if failed >= 0:
        raise ValueError(int(failed))
    return addr


SOURCE = r"""/* First fit over live ranges (planning/storage.py: _place). Buffer i (in placement order)
 * takes size[i] bytes (aligned) from step start[i] to step end[i]; placed buffers are kept
 * sorted as tuples (address, end address, start, end) in work[]; when the buffers come in order
 * of their first steps (placement order), those that ended before a buffer's first step are
 * dropped from work[], as they overlap no buffer after it. Returns -1, or the index of the first
 * buffer that fits nowhere. Integer arithmetic only. */
#include <stdint.h>
#include <string.h>

static int64_t align_up(int64_t x, int64_t a) { return (x + a - 1) / a * a; }

static int tuple_less(const int64_t *x, const int64_t *y) {
    for (int k = 0; k < 4; k++)
        if (x[k] != y[k]) return x[k] < y[k];
    return 0;
}

int64_t sa_first_fit(int64_t n, const int64_t *size, const int64_t *start, const int64_t *end,
                     int64_t nranges, const int64_t *ranges, int64_t alignment, int64_t *addr, int64_t *work) {
    int64_t placed = 0, ordered = 1;
    for (int64_t i = 1; i < n && ordered; i++)
        ordered = start[i] >= start[i - 1];
    for (int64_t i = 0; i < n; i++) {
        int64_t s = size[i], st = start[i], en = end[i], found = -1;
        if (ordered && i > 0 && st > start[i - 1]) {
            /* buffers come by first step: one that ended before this step overlaps no later one */
            int64_t kept = 0;
            for (int64_t j = 0; j < placed; j++)
                if (work[4 * j + 3] >= st) {
                    if (kept != j) memcpy(work + 4 * kept, work + 4 * j, sizeof(int64_t) * 4);
                    kept++;
                }
            placed = kept;
        }
        for (int64_t r = 0; r < nranges && found < 0; r++) {
            int64_t lo = ranges[2 * r], hi = ranges[2 * r + 1];
            int64_t cursor = align_up(lo, alignment);
            for (int64_t j = 0; j < placed; j++) {
                const int64_t *p = work + 4 * j;
                if (p[1] <= cursor || p[2] > en || st > p[3]) continue;
                if (p[0] >= hi || p[0] - cursor >= s) break;
                int64_t e = align_up(p[1], alignment);
                if (e > cursor) cursor = e;
            }
            if (cursor + s <= hi) found = cursor;
        }
        if (found < 0) return i;
        addr[i] = found;
        int64_t t[4] = {found, found + s, st, en};
        int64_t lo = 0, hi = placed;                  /* bisect right */
        while (lo < hi) {
            int64_t mid = (lo + hi) / 2;
            if (tuple_less(t, work + 4 * mid)) hi = mid; else lo = mid + 1;
        }
        memmove(work + 4 * (lo + 1), work + 4 * lo, sizeof(int64_t) * 4 * (size_t)(placed - lo));
        memcpy(work + 4 * lo, t, sizeof t);
        placed++;
    }
    return -1;
}
"""
