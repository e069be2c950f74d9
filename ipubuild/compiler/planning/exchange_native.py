"""The exchange scheduler over arrays: ``exchange.schedule``'s model (ports, durations, the two
orders and their horizons) worked out with numpy, its two sequential loops (replaying an order,
earliest start first) in C (``SOURCE`` below: in this module, so that the code fingerprint of the
phases that schedule covers it), compiled and loaded by ``native``.

The C loops are integer-only, so the schedules are the compiler's and machine's no more than the
Python loops' are: ``tests/test_exchange_native.py`` checks that they equal
``exchange.schedule``'s Python loops (``IPUBUILD_NATIVE_EXCHANGE=0`` selects those) on random and
real phases. Without a working compiler the Python loops run.
"""
from __future__ import annotations

import ctypes

import numpy as np

from . import native

LOCAL, RECV, SEND = 0, 1, 2     # port kinds, in the order of the Python tuples' names
P = ctypes.c_void_p


def library():
    """The compiled scheduler (a ctypes library), or None (no compiler, or disabled)."""
    return native.library("exchange_sched", SOURCE, {
        "xs_replay": (ctypes.c_int64, [ctypes.c_int32, P, P, P, P, ctypes.c_int32, P]),
        "xs_earliest_first": (ctypes.c_int32, [ctypes.c_int32, P, P, P, P, P, ctypes.c_int32, P])},
        switch="IPUBUILD_NATIVE_EXCHANGE")


def model(transfers: list[list], machine: dict, paired: bool):
    """``(nbytes, ptr, ports, dur, nports)``: each transfer's bytes, its ports (CSR: ``ports[ptr[i]:
    ptr[i + 1]]``, ids ordered as ``exchange._ports_and_duration``'s tuples) and its duration."""
    width = max(map(len, transfers))
    pad = [-1] * ((width - 10) // 4)
    # [src_tile, rows, row_bytes, dst_tile, further dst_tiles..., -1 padding] (tiles are >= 0)
    a = np.array([[t[0], t[8], t[9], t[4], *t[10::4], *pad[:(width - len(t)) // 4]] for t in transfers],
                 dtype=np.int64)
    return _model(a, machine, paired)


def _destinations(groups) -> np.ndarray:
    """Each group's destination tiles, padded with -1: ``[groups, most destinations]``."""
    counts = np.diff(groups.starts)
    out = np.full((len(groups), 1 + int(counts.max(initial=0))), -1, np.int64)
    out[:, 0] = groups.heads[:, 4]
    owner = np.repeat(np.arange(len(groups)), counts)
    out[owner, 1 + np.arange(len(owner)) - groups.starts[owner]] = groups.extra[:, 0]
    return out


def _model(a: np.ndarray, machine: dict, paired: bool):
    """``model`` of rows ``[src_tile, rows, row_bytes, dst_tiles (padded with -1)...]``."""
    x = machine["exchange"]
    n = len(a)
    st, rows = a[:, 0], a[:, 1]
    nbytes = rows * a[:, 2]
    dests = a[:, 3:]
    valid = dests >= 0
    local = (st == dests[:, 0]) & ~valid[:, 1:].any(axis=1)
    span = int(max(st.max(), dests.max())) + 1
    ceil = lambda num, d: -(-num // d)  # noqa: E731
    if paired:
        dur = x["paired_setup_cycles"] + x["transfer_setup_cycles"] * rows + ceil(nbytes, x["paired_bytes_per_cycle"])
        big = np.iinfo(np.int64).max
        d = np.where(valid, dests // 2, big)
        d.sort(axis=1)
        keep = d != big
        keep[:, 1:] &= d[:, 1:] != d[:, :-1]
        recv = RECV * span + np.where(keep, d, 0)
        send = SEND * span + st // 2
    else:
        dur = x["transfer_setup_cycles"] * rows + ceil(nbytes, x["bytes_per_cycle"])
        keep = valid
        recv = RECV * span + dests
        send = SEND * span + st
    dur = np.where(local, x["transfer_setup_cycles"] * rows + ceil(nbytes, x["local_copy_bytes_per_cycle"]), dur)
    keep = keep & ~local[:, None]
    cols = np.concatenate([np.where(local, LOCAL * span + st, send)[:, None], recv], axis=1)
    mask = np.concatenate([np.ones((n, 1), bool), keep], axis=1)
    ports = np.ascontiguousarray(cols[mask], dtype=np.int32)
    ptr = np.zeros(n + 1, np.int64)
    np.cumsum(mask.sum(axis=1), out=ptr[1:])
    return nbytes, ptr, ports, np.ascontiguousarray(dur, dtype=np.int64), 3 * span


def schedule(transfers: list[list], machine: dict, paired: bool) -> tuple[int, list[int]] | None:
    """``exchange.schedule``'s result, computed here; None if the C loops are not available."""
    if library() is None or not transfers:
        return None
    n = len(transfers)
    tie = np.empty(n, np.int64)        # rank by content (fields may be buffer names)
    tie[sorted(range(n), key=lambda i: (transfers[i], i))] = np.arange(n)
    return _schedule(model(transfers, machine, paired), tie)


def schedule_groups(groups, machine: dict, paired: bool) -> tuple[int, list[int]] | None:
    """``schedule`` of ``exchange.Groups`` (``groups.lists()``'s schedule, without the lists)."""
    if library() is None or not len(groups):
        return None
    dests = _destinations(groups)
    h = groups.heads
    tie = _content_rank(groups)
    return _schedule(_model(np.concatenate([h[:, [0, 8, 9]], dests], axis=1), machine, paired), tie)


def schedule_shape(groups) -> np.ndarray:
    """All that ``schedule_groups``'s horizon depends on: each group's source tile, rows, row
    bytes and destination tiles (padded with -1), in the order of the groups' content rank.
    Groups whose shapes are equal have equal horizons, whatever their addresses: a search
    candidate that moves buffers keeps most phases' shapes."""
    rows = np.concatenate([groups.heads[:, [0, 8, 9]], _destinations(groups)], axis=1)
    out = np.empty_like(rows)
    out[_content_rank(groups)] = rows
    return out


def _content_rank(groups) -> np.ndarray:
    """Each group's rank when the groups' lists are sorted (ties: their index), from the arrays:
    by their heads, and where heads are equal by their further destinations."""
    h = groups.heads
    n = len(h)
    by_head = np.lexsort(h.T[::-1])
    same = (h[by_head][1:] == h[by_head][:-1]).all(axis=1)
    if same.any():                      # equal heads: compare the whole lists
        lists = groups.lists()
        by_head = np.array(sorted(range(n), key=lambda i: (lists[i], i)), dtype=np.int64)
    tie = np.empty(n, np.int64)
    tie[by_head] = np.arange(n)
    return tie


def _schedule(modelled, tie: np.ndarray) -> tuple[int, list[int]]:
    lib = library()
    nbytes, ptr, ports, dur, nports = modelled
    n = len(tie)
    largest = np.lexsort((tie, -nbytes)).astype(np.int32)
    free = np.zeros(nports, np.int64)
    c = lambda arr: arr.ctypes.data  # noqa: E731
    h1 = lib.xs_replay(n, c(ptr), c(ports), c(dur), c(largest), nports, c(free))
    per_port = np.repeat(dur, np.diff(ptr))
    load = np.zeros(nports, np.int64)
    np.add.at(load, ports, per_port)
    if h1 == int(load.max()):
        return h1, largest.tolist()
    busiest = np.maximum.reduceat(load[ports], ptr[:-1])
    by_rank = np.lexsort((tie, -dur, -busiest)).astype(np.int32)
    rank = np.empty(n, np.int32)
    rank[by_rank] = np.arange(n, dtype=np.int32)
    earliest = np.empty(n, np.int32)
    if lib.xs_earliest_first(n, c(ptr), c(ports), c(dur), c(rank), c(by_rank), nports, c(earliest)) != 0:
        raise MemoryError("the exchange scheduler ran out of memory")
    h2 = lib.xs_replay(n, c(ptr), c(ports), c(dur), c(earliest), nports, c(free))
    first, second = (h1, largest.tolist()), (h2, earliest.tolist())
    return min(first, second)


SOURCE = r"""/* The exchange scheduler's two inner loops (planning/exchange.py: _replay and _earliest_first),
 * over flat arrays: transfer i occupies ports[ptr[i] .. ptr[i+1]) for dur[i] cycles. Port ids
 * are small non-negative integers ordered as the Python tuples they stand for; rank[i] is the
 * transfer's place in the priority order (unique, smaller first). Integer arithmetic only: the
 * results do not depend on the compiler (tests/test_exchange_native.py compares them with the
 * Python loops on random and real phases). */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

int64_t xs_replay(int32_t n, const int64_t *ptr, const int32_t *ports, const int64_t *dur,
                  const int32_t *order, int32_t nports, int64_t *free_at) {
    int64_t horizon = 0;
    memset(free_at, 0, sizeof(int64_t) * (size_t)nports);
    for (int32_t k = 0; k < n; k++) {
        int32_t i = order[k];
        int64_t start = 0;
        for (int64_t j = ptr[i]; j < ptr[i + 1]; j++)
            if (free_at[ports[j]] > start) start = free_at[ports[j]];
        int64_t end = start + dur[i];
        for (int64_t j = ptr[i]; j < ptr[i + 1]; j++) free_at[ports[j]] = end;
        if (end > horizon) horizon = end;
    }
    return horizon;
}

/* a min-heap of int32 ranks */
typedef struct { int32_t *a; int32_t n, cap; } iheap;

static int ipush(iheap *h, int32_t v) {
    if (h->n == h->cap) {
        int32_t cap = h->cap ? 2 * h->cap : 4;
        int32_t *a = realloc(h->a, sizeof(int32_t) * (size_t)cap);
        if (!a) return -1;
        h->a = a; h->cap = cap;
    }
    int32_t k = h->n++;
    while (k > 0) {
        int32_t p = (k - 1) / 2;
        if (h->a[p] <= v) break;
        h->a[k] = h->a[p]; k = p;
    }
    h->a[k] = v;
    return 0;
}

static int32_t ipop(iheap *h) {
    int32_t top = h->a[0], v = h->a[--h->n], k = 0;
    for (;;) {
        int32_t c = 2 * k + 1;
        if (c >= h->n) break;
        if (c + 1 < h->n && h->a[c + 1] < h->a[c]) c++;
        if (v <= h->a[c]) break;
        h->a[k] = h->a[c]; k = c;
    }
    if (h->n) h->a[k] = v;
    return top;
}

/* the ready heap: (port free at, top rank, port), lexicographic */
typedef struct { int64_t at; int32_t top, port; } entry;
typedef struct { entry *a; int64_t n, cap; } eheap;

static int less(const entry *x, const entry *y) {
    if (x->at != y->at) return x->at < y->at;
    if (x->top != y->top) return x->top < y->top;
    return x->port < y->port;
}

static int epush(eheap *h, int64_t at, int32_t top, int32_t port) {
    if (h->n == h->cap) {
        int64_t cap = h->cap ? 2 * h->cap : 64;
        entry *a = realloc(h->a, sizeof(entry) * (size_t)cap);
        if (!a) return -1;
        h->a = a; h->cap = cap;
    }
    entry v = {at, top, port};
    int64_t k = h->n++;
    while (k > 0) {
        int64_t p = (k - 1) / 2;
        if (!less(&v, &h->a[p])) break;
        h->a[k] = h->a[p]; k = p;
    }
    h->a[k] = v;
    return 0;
}

static entry epop(eheap *h) {
    entry top = h->a[0], v = h->a[--h->n];
    int64_t k = 0;
    for (;;) {
        int64_t c = 2 * k + 1;
        if (c >= h->n) break;
        if (c + 1 < h->n && less(&h->a[c + 1], &h->a[c])) c++;
        if (!less(&h->a[c], &v)) break;
        h->a[k] = h->a[c]; k = c;
    }
    if (h->n) h->a[k] = v;
    return top;
}

/* _earliest_first: the order of transfers (written to order[0..n)); by_rank[r] is the transfer
 * of rank r. Returns 0, or -1 when out of memory. */
int32_t xs_earliest_first(int32_t n, const int64_t *ptr, const int32_t *ports, const int64_t *dur,
                          const int32_t *rank, const int32_t *by_rank, int32_t nports, int32_t *order) {
    int64_t *free_at = calloc((size_t)nports + 1, sizeof(int64_t));
    iheap *waiting = calloc((size_t)nports + 1, sizeof(iheap));
    eheap ready = {0, 0, 0};
    int32_t done = 0, rc = 0;
    if (!free_at || !waiting) { rc = -1; goto out; }
    for (int32_t i = 0; i < n; i++)
        if (ipush(&waiting[ports[ptr[i]]], rank[i])) { rc = -1; goto out; }
    for (int32_t p = 0; p < nports; p++)
        if (waiting[p].n && epush(&ready, 0, waiting[p].a[0], p)) { rc = -1; goto out; }
    while (ready.n) {
        entry e = epop(&ready);
        iheap *queue = &waiting[e.port];
        if (!queue->n || e.at != free_at[e.port] || e.top != queue->a[0]) continue;   /* superseded */
        int32_t i = by_rank[ipop(queue)];
        int64_t start = e.at;
        int32_t block = e.port;
        for (int64_t j = ptr[i]; j < ptr[i + 1]; j++)
            if (free_at[ports[j]] > start) { start = free_at[ports[j]]; block = ports[j]; }
        if (block != e.port) {                           /* wait on the port that keeps it */
            if (ipush(&waiting[block], rank[i])) { rc = -1; goto out; }
            if (epush(&ready, free_at[block], waiting[block].a[0], block)) { rc = -1; goto out; }
        } else {
            order[done++] = i;
            for (int64_t j = ptr[i]; j < ptr[i + 1]; j++) {
                int32_t q = ports[j];
                free_at[q] = start + dur[i];
                if (waiting[q].n && q != e.port && epush(&ready, free_at[q], waiting[q].a[0], q)) {
                    rc = -1; goto out;
                }
            }
        }
        if (queue->n && epush(&ready, free_at[e.port], queue->a[0], e.port)) { rc = -1; goto out; }
    }
    if (done != n) rc = -1;
out:
    if (waiting)
        for (int32_t p = 0; p <= nports; p++) free(waiting[p].a);
    free(waiting);
    free(free_at);
    free(ready.a);
    return rc;
}
"""
