"""doit integration: every target's steps as doit tasks, the ``build:<target>`` entry point,
``explain:<target>``, ``inspect:<target>`` and ``profile:<target>``.

A project's ``dodo.py`` is three lines::

    from ipubuild.tasks import load
    globals().update(load(__file__))

Tasks are named ``<phase>:<target>`` (``place_storage:vit_fp8``); ``doit list --all`` shows them.
A task's ``file_dep`` are the reference files of its inputs (and real sources), its ``targets``
the reference files of its outputs; doit judges them by content (``ContentChecker``). Its
``uptodate`` check carries the phase's *signature* — the same digest the engine puts in its action
key (``Engine.signature``) — and the cache's identity. One lock per tree serialises concurrent
runs. Bare ``doit`` (and ``doit clean``, ``doit forget``) works on every target whose model
family is available; the others are named and skipped. What a run prints is ``ipubuild.console``'s.

This module is what a no-op build runs, so it imports nothing heavy: the task graph comes from the
task-graph cache (``ipubuild.taskcache``; ``ipubuild.analysis`` derives it when it is stale), and
the engine, the planner and the plugins are imported only when a task actually runs.
"""
from __future__ import annotations

import fcntl
import json
import os
import sys
import time
from pathlib import Path

from doit.dependency import FileChangedChecker
from doit.exceptions import TaskFailed
from doit.tools import config_changed

from ..ui import console
from . import taskcache
from ..ui.console import Reporter  # noqa: F401 - doit's classic reporter (IPUBUILD_CONSOLE=tasks)
from ..engine.errors import UserError
from ..engine.files import file_digest, read_record, settled, stat_key, tree_memo, write_if_changed

_locks: dict[Path, object] = {}
_executed = [0]          # steps run by this process (a no-op build keeps the last build's trace)
_changed: set = set()    # sources that changed while a task that read them ran (warned once)


class ContentChecker(FileChangedChecker):
    """doit's file checker by content: a dependency changed when its sha256 did. An unchanged
    stat key (size, mtime, ctime, inode — no edit can preserve all four) skips re-hashing; an
    mtime restored by ``cp -p``, ``rsync -a`` or ``os.utime`` does not fool it. A source a step
    read (``files.read_recorded``) is recorded as read, not as it is when the task ends: an edit
    made while the task ran is reported once, and the next build rebuilds it."""

    def check_modified(self, file_path, file_stat, state):
        if not isinstance(state, list) or len(state) != 5:
            return True
        if state[0] is not None and stat_key(file_stat) == state[:4]:
            return False
        return file_digest(file_path) != state[4]

    def get_state(self, dep, current_state):
        key = stat_key(os.stat(dep))
        read = read_record(dep)
        if read is not None and read[0] != key and file_digest(dep) != read[1]:
            # changed while its task ran: record what the phase read, so the next build rebuilds it
            if dep not in _changed:
                _changed.add(dep)
                from ..engine.log import log
                log.warning(f"{dep} changed during the build; the next build rebuilds it")
            return [None] * 4 + [read[1]]
        if isinstance(current_state, list) and current_state[:4] == key:
            return None
        # a file changed within the clock's granularity could change again unseen: re-hash it
        # next time rather than trust its stat key
        return (key if settled(key) else [None] * 4) + [file_digest(dep)]


def hold_build_lock(root: Path) -> None:
    """Take this tree's build lock for the rest of the process (waits for another run)."""
    path = root / ".ipubuild" / "build.lock"
    if path in _locks:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    f = open(path, "a+")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        from ..engine.log import log
        log.info("waiting for another build in this tree", lock=path)
        if console.settings.get("mode") not in (None, "tasks") and console.settings.get("log_level"):
            console.say(f"waiting for another build in this tree (lock {path})\n")
        fcntl.flock(f, fcntl.LOCK_EX)
    _locks[path] = f


def heal_doit_db(path: Path) -> None:
    """Move a damaged doit database aside (``.doit.db.corrupt-<time>``): doit then starts a new
    one, and every task re-runs into the action cache — losing records is safe, trusting bad
    ones is not."""
    if not path.exists():
        return
    import sqlite3
    try:
        con = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
        try:
            ok = con.execute("PRAGMA quick_check").fetchone()[0] == "ok"
            if ok:   # and every row reads as doit reads it (a row quick_check passes can still fail)
                tables = {r[0] for r in con.execute("select name from sqlite_master where type = 'table'")}
                if "doit" in tables:
                    for task_id, data in con.execute("select task_id, task_data from doit"):
                        if not isinstance(task_id, str) or not isinstance(json.loads(data), dict):
                            ok = False
                            break
        finally:
            con.close()
    except Exception:  # noqa: BLE001 - whatever fails to read (a bad byte, bad JSON) is damage
        ok = False
    if not ok:
        aside = path.with_name(f"{path.name}.corrupt-{time.strftime('%Y%m%dT%H%M%S')}")
        os.replace(path, aside)
        from ..engine.log import log
        log.warning("moved a damaged doit database aside; every task will check the cache again",
                    damaged=aside)


def load(dodo_file, *, extra_config: dict | None = None) -> dict:
    """The namespace a dodo.py exposes: DOIT_CONFIG and one task creator for every target.

    Paths in tasks are relative to the tree (the folder of ``dodo_file``), which becomes the
    working directory: ``doit -d elsewhere`` and a moved tree find the same tasks."""
    root = Path(dodo_file).resolve().parent
    os.chdir(root)
    heal_doit_db(root / ".doit.db")
    reporter, verbose = console.setup(root)
    defaults: list[str] = []    # filled when the tasks load: doit reads this list only after
    console.settings["defaults"] = defaults

    def task_ipubuild():
        hold_build_lock(root)
        yield from tasks_of(root, defaults, verbose)
    # doit orders task creators by their source line (inspect.getsourcelines, which tokenizes the
    # function: ~5 ms of a no-op build); inspect unwraps __wrapped__ and gives a module line 0
    task_ipubuild.__wrapped__ = sys.modules[__name__]

    config = {"backend": "sqlite3", "dep_file": str(root / ".doit.db"), "reporter": reporter,
              "check_file_uptodate": ContentChecker, "default_tasks": defaults,
              **({"verbosity": 2} if verbose else {}), **(extra_config or {})}
    return {"DOIT_CONFIG": config, "task_ipubuild": task_ipubuild}


def tasks_of(root: Path, defaults: list | None = None, verbose: bool = True):
    """doit task dicts for every entry of the tree's analysis (and, in ``defaults``, the tasks
    bare ``doit`` runs: the ``build`` group of every target, and every step)."""
    graph = taskcache.load(root, _analyse)
    entries, docs = graph["tasks"], dict(graph.get("groups", {}))
    for e in entries:
        task = task_of(root, e, entries, verbose)
        if "name" in task and task["basename"] in docs:      # the group's own doc, before its first task
            yield {"basename": task["basename"], "name": None, "doc": docs.pop(task["basename"])}
        yield task
    if defaults is not None and any("build" in (e["kind"], e.get("basename")) for e in entries):
        # bare `doit` builds every target but those marked `[target] default = false` (built when
        # named), and says which it skipped
        optout = sorted(e["target"] for e in entries if e["kind"] == "build" and e.get("default") is False)
        builds = [f"build:{e.get('target', e.get('name'))}" for e in entries
                  if "build" in (e["kind"], e.get("basename")) and e.get("target") not in optout]
        defaults[:] = (["_skipped"] if optout else []) + builds + [f"{e['step']['task']}:{e['step']['name']}" for e in entries
                                if e["kind"] == "step" and e["meta"].get("target") not in optout]
        if optout:
            yield {"basename": "_skipped", "actions": [(_skipped, [optout])], "uptodate": [False],
                   "doc": "bare `doit`: say which targets it does not build ([target] default = false)"}


def _skipped(targets: list):
    n = len(targets)
    console.say(f"skipped {n} target{'s' if n != 1 else ''} marked [target] default = false: "
                f"{', '.join(targets)} (build one by name: doit build:{targets[0]})\n")


def _analyse(root: Path, previous: dict | None) -> dict:
    from .analysis import analyse
    return analyse(root, previous)


def step_task(ws, step) -> dict:
    """A doit task for one step of a workspace (for a dodo file that builds steps of its own)."""
    from .analysis import step_entry
    from ..engine.store import cache_identity
    entry = step_entry(ws, step, cache_identity(ws.cache))
    _workspaces.setdefault(ws.root, ws)
    ws.register([step])
    return task_of(ws.root, entry, [entry])


class Signature(config_changed):
    """The up-to-date check of a step: its signature, as doit's ``config_changed`` compares it;
    remembers whether doit had a record of the task (for ``explain``)."""

    recorded = True

    def __call__(self, task, values):
        self.recorded = values.get("_config_changed") is not None
        return super().__call__(task, values)


def task_of(root: Path, e: dict, entries: list, verbose: bool = True) -> dict:
    kind = e["kind"]
    v = {"verbosity": 2} if verbose else {}
    if kind == "step":
        s, sig = e["step"], Signature(e["signature"])
        return {"basename": s["task"], "name": s["name"], "actions": [_run_step(root, e, entries, sig)],
                "file_dep": e["file_dep"], "targets": e["targets"], "uptodate": [sig], "meta": e["meta"],
                "task_dep": [f"{t}:{s['name']}" for t in s.get("after", ())],
                "doc": e["doc"] or f"phase {s['phase']}", "clean": True, **v}
    if kind == "build":
        finish = Finish(root, e, entries)
        return {"basename": "build", "name": e["target"], "actions": [finish.run],
                "file_dep": e["file_dep"], "uptodate": [finish.uptodate], "meta": {"target": e["target"]},
                "clean": [(remove_build_files, [root, e])], **v,
                "doc": f"compile, package, run on the device and check {e['target']}"}
    if kind == "broken":
        return {"basename": e["basename"], "name": e["name"], "actions": [(_broken, [e])], **v,
                "doc": f"error: {e['message']}"}
    if kind == "kernel":        # `doit kernel:<variant> [--target T --repeat N --seed S --inputs a.npy,...]`
        return {"basename": "kernel", "name": e["variant"], "uptodate": [False], "doc": e["doc"], **v,
                "actions": [(_kernel, [root, e["variant"]])],
                "params": [{"name": "target", "long": "target", "default": "", "help": "take the shapes from this target"},
                           {"name": "repeat", "long": "repeat", "type": int, "default": 20, "help": "timed calls"},
                           {"name": "seed", "long": "seed", "type": int, "default": 0, "help": "seed of the inputs"},
                           {"name": "inputs", "long": "inputs", "default": "",
                            "help": "the operation's inputs as .npy files, comma-separated"}]}
    # a command around the builds: explain, inspect, profile (per target), plugins
    return {"basename": kind, **({"name": e["target"]} if "target" in e else {}), "uptodate": [False],
            "actions": [(_command, [kind, root, e])], "doc": e["doc"], **v}


def _kernel(root: Path, variant: str, target="", repeat=20, seed=0, inputs=""):
    from .kernel_cli import run_kernel
    try:
        ok, lines = run_kernel(root, variant, target=target, repeat=repeat, seed=seed, inputs=inputs)
    except Exception as exc:  # noqa: BLE001 - one line
        return _failure(exc, f"kernel:{variant}")
    console.say("".join(ln + "\n" for ln in lines))
    bad = next((ln.strip() for ln in lines if ": FAIL" in ln), lines[-1])
    return None if ok else TaskFailed(f"kernel {variant}: {bad}")


def _command(name: str, root: Path, entry: dict):
    from . import commands
    return getattr(commands, name)(root, entry)


def remove_build_files(root: Path, entry: dict, dryrun: bool = False):
    from .commands import clean_build
    clean_build(root, entry, dryrun)


def _broken(e: dict):
    """A target (or the whole tree) that failed to load: its error — except that a target whose
    model family is not installed is skipped, with a line saying so, unless named itself."""
    name = f"{e['basename']}:{e['name']}"
    if e.get("skip") and not console.chosen(name):
        console.say(f"skipped {name}: {e['message']}\n")
        return None
    return TaskFailed(e["message"])


# running tasks (these import the heavy parts) ----------------------------------------------------
_workspaces: dict = {}


def workspace(root: Path, entries: list):
    """The tree's workspace, with every step of its analysis registered (to re-make lost refs)."""
    ws = _workspaces.get(root)
    if ws is None:
        from . import build  # noqa: F401 - registers the phases
        from .pipeline import Step, Workspace
        ws = _workspaces[root] = Workspace.at(root)
        ws.plugins            # loaded before any phase runs: a plugin may register phases of its own
        ws.register(Step.from_json(e["step"]) for e in entries if e["kind"] == "step")
    return ws


def _failure(exc: Exception, where: str, plugins=None) -> TaskFailed:
    if isinstance(exc, UserError):
        return TaskFailed(str(exc))
    if os.environ.get("IPUBUILD_VERBOSE"):
        import traceback
        traceback.print_exc()
    plugin = plugins.culprit(exc) if plugins is not None else None
    if plugin:
        return TaskFailed(f"plugin {plugin}: raised {type(exc).__name__} in {where}: {exc} "
                          "(IPUBUILD_VERBOSE=1 shows the traceback)")
    return TaskFailed(f"internal error in {where} ({type(exc).__name__}: {exc}); "
                      "rerun with IPUBUILD_VERBOSE=1 for the traceback")


def _run_step(root: Path, entry: dict, entries: list, signature: Signature):
    def run():
        from .explain import watch
        from .pipeline import Step
        _executed[0] += 1
        ws = None
        try:
            ws = workspace(root, entries)
            with watch(ws, entry, entries, signature.recorded) as rec:
                result = ws.execute(Step.from_json(entry["step"]))
                if result.hit:
                    rec["cache"] = "remote" if result.remote else "local"
            console.came_from(entry["meta"].get("target"), result.hit, result.remote)
            if result.hit and "diagnostics" in result.outputs:   # a tool's warnings, from the cache
                from ..engine.log import log
                for what, text in ws.engine.decoded(result.outputs["diagnostics"]).items():
                    log.diagnostics(f"{what} (cached):\n{text}", once=(what, text))
        except Exception as exc:  # noqa: BLE001 - reported as one line
            plugins = ws._plugins if ws is not None else None
            return _failure(exc, f"phase {entry['step']['phase']}", plugins)
        return None
    return run


class Finish:
    """The end of ``build:<target>``: restore the build's output files (so that what is reported
    is what was tested, even if someone changed a file), print the closing lines, write the
    trace, and fail on a failed test.

    When nothing ran in this process, it all happens in doit's up-to-date check: a passing build
    is then *up to date* — doit records nothing and a no-op build writes nothing (it keeps the
    trace of the last build that did some work)."""

    def __init__(self, root: Path, entry: dict, entries: list):
        self.root, self.entry, self.entries = root, entry, entries
        self.outcome = None       # (failure or None), once reported

    def uptodate(self) -> bool | None:
        if _executed[0]:
            return False
        if not console.settings.get("running"):
            return None                 # not a build (`doit info`): the files decide
        try:
            return self.report() is None
        except Exception:  # noqa: BLE001 - the action then runs and reports it
            return False

    def run(self):
        try:
            return self.report()
        except Exception as exc:  # noqa: BLE001
            return _failure(exc, f"build:{self.entry['target']}")
        finally:
            ws = _workspaces.get(self.root)
            if ws is not None:
                ws.store.trim()
                ws.close()
            tree_memo(self.root).save()

    def report(self):
        if self.outcome is not None:
            return self.outcome[0]
        root, entry, t = self.root, self.entry, self.entry["target"]
        memo = tree_memo(root)
        for artifact, path in entry["files"]:
            want = _read_ref(root, artifact)
            if want is None or memo.digest(root / path) != want:
                workspace(root, self.entries).restore_artifact(artifact, root / path)
        memo.save()
        verdict = json.loads((root / entry["verdict_file"]).read_bytes())
        write_if_changed(root / "artifacts" / t / f"{t}.resolved.toml", entry["resolved"].encode())
        if _executed[0] or not (root / "artifacts" / t / f"{t}.changes.js").exists():
            _write_changes(root, t)      # else no profile moved: the file is the last build's
        if _executed[0]:
            from ..engine.log import write_trace
            write_trace(root / "artifacts" / t / "build.trace.json", f"doit build:{t}")
        cost = verdict["cost"]
        verdict_word = "PASS" if verdict["pass"] else "FAIL"
        from ..device.verdict import device_word
        console.closing(t,
            f"final_cycles={cost['final_cycles']} final_exchange={cost['final_exchange']} "
            f"lower_bound={cost['lower_bound']} peak_bound={cost.get('peak_bound')}\n"
            f"profile={entry['profile_file']} tiles={verdict['tiles']} samples={verdict['samples']}\n"
            f"float32MinimumCosineSimilarity={verdict['float32']['min_cosine']} "
            f"float32MaximumAbsoluteError={verdict['float32']['max_abs_error']}\n"
            f"{_onnxruntime_line(root, entry)}"
            f"referenceMinimumCosineSimilarity={verdict['min_cosine']}\n"
            f"referenceMaximumAbsoluteError={verdict['max_abs_error']} numericalTest={verdict_word}\n"
            f"package={entry['package_file']} tiles={verdict['tiles']} "
            f"device={entry['device']} deviceTest={device_word(verdict)}\n")
        ws = _workspaces.get(root)
        if ws is not None and ws.store.remote is not None:   # what the shared cache did
            console.say(ws.store.remote.summary() + "\n")
        failure = None
        if not verdict["pass"] or not verdict["device_ok"]:
            from ..device.verdict import failure_line
            failure = TaskFailed(failure_line(verdict, entry["path"], entry["device"]))
        self.outcome = (failure,)
        return failure


def _onnxruntime_line(root: Path, entry: dict) -> str:
    """The ONNX target's onnxruntime figures (a line), or nothing for other targets."""
    path = next((p for a, p in entry["files"] if a.endswith("/onnxruntime")), None)
    if path is None:
        return ""
    from ..device.onnxruntime_ref import closing_line
    try:
        return closing_line(json.loads((root / path).read_bytes())) + "\n"
    except (OSError, ValueError):
        return "onnxruntime: no comparison: its report is unreadable\n"


def _write_changes(root: Path, t: str) -> None:
    """``<t>.changes.js`` beside the profile page: what moved since the previous build, which the
    page marks (``ipubuild.ui.profile_diff``); written only when it changes."""
    from ..ui.profile_diff import changes, marks, of_target
    d = of_target(root, t)
    lines = changes(root, t)[1:] if d is not None else []
    value = {"lines": [ln.strip() for ln in lines if ln.strip() != "nothing moved"], "marks": marks(d)}
    write_if_changed(root / "artifacts" / t / f"{t}.changes.js",
                     f"window.IPUBUILD_CHANGES = {json.dumps(value, sort_keys=True)};\n".encode())


def _read_ref(root: Path, artifact: str) -> str | None:
    try:
        text = (root / ".ipubuild" / "refs" / f"{artifact}.ref").read_text().strip()
    except (OSError, UnicodeDecodeError):
        return None
    return text if len(text) == 64 else None
