"""Deliberate bugs in ipubuild's Python sources, one of each kind a weak test once let through
(issue 23), and the tests that must catch each: ``tests/test_mutations_bite.py`` applies each one
to a scratch copy of the repository (``ipubuild/``, ``tests/``, ``dodo.py``, ``targets/``), runs
its named tests there with ``-x``, and fails if they all still pass (the mutation survived).

A mutation is a regular expression replaced exactly once in a named file under ``ipubuild/``
(a kernel bug lives in ``tests/mutations.py``: those go through the kernel loop). Each names the
fast tests that catch it; the slower ones (whole builds) are marked ``slow``.
"""
from __future__ import annotations

import dataclasses
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


@dataclasses.dataclass(frozen=True)
class SourceMutation:
    name: str
    kind: str               # which of issue 23's seven kinds of bug
    what: str
    file: str               # under the repository
    pattern: str            # a regular expression, replaced exactly once
    replacement: str
    tests: tuple[str, ...]  # pytest node ids (relative to the repository) that must fail
    slow: bool = False

    def apply(self, tree: Path) -> None:
        path = Path(tree) / self.file
        text = path.read_text()
        new, n = re.subn(self.pattern, self.replacement, text, count=0, flags=re.M)
        if n != 1:
            raise AssertionError(f"mutation {self.name}: {self.pattern!r} matches {n} times in {self.file}, not once")
        path.write_text(new)


def scratch_copy(dest: Path) -> Path:
    """A copy of the repository's ``ipubuild/``, ``tests/``, ``dodo.py`` and ``targets/`` (what
    the named tests import and build) at ``dest``."""
    dest = Path(dest)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", ".*.tmp", "throwaway")
    for d in ("ipubuild", "tests", "targets"):
        shutil.copytree(ROOT / d, dest / d, ignore=ignore)
    for f in ("dodo.py", "pyproject.toml"):
        shutil.copyfile(ROOT / f, dest / f)
    return dest


def run_tests(tree: Path, tests, timeout: float = 900) -> subprocess.CompletedProcess:
    """Run ``tests`` (node ids) in ``tree`` with its own ``ipubuild/`` first on the path."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tree)] + ([os.environ["PYTHONPATH"]]
                                                                      if os.environ.get("PYTHONPATH") else [])))
    env.pop("PYTEST_ADDOPTS", None)
    return subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider",
                           "-o", "addopts=", *tests], cwd=tree, env=env, capture_output=True, text=True,
                          timeout=timeout)


E = "ipubuild/engine.py"
S = "ipubuild/search.py"
T_KEY = "tests/test_engine.py::test_every_declared_leaf_of_every_phase_moves_its_key_and_doit_signature"

MUTATIONS = [
    # (1) an action key missing a configuration leaf
    SourceMutation("key_drops_numerics_compare", "key", "the signature leaves map_values' numerics.compare out",
                   E, r'"config": config_subset\(config, ph\.config\)\}\)',
                   '"config": config_subset(config, [k for k in ph.config if k != "numerics.compare"])})',
                   (T_KEY,)),
    SourceMutation("key_drops_last_declared_leaf", "key", "config_subset forgets a phase's last declared key",
                   E, r"    for key in keys:\n", "    for key in list(keys)[:-1]:\n", (T_KEY,)),
]
MUTATIONS += [
    # (3) healing by a cold rebuild
    SourceMutation("heal_deletes_the_cache", "heal", "a damaged doit database 'healed' by deleting the whole cache too",
                   "ipubuild/tasks.py", r"^        os\.replace\(path, aside\)\n",
                   "        os.replace(path, aside)\n        import shutil\n"
                   "        shutil.rmtree(path.parent / '.ipubuild' / 'cache', ignore_errors=True)\n",
                   ("tests/test_selfheal.py::test_a_damaged_database_is_moved_aside[.doit.db]",), slow=True),
]
