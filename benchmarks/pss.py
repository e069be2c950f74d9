"""Peak memory of a process tree: the sum of the proportional set size (PSS) of a process and
all its descendants, sampled while it runs.

``ru_maxrss`` is the peak resident set of *one* process (the largest the parent reaped), and RSS
counts shared pages once per process: neither is what a build with worker processes takes. PSS
shares each shared page among the processes mapping it, so the sum over the tree is the memory
the tree holds. Each sample reads ``/proc/<pid>/smaps_rollup`` of the process and of every
descendant, found through ``/proc/<pid>/task/*/children``; the peak is the largest sum seen.
A process that starts and ends between two samples is missed: the default interval (0.1 s,
longer for a large tree, see ``TreeSampler``) is short beside a build's phases.

    with TreeSampler(pid) as s:
        ...                      # wait for the process
    s.peak_kib, s.samples
"""
from __future__ import annotations

import threading
import time
from pathlib import Path

PROC = Path("/proc")


def descendants(pid: int) -> list[int]:
    """``pid`` and every process below it (children of each of its threads), breadth first."""
    out, todo, seen = [], [pid], set()
    while todo:
        p = todo.pop(0)
        if p in seen:
            continue
        seen.add(p)
        out.append(p)
        try:
            tasks = list((PROC / str(p) / "task").iterdir())
        except OSError:
            continue           # ended meanwhile
        for t in tasks:
            try:
                todo.extend(int(c) for c in (t / "children").read_text().split())
            except (OSError, ValueError):
                pass
    return out


def pss_kib(pid: int) -> int:
    """The PSS of one process in KiB (0 if it has ended or cannot be read)."""
    try:
        for line in (PROC / str(pid) / "smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return 0


def tree_pss_kib(pid: int) -> int:
    """The sum of the PSS of ``pid`` and its descendants, in KiB."""
    return sum(pss_kib(p) for p in descendants(pid))


def available() -> bool:
    """Whether this system has what the sampler reads (Linux ≥ 4.14 with task children)."""
    import os
    me = PROC / str(os.getpid())
    return (me / "smaps_rollup").exists() and any((t / "children").exists() for t in (me / "task").iterdir())


class TreeSampler:
    """Samples ``tree_pss_kib(pid)`` every ``interval`` seconds in a thread until stopped;
    ``peak_kib`` is the largest sample (None where /proc lacks what it needs).

    A sample is the kernel walking every page of every process, which is not free at scale: on
    ViT-B/16's build (four processes, 10 GB) one took 176 ms, so sampling every 0.1 s kept two
    thirds of a core busy beside the very build it measured (one benchmark run's candidates'
    median was 8.4 s where a plain build of the same code had 6.8 s). The wait after a sample
    is therefore at least ``(1 - budget) / budget`` times the sample's own duration: the
    sampler takes at most ``budget`` of one core (about 1.6 s between samples of that tree); a
    small build is still sampled every ``interval``."""

    def __init__(self, pid: int, interval: float = 0.1, budget: float = 0.1):
        self.pid, self.interval, self.budget = pid, interval, budget
        self.peak_kib: int | None = 0 if available() else None
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while True:
            t0 = time.perf_counter()
            self._sample()
            took = time.perf_counter() - t0
            if self._stop.wait(max(self.interval, took * (1 - self.budget) / self.budget)):
                return

    def _sample(self) -> None:
        kib = tree_pss_kib(self.pid)
        if kib:
            self.samples += 1
            self.peak_kib = max(self.peak_kib or 0, kib)

    def __enter__(self) -> "TreeSampler":
        if self.peak_kib is not None:
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> None:
        if self._thread.is_alive():
            self._stop.set()
            self._thread.join()
