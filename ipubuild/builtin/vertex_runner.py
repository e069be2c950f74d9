"""The simulator's vertex calls in C: a lane of a step's vertices (kernel entry points, tile
memories and argument arrays, as addresses) called one after another until one returns non-zero.
Called through ctypes one by one, a vertex cost a microsecond or two of Python around the
kernel's own work (234 K calls on ViT-B/16). Compiled by the system C compiler as the planner's
loops are (``compiler.planning.native``); without one, or where
``$IPUBUILD_NATIVE_SIM_VERTICES=0``, the calls are made through ctypes (the tests run both).
ctypes releases the GIL while the loop runs, so lanes on threads run at the same time; a failing
vertex stops the loop on its own thread, where the caller then asks why (a checked kernel keeps
its reason per thread)."""
from __future__ import annotations

import ctypes

import numpy as np

from ..compiler.planning import native

P = ctypes.c_void_p
I64 = ctypes.c_int64


def library(nice: int = 0):
    """The compiled loop (a ctypes library), or None (no compiler, or switched off)."""
    return native.library("sim_vertices", SOURCE, {"vr_run": (I64, [I64, I64, P, P, P, P]),
                                                    "vr_count": (None, [I64, P, P, P, P, P])},
                          switch="IPUBUILD_NATIVE_SIM_VERTICES", nice=nice)


def run(fns: np.ndarray, mems: np.ndarray, args: np.ndarray, start: int) -> tuple[int, int] | None:
    """Call vertices ``start, start + 1, ...`` (``fns[i](mems[i], args[i])``, all uint64 addresses)
    until one returns non-zero: ``(its index, its return code)``, or ``(len(fns), 0)`` when none
    did; None when the C loop is not available."""
    lib = library()
    if lib is None:
        return None
    rc = ctypes.c_int32(0)
    at = lib.vr_run(start, len(fns), fns.ctypes.data, mems.ctypes.data, args.ctypes.data, ctypes.addressof(rc))
    return int(at), rc.value


def count(fns: np.ndarray, counted: np.ndarray, mems: np.ndarray, args: np.ndarray) -> np.ndarray | None:
    """Call every vertex once, in order, whatever it returns: ``fns[i]`` is a counted build's
    ``ipu_counted_vertex(mem, args, &blocks)`` where ``counted[i]``, else a plain entry point;
    the blocks each counted call executed (``2**64 - 1`` for the others), or None when the C loop
    is not available."""
    lib = library()
    if lib is None:
        return None
    flags = np.ascontiguousarray(counted, dtype=np.uint8)
    blocks = np.empty(len(fns), np.uint64)
    lib.vr_count(len(fns), fns.ctypes.data, flags.ctypes.data, mems.ctypes.data, args.ctypes.data, blocks.ctypes.data)
    return blocks


SOURCE = r"""/* The simulator's vertex calls (builtin/vertex_runner.py): each vertex is an entry point
 * int ipu_vertex(void *tile_memory, const uint32_t *args), given as addresses. */
#include <stdint.h>

typedef int (*vertex_fn)(void *, const void *);

/* calls i = start, start + 1, ... < n until one returns non-zero: its index (code in *rc), or n */
int64_t vr_run(int64_t start, int64_t n, const uint64_t *fns, const uint64_t *mems, const uint64_t *args,
               int32_t *rc) {
    for (int64_t i = start; i < n; i++) {
        int r = ((vertex_fn)(uintptr_t)fns[i])((void *)(uintptr_t)mems[i], (const void *)(uintptr_t)args[i]);
        if (r != 0) { *rc = r; return i; }
    }
    *rc = 0;
    return n;
}

typedef int (*counted_fn)(void *, const void *, uint64_t *);

/* every call once, in order; blocks[i]: what counted call i executed, UINT64_MAX for the others */
void vr_count(int64_t n, const uint64_t *fns, const uint8_t *counted, const uint64_t *mems, const uint64_t *args,
              uint64_t *blocks) {
    for (int64_t i = 0; i < n; i++) {
        void *mem = (void *)(uintptr_t)mems[i];
        const void *a = (const void *)(uintptr_t)args[i];
        if (counted[i]) {
            blocks[i] = 0;
            ((counted_fn)(uintptr_t)fns[i])(mem, a, &blocks[i]);
        } else {
            ((vertex_fn)(uintptr_t)fns[i])(mem, a);
            blocks[i] = UINT64_MAX;
        }
    }
}
"""
