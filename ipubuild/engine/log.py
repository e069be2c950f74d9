"""Structured logs in the reference's style, and a Chrome trace of the build.

A line reads ``<UTC time>  INFO <span>:<span>: message key=value ...`` where spans nest like
``ipubuild.build{tile_count=64 operations=25}:ipubuild.phase{phase="plan_package"}``. Every span
also becomes a complete event in the trace that ``write_trace`` saves (Perfetto opens it).

Where lines go: by default (library use, tests) every line goes to stderr. A doit run configures
the log (``Logger.configure``, from ``ipubuild.console``): every line then also goes to
``artifacts/<target>/build.log`` — the target named by the line's ``build`` span; lines of no
target go to every target log of the run — and the console shows only what its level asks for:
``0`` every line as above, ``1`` warnings (as ``warning: message key=value``), ``2`` none. A log
file is started afresh by the first line of its target in a run, so a no-op keeps the last one.
"""
from __future__ import annotations

import contextlib
import contextvars
import datetime
import json
import os
import sys
import threading
import time
from pathlib import Path

_spans: contextvars.ContextVar[tuple[tuple[str, str, dict], ...]] = contextvars.ContextVar("spans", default=())
_events: list[dict] = []
_events_lock = threading.Lock()
_T0 = time.perf_counter()


def fmt_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def fields(**kv) -> str:
    return " ".join(f"{k}={fmt_value(v)}" for k, v in kv.items())


class Logger:
    """Writes one line per message to the console and, once configured, to the targets' logs."""

    stream = None           # the console stream (default: sys.stderr at the time of writing)

    def __init__(self):
        self.level = 0
        self.root: Path | None = None
        self.listeners: list = []        # fn(level, message, kv), called in the configuring process
        self._pid = os.getpid()
        self._files: dict[str, int] = {}
        self._preamble: list[bytes] = []
        self._shown: set = set()

    def configure(self, root=None, level: int = 0) -> None:
        """Send lines to ``root``'s ``artifacts/<target>/build.log`` and show the console ``level``."""
        self.root, self.level, self._pid = (Path(root) if root else None), level, os.getpid()

    def _emit(self, level: str, message: str, kv: dict) -> None:
        now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
        spans = _spans.get()
        context = ":".join(s[0] for s in spans)
        text = f"{message} {fields(**kv)}" if kv else message
        line = f"{now} {level:>5} {context + ': ' if context else ''}{text}\n"
        self._file(line, _target(spans))
        if self.level == 0:
            self._console(line)
        elif self.level == 1 and level == "WARN":
            self._console(f"warning: {text}\n")
        if self.listeners and os.getpid() == self._pid:
            for fn in list(self.listeners):
                fn(level, message, kv)

    def info(self, message: str, **kv) -> None:
        self._emit("INFO", message, kv)

    def warning(self, message: str, **kv) -> None:
        self._emit("WARN", message, kv)

    def plain(self, line: str) -> None:
        """A bare line of the reference's log (it prints some facts this way): in the target's
        log, and on stdout when the console shows every line."""
        self._file(line + "\n", _target(_spans.get()))
        if self.level == 0:
            print(line, flush=True)

    def diagnostics(self, text: str, once=None) -> None:
        """A tool's diagnostics (a compiler's warnings), verbatim, in the log, and on the console
        at any level but the quietest — once per ``once`` key in a process."""
        self._file(text, _target(_spans.get()))
        if once is not None:
            if once in self._shown:
                return
            self._shown.add(once)
        if self.level <= 1:
            self._console(text)

    def note(self, text: str, target: str, start: bool = False) -> None:
        """Append ``text`` to a target's log if this run has started one (closing lines), or
        starting it (``start``: an error)."""
        if self.root is not None and (start or target in self._files):
            self._file(text, target)

    def _console(self, text: str) -> None:
        stream = self.stream if os.getpid() == self._pid and self.stream is not None else sys.stderr
        stream.write(text)
        stream.flush()

    def _file(self, line: str, target: str | None) -> None:
        if self.root is None:
            return
        data = line.encode()
        try:
            if target is None:
                if not self._files and len(self._preamble) < 10000:
                    self._preamble.append(data)
                for fd in self._files.values():
                    os.write(fd, data)
                return
            fd = self._files.get(target)
            if fd is None:
                fd = self._open(target)
            os.write(fd, data)
        except OSError:
            pass        # the log is a record, never a reason to fail a build

    def _open(self, target: str) -> int:
        path = self.root / "artifacts" / target / "build.log"
        path.parent.mkdir(parents=True, exist_ok=True)
        # the run's first line starts the file afresh; a forked worker appends to its parent's
        fresh = os.O_TRUNC if os.getpid() == self._pid else 0
        fd = self._files[target] = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | fresh, 0o666)
        for data in self._preamble:
            os.write(fd, data)
        return fd

    def log_file(self, target: str) -> Path | None:
        """The log this run writes for ``target`` (None if it has written none)."""
        return self.root / "artifacts" / target / "build.log" if target in self._files else None


log = Logger()


class PluginLogger:
    """A plugin's logger (``get_logger(name)``): its lines go into the same structured log as
    ipubuild's — the target's ``build.log``, inside the spans of the phase that called the
    plugin, and on the console as ``IPUBUILD_LOG`` asks — as ``<name>: <message> key=value …``."""

    def __init__(self, name: str):
        self.name = name

    def info(self, message: str, **kv) -> None:
        """A line at level INFO (in ``build.log``; on the console with ``IPUBUILD_LOG=info``)."""
        log.info(f"{self.name}: {message}", **kv)

    debug = info        # the log has two levels: debug lines are info lines

    def warning(self, message: str, **kv) -> None:
        """A line at level WARN (on the console too, as ``warning: <name>: <message> …``)."""
        log.warning(f"{self.name}: {message}", **kv)


def get_logger(name: str) -> PluginLogger:
    """The logger a plugin writes with: ``get_logger(__name__).info("proposed", count=3)``."""
    return PluginLogger(str(name))


def _target(spans) -> str | None:
    return next((kv.get("target") for _, name, kv in spans if name == "build"), None)


def phase_finished(phase: str, elapsed_ms: int, hit: bool) -> None:
    """The reference's per-phase line, marked ``cached=true`` when the action cache served it."""
    log.info("package build phase finished", phase=f'"{phase}"', elapsed_ms=elapsed_ms, success=True,
             **({"cached": True} if hit else {}))


_PROGRESS_EVERY = 2.0              # seconds between two progress lines of one kind of work
_progress_said: dict[str, float] = {}


def progress(what: str, done: int, total: int) -> None:
    """How far a long phase is (``done`` of ``total`` ``what``): an info line at most every few
    seconds per kind of work, and at its end; the console shows the latest beside the task."""
    now = time.monotonic()
    if done < total and now - _progress_said.get(what, -_PROGRESS_EVERY) < _PROGRESS_EVERY:
        return
    _progress_said[what] = now
    if done >= total:
        _progress_said.pop(what, None)
    log.info("progress", what=f'"{what}"', done=done, total=total)


@contextlib.contextmanager
def span(name: str, **kv):
    """Nest a span for the logs and record it as a trace event."""
    label = f"ipubuild.{name}{{{' '.join(f'{k}={_quote(v)}' for k, v in kv.items())}}}"
    token = _spans.set(_spans.get() + ((label, name, kv),))
    start = time.perf_counter()
    try:
        yield
    finally:
        _spans.reset(token)
        record(name if "phase" not in kv else str(kv["phase"]), start, time.perf_counter(),
               {k: fmt_value(v) for k, v in kv.items()})


def _quote(v) -> str:
    return f'"{v}"' if isinstance(v, str) else fmt_value(v)


def record(name: str, start: float, end: float, args: dict | None = None) -> None:
    """Add a complete ("X") trace event measured with time.perf_counter()."""
    with _events_lock:
        _events.append({"name": name, "ph": "X", "ts": round((start - _T0) * 1e6, 1),
                        "dur": round((end - start) * 1e6, 1), "pid": os.getpid(),
                        "tid": threading.get_ident() % 100000, "args": args or {}})


def write_trace(path, name: str = "build") -> None:
    """Write the trace events of this process as Chrome trace-event JSON (atomically), under
    one event ``name`` spanning the whole run."""
    from .files import write_atomic
    with _events_lock:
        events = [{"name": name, "ph": "X", "ts": 0, "dur": round((time.perf_counter() - _T0) * 1e6, 1),
                   "pid": os.getpid(), "tid": threading.get_ident() % 100000, "args": {}}] + list(_events)
    write_atomic(path, json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}).encode())


_console = sys.modules.get("ipubuild.ui.console")
if _console is not None and _console.settings.get("root"):
    log.configure(_console.settings["root"], _console.settings["log_level"])
