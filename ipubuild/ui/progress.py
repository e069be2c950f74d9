"""What the quiet console shows while tasks run (``ipubuild.console`` creates it when the first
phase task executes).

``Activity`` turns the structured log's events of the running task — kernel variants compiled,
search rounds, the incumbent's cycles, candidates measured per second — into a few words.
``PipeView`` prints one line per phase kind (a phase and the planning phases it spans, as the
seed's log nests them) when its first task finishes. ``LiveView`` keeps one line at the bottom of a
terminal, drawn by rich (``[12/24] plan_package:vit_fp8 · round 2/3 · best 110,201 cycles
(−6.8 %) · 1.2 candidates/s``), and prints warnings, errors and closing lines above it.
"""
from __future__ import annotations

import os
import sys
import time

from ..engine.log import log


def view(console, live: bool):
    """The view for a quiet console: live at a terminal, else one line per phase kind."""
    return LiveView(console) if live else PipeView(console)


def _unicode(stream) -> bool:
    return "utf" in (getattr(stream, "encoding", "") or "").lower()


class Activity:
    """What one running task is doing, read from its log events."""

    def __init__(self, meta: dict, fancy: bool = True):
        self.rounds = meta.get("rounds")
        self.arrow, self.minus = ("→", "−") if fancy else ("->", "-")
        self.compiled = self.round = 0
        self.initial = self.best = self.rate = self.evaluating = self.work = None
        self.resumed = False

    def event(self, level: str, message: str, kv: dict) -> None:
        if message == "progress":
            what, done, total = str(kv["what"]).strip('"'), int(kv["done"]), int(kv["total"])
            self.work = None if done >= total else f"{what} {done:,}/{total:,}"
        elif message == "compiled kernel variant":
            self.compiled += 1
        elif message == "validated search incumbent":
            self.initial = self.best = int(kv["cycles"])
            self.resumed = kv.get("resuming") is True
        elif message in ("accepted local layout improvement", "accepted tile mapping"):
            self.best = int(kv["after"])
        elif message == "screened local search round":
            self.round, self.evaluating = int(kv["round"]), None
        elif message == "evaluating ordered local candidates concurrently":
            self.evaluating = kv["candidates"]
        elif message == "measured local search round":
            self.rate, self.evaluating = kv["evaluations_per_s"], None

    def _gain(self) -> str:
        pct = 100.0 * (self.best - self.initial) / self.initial if self.initial else 0.0
        return f"{self.minus if pct < 0 else '+'}{abs(pct):.1f} %"

    def now(self) -> str:
        parts = []
        if self.round:
            parts.append(f"round {self.round}/{self.rounds}" if self.rounds else f"round {self.round}")
        elif self.initial is not None:
            parts.append("tile mapping")
        if self.best is not None:
            parts.append(f"best {self.best:,} cycles" + (f" ({self._gain()})" if self.best != self.initial else ""))
        if self.evaluating is not None:
            parts.append(f"measuring {self.evaluating} candidates")
        elif self.rate is not None:
            parts.append(f"{self.rate} candidates/s")
        if self.compiled:
            parts.append(f"{self.compiled} kernel variants compiled")
        if self.work:
            parts.append(self.work)
        return " · ".join(parts)

    def summary(self) -> str:
        parts = []
        if self.initial is not None:
            resumed = "resumed " if self.resumed else ""
            parts.append(f"{resumed}search {self.initial:,} {self.arrow} {self.best:,} cycles ({self._gain()}) "
                         f"in {self.round} round{'s' if self.round != 1 else ''}")
        if self.compiled:
            parts.append(f"{self.compiled} kernel variant{'s' if self.compiled != 1 else ''} compiled")
        return ", ".join(parts)


SAYS_WHERE = ("progress", "validated search incumbent", "screened local search round",
              "evaluating ordered local candidates concurrently", "measured local search round",
              "accepted local layout improvement", "accepted tile mapping")
"""The log events after which a task at a pipe may say where it is (``PipeView``)."""


class PipeView:
    """One line per phase kind, when its first task finishes; and, while a task runs longer than
    ``PROGRESS_EVERY`` seconds, a line of how far it is every ``PROGRESS_EVERY`` seconds."""

    PROGRESS_EVERY = 10.0

    def __init__(self, console):
        self.console = console
        self.out = console.real_stdout
        self.fancy = _unicode(self.out)
        self.kinds: set[str] = set()
        self.activity = Activity({})
        self.started, self.said, self.name = time.perf_counter(), 0.0, ""
        log.listeners.append(self.event)

    def start(self, name: str, meta: dict) -> None:
        self.activity = Activity(meta, self.fancy)
        self.started, self.said, self.name = time.perf_counter(), 0.0, name

    def event(self, level: str, message: str, kv: dict) -> None:
        self.activity.event(level, message, kv)
        # a long task says where it is, every PROGRESS_EVERY seconds at most: its work, and a
        # search its round and best cycles (its candidates run in workers, whose work it
        # does not see: minutes at scale between a round's lines)
        if message not in SAYS_WHERE or (message == "progress" and not self.activity.work):
            return
        now = time.perf_counter()
        if now - max(self.started, self.said) >= self.PROGRESS_EVERY and (text := self.activity.now()):
            self.said = now
            self.print(f"  {self.name} · {text} · {now - self.started:.0f} s\n")

    def finish(self, name: str, meta: dict) -> None:
        if meta.get("kind") in self.kinds:
            return
        self.kinds.add(meta.get("kind"))
        c = self.console
        width = len(str(c.total))
        summary = self.activity.summary()
        self.print(f"[{c.done:>{width}}/{c.total}] {name}  {time.perf_counter() - self.started:.1f} s"
                   + (f"  {summary}" if summary else "") + "\n")

    def print(self, text: str) -> None:
        self.console.write_to(self.out, text)

    def stop(self) -> None:
        if self.event in log.listeners:
            log.listeners.remove(self.event)


class LiveView(PipeView):
    """One live line at the bottom of the terminal (rich's progress display)."""

    def __init__(self, console):
        from rich.console import Console as RichConsole
        from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
        from rich.table import Column
        super().__init__(console)
        self.name = self.text = ""
        # the description takes what the counts and the clock leave, cut with an ellipsis
        rest = Column(ratio=1, no_wrap=True, overflow="ellipsis")
        self.progress = Progress(
            SpinnerColumn(), TextColumn("[{task.completed}/{task.total}]", markup=False),
            TextColumn("{task.description}", markup=False, table_column=rest), TimeElapsedColumn(),
            console=RichConsole(file=self.out, force_terminal=True), expand=True, transient=True,
            redirect_stdout=False, redirect_stderr=True)
        self.task = self.progress.add_task("", total=max(1, console.total), completed=console.done)
        self.stderr = sys.stderr
        self.live = True
        _forks.append(self)
        self.progress.start()

    def _update(self) -> None:
        if self.live:
            now = self.activity.now()
            text = self.name + (f" · {now}" if now else "")
            # a new text is drawn at once: a search round shorter than the refresh period would
            # otherwise never reach the screen (or a terminal recording)
            changed, self.text = text != self.text, text
            self.progress.update(self.task, completed=self.console.done, total=max(1, self.console.total),
                                 description=text, refresh=changed)

    def start(self, name: str, meta: dict) -> None:
        super().start(name, meta)
        self.name = name
        self._update()

    def event(self, level: str, message: str, kv: dict) -> None:
        self.activity.event(level, message, kv)     # the live line shows the progress itself
        self._update()

    def finish(self, name: str, meta: dict) -> None:
        self._update()

    def print(self, text: str) -> None:
        if self.live:
            self.progress.console.print(text.rstrip("\n"), markup=False, highlight=False, soft_wrap=True)
        else:
            super().print(text)

    def stop(self) -> None:
        super().stop()
        if self.live:
            self.live = False
            self.progress.stop()

    # the search forks workers while the display's refresh thread runs: hold its lock across the
    # fork so that no child inherits it taken, and let children write to the plain stderr
    def before_fork(self) -> None:
        if self.live:
            self.progress.live._lock.acquire()

    def after_fork(self, child: bool) -> None:
        if self.live:
            self.progress.live._lock.release()
            if child:
                self.live = False
                sys.stderr = self.stderr


_forks: list[LiveView] = []


def _before_fork():
    for v in _forks:
        v.before_fork()


os.register_at_fork(before=_before_fork, after_in_parent=lambda: [v.after_fork(False) for v in _forks],
                    after_in_child=lambda: [v.after_fork(True) for v in _forks])
