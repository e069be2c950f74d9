"""Helpers for tests that build small target trees through doit in a subprocess.

A tree is a folder with the repo's ``dodo.py`` and ``targets/<name>.toml``; ``doit`` runs in it
as ``python -m doit ...`` with the tree as the working directory (so a tree-local copy of
``ipubuild/``, if any, is the one imported: ``-m`` puts the working directory first on sys.path).
"""
from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# The same small ViT as tests/test_search.py: a clean build takes a few seconds.
SMALL = """\
[target]
tile_count = 16
[model]
family = "vit"
image_size = 64
patch = 16
width = 64
heads = 2
mlp = 128
classes = 10
[search]
rounds = 3
shortlist = 3
workers = 2
"""

PLANNING_TASKS = ("plan_package", "place_provisional_storage", "schedule_provisional_exchanges",
                  "plan_kernels", "link_runtime", "size_tile_code", "place_storage", "lower_exchanges",
                  "optimize_exchange_placement", "prepare_tile_code", "emit_tile_code")

TIMEOUT = 300


def make_tree(path: Path, targets: dict[str, str] | None = None) -> Path:
    """A fresh tree at ``path`` with the repo's dodo.py and the given ``{name: toml text}``
    targets (default: the small target as ``small``)."""
    path = Path(path).resolve()
    (path / "targets").mkdir(parents=True, exist_ok=True)
    shutil.copyfile(ROOT / "dodo.py", path / "dodo.py")
    for name, text in (targets if targets is not None else {"small": SMALL}).items():
        (path / "targets" / f"{name}.toml").write_text(text)
    return path


def precompile(folder: Path) -> None:
    """Byte-compile every module under ``folder`` into hash-checked ``.pyc`` files: an import
    checks the source's hash, never its mtime, so a copy carries them along and an edit (same
    size, same second) is still seen. Where ``PYTHONDONTWRITEBYTECODE`` is set, every subprocess
    would otherwise compile the ~90 modules it imports again (~0.4 s each, hundreds of builds).
    ``force``: a tree's own timestamp ``.pyc`` files (written by a plain ``python``) would
    otherwise be kept, and copied; compileall rewrites hash-checked ones every run anyway."""
    import compileall
    import py_compile
    compileall.compile_dir(str(folder), quiet=2, workers=1, force=True,
                           invalidation_mode=py_compile.PycInvalidationMode.CHECKED_HASH)


def copy_ipubuild(dest_dir: Path, source: Path | None = None) -> Path:
    """Copy the ``ipubuild/`` package (of the repo, or the one under ``source``) into
    ``dest_dir``, with its hash-checked bytecode (``precompile``); return the copy."""
    dest = Path(dest_dir) / "ipubuild"
    src = Path(source) / "ipubuild" if source is not None else ROOT / "ipubuild"
    # with __pycache__: ``precompile`` made the repository's hash-checked (conftest)
    shutil.copytree(src, dest, ignore=shutil.ignore_patterns(".*.tmp"))
    return dest


def snapshot(dest_dir: Path) -> dict:
    """Copy the repo's ipubuild/ into ``dest_dir`` and return the environment that imports it.

    Builds in a test then run one fixed version of the code even while someone edits the
    working copy (an edit changes code fingerprints, and so which tasks a run executes).
    """
    copy_ipubuild(dest_dir)
    return env(dest_dir)


def env(tree: Path | None = None, **extra) -> dict:
    """The environment for a doit subprocess; with ``tree``, ``tree`` comes first on PYTHONPATH
    (a tree-local ``ipubuild/`` is then the one imported). The console is the scripts' one —
    doit's per-task lines and the whole log (``IPUBUILD_CONSOLE=tasks IPUBUILD_LOG=debug``) —
    unless ``extra`` says otherwise."""
    e = dict(os.environ)
    for k in ("IPUBUILD_VERBOSE", "IPUBUILD_CACHE_DIR", "IPUBUILD_PLUGINS"):
        e.pop(k, None)
    for k in [k for k in e if k.startswith(("IPUBUILD_REMOTE_CACHE", "IPUBUILD_SCHEDULER"))]:  # nor their cluster
        e.pop(k)
    e.update(IPUBUILD_CONSOLE="tasks", IPUBUILD_LOG="debug")
    if tree is not None:
        e["PYTHONPATH"] = os.pathsep.join([str(tree)] + ([e["PYTHONPATH"]] if e.get("PYTHONPATH") else []))
    e.update(extra)
    return e


class Run:
    """A finished doit run: its exit code, stdout and stderr."""

    def __init__(self, args, returncode: int, stdout: str, stderr: str):
        self.args, self.returncode, self.stdout, self.stderr = args, returncode, stdout, stderr

    @property
    def output(self) -> str:
        return self.stdout + self.stderr

    @property
    def executed(self) -> list[str]:
        """The tasks doit executed (its ``.  task`` lines; ``--`` lines are up to date)."""
        return re.findall(r"^\.  (\S+)", self.stdout, re.MULTILINE)

    @property
    def error_lines(self) -> list[str]:
        return [ln for ln in self.stdout.splitlines() if ln.startswith("error:")]

    def tail(self, n: int = 3000) -> str:
        return f"exit {self.returncode}\n--- stdout ---\n{self.stdout[-n:]}\n--- stderr ---\n{self.stderr[-n:]}"


def doit(tree: Path, *args: str, environ: dict | None = None, timeout: float = TIMEOUT) -> Run:
    """Run ``python -m doit <args>`` in ``tree`` and wait for it (killing its group on timeout)."""
    cmd = [sys.executable, "-m", "doit", *args]
    p = subprocess.Popen(cmd, cwd=tree, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env=environ or env(), start_new_session=True)
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, err = p.communicate()
        raise AssertionError(f"doit {' '.join(args)} in {tree} timed out after {timeout} s\n{out[-3000:]}\n{err[-3000:]}")
    return Run(cmd, p.returncode, out, err)


def start(tree: Path, *args: str, log: Path, environ: dict | None = None) -> subprocess.Popen:
    """Start ``python -m doit <args>`` in its own process group, output to ``log``."""
    with open(log, "w") as f:
        return subprocess.Popen([sys.executable, "-m", "doit", *args], cwd=tree, stdout=f,
                                stderr=subprocess.STDOUT, env=environ or env(), start_new_session=True)


def package(tree: Path, name: str) -> bytes:
    return (Path(tree) / "artifacts" / name / f"{name}.ipuexe").read_bytes()


def assert_passed(run: Run, name: str) -> None:
    assert run.returncode == 0, run.tail()
    assert "numericalTest=PASS" in run.stdout, run.tail()
    assert "Traceback" not in run.output, run.tail()


def on_head_grids(graph, plans: dict, layout: dict) -> dict:
    """``layout`` with each attention operation on its squarest grid of its heads (``cols``
    plans) and the softmax between them on its default plan of its own (a grid's row blocks
    are not whole rows, which it would need to follow the scores)."""
    out = {"ops": {k: dict(v) for k, v in layout["ops"].items()}}
    for op in graph.ops:
        grids = [i for i, p in enumerate(plans[op.id]) if "cols" in p]
        if grids:
            squarest = min(grids, key=lambda i: (abs(plans[op.id][i]["rows"] - plans[op.id][i]["cols"]), i))
            out["ops"][str(op.id)] = {"plan": squarest, "offset": 0}
        elif op.type == "softmax":
            out["ops"][str(op.id)] = {"plan": 0, "offset": 0}
    return out
