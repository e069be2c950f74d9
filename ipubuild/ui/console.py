"""What a doit run prints, and what Ctrl-C does.

``IPUBUILD_CONSOLE`` chooses the reporter:

* ``auto`` (default) — quiet: at a terminal one live progress line (``ipubuild.progress``), at a
  pipe one line per phase kind; warnings, errors, and each target's closing lines.
* ``live`` or ``plain`` — the terminal's or the pipe's form wherever the output goes.
* ``tasks`` — doit's classic lines, ``.  <task>`` executed and ``-- <task>`` up to date.

``IPUBUILD_LOG`` chooses how much of the structured log reaches the console: ``debug`` or
``info`` every line, ``warning`` (default) warnings only, ``error`` none; doit's ``-v 2`` shows
every line too. The whole log always goes to ``artifacts/<target>/build.log``.

Ctrl-C prints one line and exits with 130; doit has saved the tasks that finished (and the search
its state), so the next build resumes. This module is imported by every run, so it stays small.
"""
from __future__ import annotations

import os
import signal
import sys
import time

from doit.exceptions import TaskFailed
from doit.reporter import ConsoleReporter

MODES = ("auto", "live", "plain", "tasks")
LOG_LEVELS = {"debug": 0, "info": 0, "warning": 1, "warn": 1, "error": 2}
settings: dict = {}              # set by setup(): mode, log_level, root, running, chosen, ...
_stdout = sys.stdout             # the real stdout: doit captures sys.stdout while a task runs
_active: list = [None]           # the reporter of this run


def setup(root) -> tuple[type, bool]:
    """Read the environment for a doit run in ``root``; return the reporter class and whether
    tasks should run at doit's verbosity 2 (the ``tasks`` console)."""
    mode = os.environ.get("IPUBUILD_CONSOLE", "auto").strip().lower() or "auto"
    level = os.environ.get("IPUBUILD_LOG", "warning").strip().lower() or "warning"
    problems = []
    if mode not in MODES:
        problems.append(f"IPUBUILD_CONSOLE={mode}: expected one of {', '.join(MODES)}; using auto")
        mode = "auto"
    if level not in LOG_LEVELS:
        problems.append(f"IPUBUILD_LOG={level}: expected debug, info, warning or error; using warning")
        level = "warning"
    if mode == "auto":
        mode = "live" if _stdout.isatty() and sys.stderr.isatty() and os.environ.get("TERM") != "dumb" else "plain"
    settings.update(mode=mode, log_level=LOG_LEVELS[level], root=root, running=False, chosen=set(),
                    interrupted=False, current=None)
    for p in problems:
        sys.stderr.write(f"warning: {p}\n")
    configure_log()
    _catch_interrupts()
    return (Reporter if mode == "tasks" else Console), mode == "tasks"


def configure_log() -> None:
    logmod = sys.modules.get("ipubuild.engine.log")
    if logmod is not None and settings.get("root"):
        logmod.log.configure(settings["root"], settings["log_level"])


def say(text: str) -> None:
    """Print ``text`` on the console (above a live progress line, if one is shown)."""
    r = _active[0]
    if r is not None:
        r.say(text)
    else:
        write(_stdout, text)


def write(stream, text: str) -> None:
    """Write and flush; if the reader has gone (``| head``), the build goes on without output."""
    try:
        stream.write(text)
        stream.flush()
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), stream.fileno())


def chosen(task: str) -> bool:
    """Whether the user named ``task`` itself on the command line (not a group or the default)."""
    return task in settings.get("chosen", ())


def closing(target: str, text: str) -> None:
    """A target's closing lines (and, on the quiet console, a line saying what was done)."""
    r = _active[0]
    if isinstance(r, Console):
        text = r.summary(target) + text
    logmod = sys.modules.get("ipubuild.engine.log")
    if logmod is not None:
        logmod.log.note(text, target)
    say(text)


def came_from(target: str | None, hit: bool, remote: bool) -> None:
    """A step task that ran found its result in the cache (``hit``; in the shared tier:
    ``remote``), or computed it: the quiet console's summary counts it so."""
    r = _active[0]
    if isinstance(r, Console) and hit:
        c = r.counts.setdefault(target, [0, 0, 0, 0])
        c[2] += 1
        c[3] += bool(remote)


class Reporter(ConsoleReporter):
    """doit's console reporter, with ipubuild's errors as one line and no traceback
    (``IPUBUILD_VERBOSE=1`` shows tracebacks)."""

    def initialize(self, tasks, selected_tasks):
        _active[0] = self
        settings["running"] = True
        # bare `doit` selects the default tasks: none of them is named on the command line
        bare = list(selected_tasks or ()) == list(settings.get("defaults") or ())
        settings["chosen"] = set() if bare else set(selected_tasks or ())

    def execute_task(self, task):
        settings["current"] = task.name
        super().execute_task(task)

    def add_failure(self, task, fail):
        if isinstance(fail, TaskFailed) and not os.environ.get("IPUBUILD_VERBOSE"):
            self.say(f"error: {fail.message}\n")
            logmod = sys.modules.get("ipubuild.engine.log")
            if logmod is not None and (task.meta or {}).get("target"):
                logmod.log.note(f"error: {fail.message}\n", task.meta["target"], start=True)
            self.failures.append({"task": task, "exception": fail, "one_line": True})
            return
        super().add_failure(task, fail)

    def complete_run(self):
        self.failures = [f for f in self.failures if not f.get("one_line")]
        super().complete_run()

    def write(self, text):
        write(self.outstream, text)

    _write = write

    def say(self, text: str) -> None:
        write(self.outstream, text)


class Console(Reporter):
    """The quiet console: progress (``ipubuild.progress``) instead of a line per task."""

    # what the progress views write with: they are handed this reporter, not this module
    real_stdout = property(lambda self: _stdout)
    write_to = staticmethod(write)

    def __init__(self, outstream, options):
        super().__init__(outstream, options)
        self.t0 = time.perf_counter()
        self.total = self.done = 0
        # target (None: shared) -> [phase tasks run, up to date, of those run: from the cache, remote]
        self.counts: dict = {}
        self.failed: list = []
        self.view = None

    def initialize(self, tasks, selected_tasks):
        super().initialize(tasks, selected_tasks)
        seen, todo = set(), list(selected_tasks or ())
        while todo:
            name = todo.pop()
            if name not in seen and name in tasks:
                seen.add(name)
                todo.extend(tasks[name].task_dep + tasks[name].setup_tasks)
        self.total = sum(1 for n in seen if tasks[n].actions)

    def _count(self, task, i: int) -> None:
        meta = task.meta or {}
        if "kind" in meta:
            self.counts.setdefault(meta["target"], [0, 0, 0, 0])[i] += 1

    def execute_task(self, task):
        settings["current"] = task.name
        meta = task.meta or {}
        if "kind" not in meta:
            return
        self._count(task, 0)
        if task.verbosity == 2 and settings["log_level"]:     # doit -v 2: the whole log
            settings["log_level"] = 0
            configure_log()
        if self.view is None:
            from .progress import view
            self.view = view(self, settings["mode"] == "live")
        self.view.start(task.name, meta)

    def add_success(self, task):
        self.done += bool(task.actions)
        if self.view is not None and "kind" in (task.meta or {}):
            self.view.finish(task.name, task.meta)

    def skip_uptodate(self, task):
        self.done += bool(task.actions)
        self._count(task, 1)

    def skip_ignore(self, task):
        self.skip_uptodate(task)

    def add_failure(self, task, fail):
        self.done += bool(task.actions)
        self.failed.append(task)
        super().add_failure(task, fail)

    def complete_run(self):
        if self.view is not None:
            self.view.stop()
        if self.failed and not settings["interrupted"]:
            logmod = sys.modules.get("ipubuild.engine.log")
            logs = {logmod.log.log_file(t.meta["target"]) for t in self.failed
                    if logmod is not None and (t.meta or {}).get("target")} - {None}
            # the failed targets' tasks (and the shared ones), not those of targets that built
            mine = {(t.meta or {}).get("target") for t in self.failed} | {None}
            total = [sum(c[i] for k, c in self.counts.items() if k in mine) for i in range(4)]
            where = "".join(f"; log: {os.path.relpath(p)}" for p in sorted(logs))
            counts = f" ({self._counts(*total)})" if total[0] + total[1] else ""
            self.say(f"failed: {', '.join(t.name for t in self.failed)}{counts}{where}\n")
        super().complete_run()

    def say(self, text: str) -> None:
        if self.view is not None:
            self.view.print(text)
        else:
            write(_stdout, text)

    def _counts(self, ran: int, fresh: int, cached: int = 0, remote: int = 0) -> str:
        """``24 tasks: 3 ran, 21 from the cache (18 remote), 0 up to date, 5.2 s``: of the tasks
        doit ran, those that computed their result and those that found it in the action cache
        (local or shared), and the tasks doit found up to date."""
        total = ran + fresh
        where = f" ({remote} remote)" if remote else ""
        return (f"{total} task{'s' if total != 1 else ''}: {ran - cached} ran, {cached} from the cache{where}, "
                f"{fresh} up to date, {time.perf_counter() - self.t0:.1f} s")

    def summary(self, target: str) -> str:
        """What a target's build did, said above its closing lines."""
        mine, shared = self.counts.get(target, [0, 0, 0, 0]), self.counts.get(None, [0, 0, 0, 0])
        ran, fresh, cached, remote = (mine[i] + shared[i] for i in range(4))
        if not ran:
            return f"{target} is up to date ({fresh} tasks checked, {time.perf_counter() - self.t0:.2f} s)\n"
        logmod = sys.modules.get("ipubuild.engine.log")
        path = logmod.log.log_file(target) if logmod is not None else None
        where = f"; log: {os.path.relpath(path)}" if path is not None else ""
        return f"{target} built: {self._counts(ran, fresh, cached, remote)}{where}\n"


# Ctrl-C --------------------------------------------------------------------------------------------
_main_pid = [0]


def _catch_interrupts() -> None:
    _main_pid[0] = os.getpid()
    signal.signal(signal.SIGINT, _on_interrupt)
    sys.excepthook = _excepthook


def _on_interrupt(signum, frame):
    if os.getpid() != _main_pid[0] or settings["interrupted"]:
        os._exit(130)         # a forked worker (the main process reports), or a second Ctrl-C
    settings["interrupted"] = True
    raise KeyboardInterrupt


def _excepthook(kind, value, tb):
    if not issubclass(kind, KeyboardInterrupt):
        return sys.__excepthook__(kind, value, tb)
    r = _active[0]
    if isinstance(r, Console) and r.view is not None:
        r.view.stop()
    where = f" during {settings['current']}" if settings.get("current") else ""
    sys.stdout.flush()
    sys.stderr.write(f"interrupted{where}; finished tasks are kept, and the next build resumes from them\n")
    sys.stderr.flush()
    os._exit(130)
