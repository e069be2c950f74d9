"""doit integration: every target's steps as doit tasks, the ``build:<target>`` entry point, and
``inspect:<target>``.

A project's ``dodo.py`` is three lines::

    from ipubuild.tasks import load
    globals().update(load(__file__))

Tasks are named ``<phase>:<target>`` (``place_storage:vit_fp8``), ``compile_kernels:<variant>``
and ``build_tile_images:<target>/tile<N>``; ``doit list --all`` shows them. A task's
``file_dep`` are the reference files of its inputs (and real sources), its ``targets`` the
reference files of its outputs; an ``uptodate`` check on the phase's code, plugins and
configuration re-runs it when those change. One lock per tree serialises concurrent runs.
"""
from __future__ import annotations

import fcntl
import hashlib
import os
import traceback
from pathlib import Path

from doit.exceptions import TaskFailed
from doit.reporter import ConsoleReporter
from doit.tools import config_changed

from . import canonical
from .errors import UserError
from .files import write_if_changed
from .log import log, write_trace
from .pipeline import Step, Workspace

_locks: dict[Path, object] = {}


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
        log.info("waiting for another build in this tree", lock=path)
        fcntl.flock(f, fcntl.LOCK_EX)
    _locks[path] = f


class Reporter(ConsoleReporter):
    """doit's console reporter, with ipubuild's errors as one line and no traceback
    (``IPUBUILD_VERBOSE=1`` shows tracebacks)."""

    def add_failure(self, task, fail):
        if isinstance(fail, TaskFailed) and not os.environ.get("IPUBUILD_VERBOSE"):
            self._write(f"error: {fail.message}\n")
            self.failures.append({"task": task, "exception": fail, "one_line": True})
            return
        super().add_failure(task, fail)

    def complete_run(self):
        rest = [f for f in self.failures if not f.get("one_line")]
        self.failures = rest
        super().complete_run()

    def _write(self, text):
        self.outstream.write(text)


def _action(ws: Workspace, step: Step):
    def run():
        try:
            ws.execute(step)
        except UserError as exc:
            return TaskFailed(str(exc))
        except Exception as exc:  # noqa: BLE001
            if os.environ.get("IPUBUILD_VERBOSE"):
                traceback.print_exc()
            plugin = ws.plugins.culprit(exc)
            if plugin:
                return TaskFailed(f"plugin {plugin}: raised {type(exc).__name__} in phase {step.phase}: {exc} "
                                  "(IPUBUILD_VERBOSE=1 shows the traceback)")
            return TaskFailed(f"internal error in phase {step.phase} ({type(exc).__name__}: {exc}); "
                              "rerun with IPUBUILD_VERBOSE=1 for the traceback")
        return None
    return run


def step_task(ws: Workspace, step: Step) -> dict:
    deps = [str(ws.ref_path(a)) for a in step.inputs.values()] + [str(p) for p in step.sources.values()]
    targets = [str(ws.ref_path(a)) for a in step.outputs.values()] + [str(p) for p in step.files.values()]
    return {"basename": step.task, "name": step.name, "actions": [_action(ws, step)],
            "file_dep": deps, "targets": targets, "uptodate": [config_changed(ws.signature(step))],
            "doc": step.doc or f"phase {step.phase}", "verbosity": 2}


def _finish(ws: Workspace, target: dict, files: list):
    """Restore the build's output files from the cache (so that what is reported is what was
    tested, even if someone changed a file), print the closing lines and write the trace; fail
    on a failed numerical test."""
    def run():
        try:
            return report()
        except UserError as exc:
            return TaskFailed(str(exc))

    def report():
        t = target["name"]
        for artifact, path in files:
            want = ws.read_ref(artifact)
            if _file_digest(path) != want:
                write_if_changed(path, ws.engine.fetch(want))
        verdict = canonical.loads(ws.engine.fetch(ws.read_ref(f"{t}/verdict")))
        cost = canonical.loads(ws.engine.fetch(ws.read_ref(f"{t}/cost")))
        out = ws.artifacts / t
        rel = lambda p: os.path.relpath(p, ws.root)  # noqa: E731
        write_if_changed(out / f"{t}.resolved.toml", _resolved(target))
        write_trace(out / "build.trace.json", f"doit build:{t}")
        log.plain(f"final_cycles={cost['final_cycles']} final_exchange={cost['final_exchange']} "
                  f"lower_bound={cost['lower_bound']} peak_bound={cost.get('peak_bound')}")
        log.plain(f"profile={rel(out / f'{t}.profile.json')} tiles={verdict['tiles']} samples={verdict['samples']}")
        log.plain(f"referenceMinimumCosineSimilarity={verdict['min_cosine']}")
        verdict_word = "PASS" if verdict["pass"] else "FAIL"
        log.plain(f"referenceMaximumAbsoluteError={verdict['max_abs_error']} numericalTest={verdict_word}")
        device_word = "PASS" if verdict["device_ok"] else "FAIL"
        log.plain(f"package={rel(out / f'{t}.ipuexe')} tiles={verdict['tiles']} "
                  f"device={target['target']['device']} deviceTest={device_word}")
        if not verdict["pass"]:
            th = verdict["thresholds"]
            return TaskFailed(f"{target['path']}: numerics: numerical test failed (min cosine "
                              f"{verdict['min_cosine']} vs {th['min_cosine']}, max abs error "
                              f"{verdict['max_abs_error']} vs {th['max_abs_error']})")
        if not verdict["device_ok"]:
            return TaskFailed(f"device {target['target']['device']}: a vertex reported an error")
        return None
    return run


def _file_digest(path) -> str | None:
    try:
        with open(path, "rb") as f:
            return hashlib.file_digest(f, "sha256").hexdigest()
    except OSError:
        return None


def _resolved(target: dict) -> bytes:
    from .targets import dump_resolved
    return dump_resolved(target)


def _inspect(ws: Workspace, target: dict):
    def run():
        from .package import read_package, summarize
        path = ws.artifacts / target["name"] / f"{target['name']}.ipuexe"
        if not path.exists():
            return TaskFailed(f"{path}: no package yet; run `doit build:{target['name']}` first")
        try:
            for line in summarize(read_package(path)):
                log.plain(line)
        except UserError as exc:
            return TaskFailed(str(exc))
        return None
    return run


def _list_plugins(ws: Workspace):
    def run():
        pm = ws.plugins
        for name, plugin in sorted(pm.list_name_plugin()):
            dist, version = pm.dists.get(name, (name, "0"))
            hooks = sorted(h.name for h in pm.get_hookcallers(plugin) or [])
            log.plain(f"{name}  {dist}=={version}  hooks: {', '.join(hooks)}")
        return None
    return run


def _broken(message: str):
    def run():
        return TaskFailed(message)
    return run


def load(dodo_file, *, extra_config: dict | None = None) -> dict:
    """The namespace a dodo.py exposes: DOIT_CONFIG and one task creator for every target."""
    root = Path(dodo_file).resolve().parent

    def task_ipubuild():
        hold_build_lock(root)
        yield from _tasks(root)

    config = {"backend": "sqlite3", "dep_file": str(root / ".doit.db"), "verbosity": 2,
              "reporter": Reporter, "default_tasks": [], **(extra_config or {})}
    return {"DOIT_CONFIG": config, "task_ipubuild": task_ipubuild}


def _known_names(ws: Workspace) -> dict | None:
    """Registered model families, cast policies and devices, to check targets when they load
    (None if a plugin fails here: its error then surfaces in the phase that calls it)."""
    from .device import backends
    from .frontend import cast_policies, model_families
    try:
        return {"family": model_families(ws.plugins), "policy": sorted(cast_policies(ws.plugins)),
                "device": sorted(backends())}
    except UserError:
        return None


def _tasks(root: Path):
    from .build import check_machine, kernel_steps, machine_step, target_steps
    from .targets import discover, load_target
    try:
        ws = Workspace.at(root)
    except UserError as exc:
        yield {"basename": "build", "name": "all", "actions": [_broken(str(exc))]}
        return
    yield {"basename": "plugins", "actions": [_list_plugins(ws)], "uptodate": [False], "verbosity": 2,
           "doc": "list the loaded plugins, their versions and the hooks each implements"}
    seen_machines, kernels = set(), None
    known = _known_names(ws)
    for path in discover(root):
        rel = os.path.relpath(path, root)
        try:
            target = load_target(rel if Path(rel).resolve() == path.resolve() else path, known=known)
            check_machine(target)
        except UserError as exc:
            yield {"basename": "build", "name": path.stem, "actions": [_broken(str(exc))],
                   "doc": f"build {path.stem} (the target file has an error)"}
            continue
        machine = target["target"]["machine"]
        try:
            if machine not in seen_machines:
                seen_machines.add(machine)
                yield step_task(ws, machine_step(machine))
            if kernels is None:
                ksteps = kernel_steps(machine)
                kernels = [s.name for s in ksteps]
                for s in ksteps:
                    yield step_task(ws, s)
            steps = target_steps(target, kernels, ws.artifacts)
        except UserError as exc:
            yield {"basename": "build", "name": target["name"], "actions": [_broken(str(exc))]}
            continue
        for s in steps:
            yield step_task(ws, s)
        t = target["name"]
        files = [(s.outputs[slot], path) for s in steps for slot, path in s.files.items()]
        yield {"basename": "build", "name": t, "actions": [_finish(ws, target, files)],
               "file_dep": [str(ws.ref_path(f"{t}/verdict")), str(ws.ref_path(f"{t}/cost"))],
               "uptodate": [False], "verbosity": 2,
               "doc": f"compile, package, run on the device and check {t}"}
        yield {"basename": "inspect", "name": t, "actions": [_inspect(ws, target)], "uptodate": [False],
               "verbosity": 2, "doc": f"summarise the package of {t}"}
