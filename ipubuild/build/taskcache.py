"""The task-graph cache: a tree's analysis, remembered until something it was derived from changes.

Turning a tree into doit tasks — loading plugins, reading targets and machine descriptions,
fingerprinting code, identifying the C compiler — costs far more than deciding that nothing needs
to run. So the result of ``ipubuild.analysis.analyse`` (every task's steps, paths and up-to-date
signature) is saved in ``.ipubuild/analysis.json`` together with a *stamp* of everything it was derived from: the stat
keys (size, mtime, ctime, inode — see ``files.stat_key``) of every Python module and plugin
module, target and machine file, compiler executable, kernel-source folder and ``sys.path``
folder (an installed, upgraded or removed package changes its folder), the relevant environment
variables, the interpreter and the cache's identity. A later run whose stamp matches reuses the
graph without importing numpy, the planner or any plugin; any change re-derives it. (Bazel keeps
its analysis in a server for the same reason.)

What the tasks *read* while they run (kernel sources, target files, references) is not part of
the stamp: doit judges those by content, task by task.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from ..engine.files import stat_key_of, write_atomic

VERSION = 1
ENV = ("CC", "PATH", "PYTHONPATH", "PYTHONHASHSEED")
CONSOLE_ONLY = ("IPUBUILD_CONSOLE", "IPUBUILD_LOG", "IPUBUILD_VERBOSE")   # change what is shown, not the graph


def _env() -> dict:
    """The environment the analysis depends on, as digests (values may hold credentials)."""
    import hashlib
    keys = set(ENV) | {k for k in os.environ if k.startswith("IPUBUILD_") and k not in CONSOLE_ONLY}
    return {k: hashlib.sha256(os.environ[k].encode()).hexdigest()[:32] if k in os.environ else None
            for k in sorted(keys)}


def _interpreter() -> list:
    return [sys.version, os.path.realpath(sys.executable), sys.implementation.cache_tag]


def path(root: Path) -> Path:
    return Path(root) / ".ipubuild" / "analysis.json"


def stamp(watched: list[str]) -> dict:
    return {"version": VERSION, "interpreter": _interpreter(), "env": _env(),
            "files": {p: stat_key_of(p) for p in watched}}


def load(root: Path, analyse) -> dict:
    """The tree's analysis: the saved one if its stamp still holds, else ``analyse(root,
    previous)``'s (``{"tasks": [...], "watched": [paths]}``), saved for next time."""
    p = path(root)
    saved = None
    try:
        saved = json.loads(p.read_bytes())
        if isinstance(saved, dict) and saved.get("stamp") == _current(saved.get("stamp")):
            return saved
    except (OSError, ValueError):
        pass
    result = analyse(Path(root), saved if isinstance(saved, dict) else None)
    result["stamp"] = stamp(sorted(set(result.pop("watched"))))
    if result.pop("provisional", False):   # derived from something the stamp cannot watch
        return result
    try:
        write_atomic(p, json.dumps(result, sort_keys=True).encode())
    except Exception:  # noqa: BLE001 - a cache only: a read-only tree analyses every time
        pass
    return result


def _current(saved: dict | None) -> dict | None:
    """The stamp as it would be now, for the paths a saved stamp watched."""
    if not isinstance(saved, dict) or saved.get("version") != VERSION:
        return None
    files = saved.get("files")
    if not isinstance(files, dict):
        return None
    return stamp(list(files))
