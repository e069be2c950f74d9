"""Incremental equals clean: a table of changes, each built incrementally on a built tree and
clean in a fresh tree with an empty cache, comparing the package, the profile and every artifact
digest. Each row also says which tasks the incremental build ran, and some rows pin that down
(a comment edit runs nothing, a machine edit no kernel reads recompiles no kernel, building from
another directory or a moved tree is a no-op). The table is printed at the end of the run.
Changes that leave the same files and environment (an edit with its mtime restored, a touch, a
build from elsewhere) share one clean build.

Each tree carries its own copy of ipubuild/ (first on PYTHONPATH), so that changes can edit the
compiler's code as a developer would; every build compiles kernels with one wrapper script around
gcc (``IPUBUILD_CC``), so that a change can edit the compiler without changing its version.
"""
from __future__ import annotations

import dataclasses
import os
import re
import shutil
import stat
from pathlib import Path
from typing import Callable

import pytest
from buildtree import PLANNING_TASKS, SMALL, copy_ipubuild, doit, env, make_tree

NAME = "small"
TEXT = SMALL.replace("rounds = 3", "rounds = 1")
ROWS: list[tuple] = []
CLEAN: dict[str, tuple[dict, dict]] = {}     # change id ("base": no change) -> its clean build's (refs, outputs)
WRAPPER = '#!/bin/sh\nexec gcc "$@"\n'


@dataclasses.dataclass
class Change:
    id: str
    apply: Callable          # apply(tree, environ) -> environ (edits files; may return a new env)
    expect: Callable = None  # expect(executed tasks) -> None (asserts)
    build_args: Callable = None  # build_args(tree) -> (cwd, args) for the incremental build
    clean_as: str = None     # the change whose clean build this one's is (the same files and environment)


def _edit(rel: str, old: str, new: str, *, keep_mtime: bool = False):
    def apply(tree: Path, environ: dict) -> dict:
        p = tree / rel
        st = p.stat()
        text = p.read_text()
        assert old in text, (rel, old)
        p.write_text(text.replace(old, new, 1))
        if keep_mtime:  # as cp -p, rsync -a or tar x would leave it
            os.utime(p, ns=(st.st_atime_ns, st.st_mtime_ns))
        return environ
    return apply


def _append(rel: str, text: str):
    def apply(tree: Path, environ: dict) -> dict:
        with open(tree / rel, "a") as f:
            f.write(text)
        return environ
    return apply


def _env(**kv):
    def apply(tree: Path, environ: dict) -> dict:
        return dict(environ, **kv)
    return apply


def _wrapper_cc(script: str):
    def apply(tree: Path, environ: dict) -> dict:
        Path(environ["IPUBUILD_CC"]).write_text(script)
        return environ
    return apply


def _plugin(apply_env: bool):
    """A plugin module adding a search heuristic that proposes nothing."""
    def apply(tree: Path, environ: dict) -> dict:
        (tree.parent / "plugs").mkdir(exist_ok=True)
        (tree.parent / "plugs" / "quiet_heuristic.py").write_text(
            "from ipubuild import hookimpl\nfrom ipubuild.search import Heuristic\n\n"
            "@hookimpl\ndef ipubuild_search_heuristics():\n"
            "    return [Heuristic('quiet', lambda layout, sc: [])]\n")
        if not apply_env:
            return environ
        return dict(environ, IPUBUILD_PLUGINS="quiet_heuristic",
                    PYTHONPATH=environ["PYTHONPATH"] + os.pathsep + str(tree.parent / "plugs"))
    return apply


def _touch_all(tree: Path, environ: dict) -> dict:
    for p in list((tree / "ipubuild").rglob("*")) + list((tree / "targets").glob("*")):
        if p.is_file():
            os.utime(p)
    return environ


def ran_only(*prefixes):
    def check(run):
        assert all(t.startswith(prefixes) for t in run.executed), run.executed
    return check


def ran_nothing(run):
    assert run.executed == [], run.executed


def ran_nothing_of(prefix):
    def check(run):
        assert not [t for t in run.executed if t.startswith(prefix)], run.executed
    return check


def ran_no_planning(run):
    assert not [t for t in run.executed if t.startswith(tuple(f"{p}:" for p in PLANNING_TASKS))], run.executed


def ran_planning(run):
    assert f"plan_package:{NAME}" in run.executed, run.executed
    no_compile(run)


def no_compile(run):
    """No kernel variant compiled (the compile task may run, to recompute reservations)."""
    assert "compiled kernel variant" not in run.output, run.tail()


PROBE = "int ipubuild_incremental_probe(int x) { return 3 * x + 1; }\n\n"

CHANGES = [
    # code edits that keep the kernel's numbers (a changed coefficient would fail the numerical test)
    Change("kernel code edit", _edit("ipubuild/kernels/gelu.c", "IPU_VERTEX\n{", PROBE + "IPU_VERTEX\n{"), ran_no_planning),
    Change("kernel edit, mtime restored", _edit("ipubuild/kernels/gelu.c", "IPU_VERTEX\n{", PROBE + "IPU_VERTEX\n{",
                                                keep_mtime=True), clean_as="kernel code edit"),
    Change("kernel comment edit", _append("ipubuild/kernels/matmul.c", "/* a comment */\n"),
           ran_only("compile_kernels:", "compile_kernels_counted:", "build:")),
    Change("kernel estimator edit", _append("ipubuild/kernels/gelu_cycles.py", "\nPROBE = 3\n"), ran_planning),
    Change("kernel header edit", _append("ipubuild/kernels/ipu_kernel.h",
                                         "static inline int ipu_unused_probe(int x) { return x; }\n")),
    Change("CFLAGS change", _env(IPUBUILD_CFLAGS="-O1 -std=c11 -Wall -fPIC -shared")),
    Change("compiler wrapper edited, same --version", _wrapper_cc(WRAPPER.replace('"$@"', '-O0 "$@"'))),
    Change("target: search rounds", _edit(f"targets/{NAME}.toml", "rounds = 1", "rounds = 2")),
    Change("target: numerics gate", _append(f"targets/{NAME}.toml", "[numerics]\nmin_cosine = 0.995\n"),
           ran_only("check_numerics:", "build:")),
    Change("target: model width", _edit(f"targets/{NAME}.toml", "mlp = 128", "mlp = 192")),
    Change("target edit, mtime restored", _edit(f"targets/{NAME}.toml", "mlp = 128", "mlp = 192", keep_mtime=True),
           clean_as="target: model width"),
    Change("machine: sync cycles", _edit("ipubuild/machines/ipu21.toml", "sync_cycles = 600", "sync_cycles = 650"),
           ran_nothing_of("compile_kernels:")),
    Change("machine: code quantum", _edit("ipubuild/machines/ipu21.toml", "reservation_quantum = 4096",
                                          "reservation_quantum = 8192"), no_compile),
    Change("planner code edit", _append("ipubuild/compiler/planning/cost.py", "\nPROBE = 1\n")),
    Change("planner comment and docstring", _edit("ipubuild/compiler/planning/cost.py", '"""The cost model',
                                                  '# a comment\n"""The reworded cost model'), ran_nothing),
    Change("log.py comment", _append("ipubuild/engine/log.py", "# nothing to see\n"), ran_nothing),
    Change("cast policy code edit", _append("ipubuild/builtin/casts.py", "\nPROBE = 2\n")),
    Change("plugin installed", _plugin(True)),
    Change("locale and time zone", _env(LC_ALL="C", TZ="Asia/Tokyo"), ran_nothing),
    Change("every source touched", _touch_all, ran_nothing, clean_as="base"),
    Change("built from another directory", lambda tree, environ: environ, ran_nothing, clean_as="base",
           build_args=lambda tree: (tree.parent, ["-f", str(tree / "dodo.py"), "-d", str(tree.parent)])),
]


def _refs(tree: Path) -> dict[str, str]:
    root = tree / ".ipubuild" / "refs"
    return {str(p.relative_to(root)): p.read_text().strip() for p in root.rglob("*.ref")}


def _outputs(tree: Path) -> dict[str, bytes]:
    out = tree / "artifacts" / NAME
    return {n: (out / n).read_bytes() for n in (f"{NAME}.ipuexe", f"{NAME}.profile.json", f"{NAME}.verdict.json")}


def _source_tree(path: Path, code: Path) -> Path:
    tree = make_tree(path, {NAME: TEXT})
    copy_ipubuild(tree, source=code)
    return tree


def _clean_build(tmp_path: Path, code: Path, cc: Path, change: Change) -> tuple[dict, dict]:
    """The artifact digests and outputs of ``change`` built clean in a fresh tree."""
    clean = _source_tree(tmp_path / "clean" / "tree", code)
    cc.write_text(WRAPPER)
    ref = doit(clean, f"build:{NAME}", environ=change.apply(clean, _env_of(clean, cc)))
    assert ref.returncode == 0, ref.tail()
    return _refs(clean), _outputs(clean)


@pytest.fixture(scope="module")
def cc(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("bin") / "cc"
    path.write_text(WRAPPER)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return path


@pytest.fixture(autouse=True)
def restore_cc(cc):
    yield
    cc.write_text(WRAPPER)


def _env_of(tree: Path, cc: Path) -> dict:
    return env(tree, IPUBUILD_CC=str(cc))


@pytest.fixture(scope="module")
def built(tmp_path_factory, code, cc) -> Path:
    """One built tree."""
    base = tmp_path_factory.mktemp("base")
    tree = _source_tree(base / "tree", code)
    run = doit(tree, f"build:{NAME}", environ=_env_of(tree, cc))
    assert run.returncode == 0 and "numericalTest=PASS" in run.stdout, run.tail()
    CLEAN["base"] = (_refs(tree), _outputs(tree))
    return tree


@pytest.fixture(scope="module", autouse=True)
def table(request):
    yield
    if ROWS:
        tr = request.config.pluginmanager.get_plugin("terminalreporter")
        tr.write_line("")
        tr.write_line(f"{'change':<42} {'tasks run':>9}  verdict")
        for change, n, ran, verdict in ROWS:
            shown = ", ".join(t.split(":")[0] for t in ran if not t.startswith("build:"))
            tr.write_line(f"{change:<42} {n:>9}  {verdict}  {shown[:90]}")


@pytest.mark.slow
@pytest.mark.parametrize("change", CHANGES, ids=[c.id for c in CHANGES])
def test_incremental_build_equals_clean_build(tmp_path, built, code, cc, change):
    # incremental: a copy of the built tree (cache, refs and doit DB included), changed, rebuilt
    inc = tmp_path / "inc" / "tree"
    shutil.copytree(built.parent, inc.parent, symlinks=True)
    environ = change.apply(inc, _env_of(inc, cc))
    cwd, args = change.build_args(inc) if change.build_args else (inc, [])
    run = doit(cwd, *args, f"build:{NAME}", environ=environ)
    assert run.returncode == 0 and "numericalTest=" in run.stdout, run.tail()

    # clean: the same change on a fresh tree with an empty cache (built once for changes alike)
    clean_refs, clean_outputs = CLEAN.get(change.clean_as) or _clean_build(tmp_path, code, cc, change)
    if any(c.clean_as == change.id for c in CHANGES):
        CLEAN.setdefault(change.id, (clean_refs, clean_outputs))

    stale = sorted(a for a, d in clean_refs.items() if _refs(inc).get(a) != d)
    same = not stale and _outputs(inc) == clean_outputs
    ROWS.append((change.id, len([t for t in run.executed if not t.startswith("build:")]), run.executed,
                 "incremental == clean" if same else f"STALE: {stale[:4]}"))
    assert not stale, f"artifacts that differ from a clean build: {stale}\n{run.tail()}"
    assert _outputs(inc) == clean_outputs
    if change.expect:
        change.expect(run)


@pytest.mark.slow
def test_moved_tree_is_a_no_op(tmp_path, built, cc):
    moved = tmp_path / "moved" / "tree"
    shutil.copytree(built.parent, moved.parent, symlinks=True)
    run = doit(moved, f"build:{NAME}", environ=_env_of(moved, cc))
    assert run.returncode == 0 and "numericalTest=PASS" in run.stdout, run.tail()
    ROWS.append(("moved tree", len(run.executed), run.executed, "no-op" if not run.executed else "REBUILT"))
    assert run.executed == [], run.tail()
    assert re.search(r"^-- build:small", run.stdout, re.M)
