"""Watch mode for the kernel loop: ``doit watch build:vit_fp8`` (or ``python -m ipubuild.build.watch
build:vit_fp8``) runs ``doit build:vit_fp8``, then runs it again each time a file the build reads
is saved — a kernel source or header, a target file, ipubuild's or a plugin's code, a machine
description — with the usual early cutoffs (it is the same ``doit`` run). Ctrl-C stops it.

doit's own ``doit auto`` is no longer part of doit (0.36 moved it to the ``doit-auto1`` plugin, which
needs an inotify binding); this is a dependency-free equivalent that polls the files' stat keys
every ``IPUBUILD_WATCH_INTERVAL`` seconds (default 0.2). What it watches is what the build
itself judges: the paths the tree's saved analysis was derived from (``.ipubuild/analysis.json``'s
stamp: every Python module, plugin module, target and machine file, compiler and kernel folder)
and the real files the selected targets' tasks read (their ``file_dep`` outside ``.ipubuild/``:
the kernel sources), read again after every run so that a new target or source is watched too.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from doit.cmd_base import Command


def watched(root: Path, args: list[str]) -> list[str]:
    """The files a run of ``doit <args>`` in ``root`` reads (see the module's docstring)."""
    try:
        saved = json.loads((root / ".ipubuild" / "analysis.json").read_bytes())
    except (OSError, ValueError):
        return []
    names = {a.partition(":")[2] for a in args if ":" in a and not a.startswith("-")}
    out = set(saved.get("stamp", {}).get("files", {}))
    for e in saved.get("tasks", []):
        if e.get("kind") != "step":
            continue
        target = e.get("meta", {}).get("target")
        if names and target is not None and target not in names:
            continue
        out.update(p for p in e.get("file_dep", []) if not p.startswith(".ipubuild"))
    return sorted(out)


def _stat(path: str):
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_mtime_ns, st.st_size, st.st_ino)


def _snapshot(root: Path, files: list[str]) -> dict:
    return {f: _stat(f if os.path.isabs(f) else str(root / f)) for f in files}


def loop(root: Path, args: list[str], *, interval: float | None = None, runs: int | None = None,
         out=None) -> int:
    """Run ``doit <args>`` in ``root``, then again on every change of what it reads; stop after
    ``runs`` runs (None: until interrupted). Returns the last run's exit code."""
    out = out or sys.stdout
    interval = interval if interval is not None else float(os.environ.get("IPUBUILD_WATCH_INTERVAL", "0.2"))
    cmd = [sys.executable, "-m", "doit", *args]
    done, code = 0, 0
    try:
        while True:
            code = subprocess.run(cmd, cwd=root).returncode
            done += 1
            files = watched(root, args)
            before = _snapshot(root, files)
            if runs is not None and done >= runs:
                return code
            out.write(f"watching {len(files)} files for doit {' '.join(args) or '(the default targets)'}; "
                      "Ctrl-C stops\n")
            out.flush()
            while True:
                time.sleep(interval)
                now = _snapshot(root, files)
                changed = [f for f in files if now[f] != before[f]]
                if changed:
                    full = {f: f if os.path.isabs(f) else str(root / f) for f in changed}
                    # a folder changes with the file saved in it: name the files
                    changed = [f for f in changed if not os.path.isdir(full[f])] or changed
                    shown = ", ".join(os.path.relpath(f, root) if os.path.isabs(f) else f for f in changed[:3])
                    out.write(f"changed: {shown}{' …' if len(changed) > 3 else ''}; building again\n")
                    out.flush()
                    break
    except KeyboardInterrupt:
        out.write("watch stopped\n")
        return 130


class Watch(Command):
    """``doit watch [doit run arguments]``: build, then build again on every save of what the
    build reads (``ipubuild.build.watch``)."""

    name = "watch"
    doc_purpose = "build, then build again whenever a file the build reads is saved"
    doc_usage = "[TASK ...]"
    doc_description = __doc__
    cmd_options = ()

    def execute(self, params, args):
        return loop(Path.cwd(), list(args))


def main(argv: list[str] | None = None) -> int:
    return loop(Path.cwd(), list(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    sys.exit(main())
