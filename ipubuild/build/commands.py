"""The tasks around a build — ``inspect:``, ``profile:``, ``explain:``, ``plugins`` and the clean
action of ``build:`` — and ipubuild's ``doit clean``.

``ipubuild.tasks`` imports this module only when one of these runs. ``Clean`` replaces doit's
``clean`` command (through the ``doit.COMMAND`` entry point): the same command, plus ``--all``
(doit's ``--clean-all``) and ``--cache``, which also removes the tree's action cache and saved
search states — the one thing ``doit clean`` otherwise keeps, because everything else can be
restored from it.
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path

from doit.cmd_clean import Clean as DoitClean
from doit.exceptions import InvalidCommand, TaskFailed

from ..ui.console import chosen, say, settings
from ..engine.errors import UserError


def _not_built(task: str, where: str, message: str):
    """A command about a target never built here: an error when the task is named itself; in
    a group (bare ``doit explain``, ``doit inspect``), one line, and the other targets go on."""
    if chosen(task):
        return TaskFailed(f"{where}: {message}")
    say(f"skipped {task}: {message}\n")
    return None


def inspect(root: Path, entry: dict):
    from ..device.package import read_package, summarize
    t = entry["target"]
    path = root / "artifacts" / t / f"{t}.ipuexe"
    if not path.exists():
        return _not_built(f"inspect:{t}", os.path.relpath(path, root), f"no package yet; run `doit build:{t}` first")
    return _lines(lambda: summarize(read_package(path)))


def profile(root: Path, entry: dict):
    from .kernel_profile import profile_lines
    from ..ui.report import read_profile, top_steps_table
    t = entry["target"]
    path = root / "artifacts" / t / f"{t}.profile.json"
    if not path.exists():
        return _not_built(f"profile:{t}", os.path.relpath(path, root), f"no profile yet; run `doit build:{t}` first")

    def lines():
        from ..ui.profile_diff import changes
        yield from top_steps_table(read_profile(path, t, shown=os.path.relpath(path, root)))
        yield ""
        yield from profile_lines(root, t)
        yield ""
        yield from changes(root, t)
    return _lines(lines)


def explain(root: Path, entry: dict):
    from .explain import built, report
    t = entry["target"]
    if not built(root, t):
        return _not_built(f"explain:{t}", f"explain:{t}", f"no build of {t} has run a task in this tree yet; "
                          f"run `doit build:{t}` first")
    return _lines(lambda: report(root, t))


def plugins(root: Path, entry: dict):
    """Each loaded plugin: its module, distribution and version, the hooks it implements, and
    what it registers (operators, model families, cast policies, graph passes, search
    heuristics, devices, cache backends, targets)."""
    from ..plugins import get_plugin_manager

    def lines():
        pm = get_plugin_manager()
        for name, plugin in sorted(pm.list_name_plugin()):
            dist, version = pm.dists.get(name, (name, "0"))
            hooks = sorted(h.name for h in pm.get_hookcallers(plugin) or [])
            yield f"{name}  {dist}=={version}  hooks: {', '.join(hooks)}"
            for label, names in pm.registrations(name):
                yield f"    {label}: {names}"
    return _lines(lines)


def _lines(make):
    try:
        for line in make():
            say(line + "\n")
    except UserError as exc:
        return TaskFailed(str(exc))
    return None


def clean_build(root: Path, entry: dict, dryrun: bool = False):
    """Remove what ``build:<target>`` wrote, and the target's files the build restores."""
    t = entry["target"]
    out = Path("artifacts") / t
    paths = [out / name for name in ("build.log", "build.trace.json", f"{t}.resolved.toml", f"{t}.changes.js",
                                     f"{t}.profile.previous.json", f"{t}.kernels.previous.json")]
    paths += [Path(p) for _, p in entry["files"]]
    for p in paths:
        if (root / p).is_file():
            say(f"build:{t} - removing file '{p}'\n")
            if not dryrun:
                (root / p).unlink()
    if not dryrun and (root / out).is_dir() and not any((root / out).iterdir()):
        (root / out).rmdir()


opt_all = {"name": "clean_all_alias", "long": "all", "type": bool, "default": False,
           "help": "the same as --clean-all: clean every task"}
opt_cache = {"name": "clean_cache", "long": "cache", "type": bool, "default": False,
             "help": "ipubuild: also remove the action cache (.ipubuild/cache or $IPUBUILD_CACHE_DIR) "
                     "and the saved search states"}


class Clean(DoitClean):
    doc_description = (DoitClean.doc_description + " In an ipubuild tree, --cache also removes the "
                       "action cache and the saved search states.")
    cmd_options = DoitClean.cmd_options + (opt_all, opt_cache)

    def _execute(self, dryrun, cleandep, cleanall, cleanforget, clean_all_alias=False, clean_cache=False,
                 pos_args=None):
        super()._execute(dryrun, cleandep, cleanall or clean_all_alias, cleanforget, pos_args=pos_args)
        if clean_cache:
            remove_cache(self.outstream, dryrun)


def remove_cache(out, dryrun: bool = False) -> None:
    """Remove the tree's action cache and the search states saved beside it."""
    root = settings.get("root")
    if root is None:
        raise InvalidCommand("--cache: this dodo.py does not load ipubuild's tasks")
    from ..engine.store import cache_dir
    cache = cache_dir(root)
    if cache.is_dir():
        if not ((cache / "id").is_file() or (cache / "cas").is_dir()):
            raise InvalidCommand(f"--cache: {cache} does not look like an ipubuild cache; not removing it")
        out.write(f"removing the action cache '{cache}'\n")
        if not dryrun:
            shutil.rmtree(cache)
    search = cache.parent / "search"
    for state in sorted(search.glob("*.state.json")) if search.is_dir() else ():
        out.write(f"removing the saved search state '{state}'\n")
        if not dryrun:
            state.unlink()
