"""Structured logs in the reference's style, and a Chrome trace of the build.

A line reads ``<UTC time>  INFO <span>:<span>: message key=value ...`` where spans nest like
``ipubuild.build{tile_count=64 operations=25}:ipubuild.phase{phase="plan_package"}``. Every span
also becomes a complete event in the trace that ``write_trace`` saves (Perfetto opens it).
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

_spans: contextvars.ContextVar[tuple[str, ...]] = contextvars.ContextVar("spans", default=())
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
    """Writes one line per message to stderr (the stream doit shows for tasks)."""

    stream = None

    def _emit(self, level: str, message: str, kv: dict) -> None:
        now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
        context = ":".join(_spans.get())
        text = f"{message} {fields(**kv)}" if kv else message
        line = f"{now} {level:>5} {context + ': ' if context else ''}{text}\n"
        stream = self.stream or sys.stderr
        stream.write(line)
        stream.flush()

    def info(self, message: str, **kv) -> None:
        self._emit("INFO", message, kv)

    def warning(self, message: str, **kv) -> None:
        self._emit("WARN", message, kv)

    def plain(self, line: str) -> None:
        """A bare result line (the reference prints its verdicts this way), on stdout."""
        print(line, flush=True)


log = Logger()


def phase_finished(phase: str, elapsed_ms: int, hit: bool) -> None:
    """The reference's per-phase line, marked ``cached=true`` when the action cache served it."""
    log.info("package build phase finished", phase=f'"{phase}"', elapsed_ms=elapsed_ms, success=True,
             **({"cached": True} if hit else {}))


@contextlib.contextmanager
def span(name: str, **kv):
    """Nest a span for the logs and record it as a trace event."""
    label = f"ipubuild.{name}{{{' '.join(f'{k}={_quote(v)}' for k, v in kv.items())}}}"
    token = _spans.set(_spans.get() + (label,))
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
