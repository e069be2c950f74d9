"""Reliability of whole builds through doit (subprocesses): kill -9 at seeded random moments,
corrupt cache blobs, concurrent builds in one tree, reproducible packages across trees, and
kernel edits that fail to compile or compute the wrong numbers.

Each test uses a fresh tree with the small ViT of tests/buildtree.py (a clean build takes a few
seconds); one test builds the real ``targets/vit_fp8.toml`` twice.
"""
from __future__ import annotations

import hashlib
import os
import random
import re
import shutil
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
from buildtree import (
    PLANNING_TASKS,
    ROOT,
    assert_passed,
    copy_ipubuild,
    doit,
    env,
    make_tree,
    package,
    start,
)

from ipubuild.engine.store import Store

NAME = "small"


@pytest.fixture(scope="module")
def environ(code) -> dict:
    return env(code)


@pytest.fixture(scope="module")
def reference(tmp_path_factory, environ) -> bytes:
    """The small target's package from one clean build in its own tree."""
    tree = make_tree(tmp_path_factory.mktemp("reference"))
    run = doit(tree, f"build:{NAME}", environ=environ)
    assert_passed(run, NAME)
    return package(tree, NAME)


def store_problems(tree: Path) -> list[str]:
    """Every cache entry of the tree that does not verify: blobs (evictable or pinned) whose
    bytes do not match their digest (Store.get drops them and returns None), action records or
    provenance whose checksum fails, and action records naming an output blob the store does not
    hold."""
    store = Store(tree / ".ipubuild" / "cache")
    problems = []
    try:
        keys = list(store.blobs.iterkeys())
        for key in keys:
            if store.get(key) is None:
                problems.append(f"blob {key} is corrupt or unreadable")
        held = set(store.blobs.iterkeys())
        for key in list(store.meta.iterkeys()):
            if key.startswith("pin:"):     # a pinned blob, not a record
                if store.get(key[4:]) is None:
                    problems.append(f"pinned blob {key} is corrupt")
                held.add(key[4:])
                continue
            record = store._get_record(key)
            if record is None:
                problems.append(f"record {key} is corrupt")
            elif key.startswith("ac:"):
                missing = sorted(set(record.values()) - held)
                if missing:
                    problems.append(f"action {key[:20]} names missing blobs {[d[:16] for d in missing]}")
    finally:
        store.close()
    return problems


def _kill_group(p: subprocess.Popen) -> bool:
    """SIGKILL the process group of ``p`` if it is still running; True if it was."""
    running = p.poll() is None
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    p.wait(timeout=60)
    return running


# --- 1. kill -9 at seeded random moments --------------------------------------------------------

@pytest.mark.parametrize("seed", [1, 2, 3])
def test_sigkill_at_random_moment_then_rebuild_gives_the_clean_package(tmp_path, environ, reference, seed):
    tree = make_tree(tmp_path / "tree")
    delay = random.Random(seed).uniform(0.3, 3.0)
    p = start(tree, f"build:{NAME}", log=tmp_path / "killed.log", environ=environ)
    time.sleep(delay)
    killed = _kill_group(p)
    killed_log = (tmp_path / "killed.log").read_text()

    run = doit(tree, f"build:{NAME}", environ=environ)
    assert_passed(run, NAME)
    assert package(tree, NAME) == reference, f"killed={killed} after {delay:.2f} s"
    assert store_problems(tree) == [], f"killed={killed} after {delay:.2f} s:\n{killed_log[-2000:]}"
    # and the tree is settled: nothing but the closing task runs again
    again = doit(tree, f"build:{NAME}", environ=environ)
    assert again.returncode == 0, again.tail()
    assert again.executed == [], again.tail()


# --- 2. a corrupt cache blob ---------------------------------------------------------------------

CAS = Path(".ipubuild") / "cache" / "cas"


def _blob_rows(tree: Path) -> dict[str, str | None]:
    """{digest: file name under cas/, or None for a blob held in cache.db} for every blob."""
    db = sqlite3.connect(tree / CAS / "cache.db")
    try:
        return dict(db.execute("select key, filename from Cache").fetchall())
    finally:
        db.close()


def _produced(tree: Path) -> set[str]:
    """The digests of blobs some phase produced (those with a provenance record), but not those
    it only passed through (read_machine's output is its input file's bytes: a source, which
    provenance cannot rebuild)."""
    store = Store(tree / ".ipubuild" / "cache")
    try:
        digests = [k[len("prov:"):] for k in store.meta.iterkeys() if k.startswith("prov:")]
        return {d for d in digests if any(d not in r.get("inputs", {}).values() for r in store.get_provenance(d))}
    finally:
        store.close()


def _flip_pinned(tree: Path, key: str, rng: random.Random) -> None:
    """Flip one bit of the pinned copy of blob ``key`` (a row of the never-evicted store)."""
    db = sqlite3.connect(tree / ".ipubuild" / "cache" / "actions" / "cache.db")
    try:
        (value,) = db.execute("select value from Cache where key = ?", ("pin:" + key,)).fetchone()
        data = bytearray(value)
        data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
        db.execute("update Cache set value = ? where key = ?", (bytes(data), "pin:" + key))
        db.commit()
    finally:
        db.close()


def _flip(tree: Path, key: str, rng: random.Random) -> None:
    """Flip one bit of the stored bytes of blob ``key``, a ``*.val`` file or a cache.db row."""
    filename = _blob_rows(tree)[key]
    if filename:
        path = tree / CAS / filename
        data = bytearray(path.read_bytes())
        data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
        path.write_bytes(bytes(data))
        return
    db = sqlite3.connect(tree / CAS / "cache.db")
    try:
        (value,) = db.execute("select value from Cache where key = ?", (key,)).fetchone()
        data = bytearray(value)
        data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
        db.execute("update Cache set value = ? where key = ?", (bytes(data), key))
        db.commit()
    finally:
        db.close()


def _pick(tree: Path, where: str, rng: random.Random) -> str:
    """A seeded random produced blob: a ``*.val`` file (``file``), a cache.db row (``row``), or
    the package itself (``package``, which every rebuild reads back)."""
    if where == "package":
        return (tree / ".ipubuild" / "refs" / NAME / "package.ref").read_text().strip()
    rows, produced = _blob_rows(tree), _produced(tree)
    keys = sorted(k for k, f in rows.items() if k in produced and bool(f) == (where == "file"))
    assert keys, f"no produced blob is stored as a {where}"
    return rng.choice(keys)


FETCH = """
import hashlib
import sys
import ipubuild.build.build  # registers the phases
from ipubuild.build.pipeline import Workspace
ws = Workspace(".")
data = ws.engine.fetch(sys.argv[1])
ws.store.close()
print("fetched", hashlib.sha256(data).hexdigest())
"""


def _fetch(tree: Path, digest: str, environ: dict) -> subprocess.CompletedProcess:
    """Fetch a blob through the engine in a fresh process (rebuilding it from its provenance)."""
    return subprocess.run([sys.executable, "-c", FETCH, digest], cwd=tree, env=environ, capture_output=True,
                          text=True, timeout=300, check=False)


@pytest.mark.parametrize("where,seed", [("file", 1), ("file", 2), ("row", 3), ("package", 4)])
def test_flipped_byte_in_a_cache_blob_is_dropped_and_rebuilt(tmp_path, environ, reference, where, seed):
    tree = make_tree(tmp_path / "tree")
    assert_passed(doit(tree, f"build:{NAME}", environ=environ), NAME)
    rng = random.Random(seed)
    key = _pick(tree, where, rng)
    _flip(tree, key, rng)
    shutil.rmtree(tree / "artifacts")
    (tree / ".doit.db").unlink()

    run = doit(tree, f"build:{NAME}", environ=environ)
    assert_passed(run, NAME)
    assert package(tree, NAME) == reference
    logged = run.output
    if where == "package":
        assert "dropped corrupt cache blob" in logged and "rebuilding missing cache blob" in logged, run.tail()
    if "dropped corrupt cache blob" not in logged:
        # The rebuild hit the action cache everywhere and never read this blob (only the
        # package, profile, trace, verdict and cost are read back). It is still there, corrupt:
        # the next read must drop it and rebuild it from its provenance.
        fetched = _fetch(tree, key, environ)
        assert fetched.returncode == 0, fetched.stdout + fetched.stderr
        assert fetched.stdout.split() == ["fetched", key], fetched.stdout + fetched.stderr
        logged += fetched.stderr
        assert "rebuilding missing cache blob" in logged
    assert f"dropped corrupt cache blob digest={key[:16]}" in logged
    assert store_problems(tree) == []


def test_corrupt_source_blob_is_replaced_from_the_source_file(tmp_path, code, environ, reference):
    tree = make_tree(tmp_path / "tree")
    assert_passed(doit(tree, f"build:{NAME}", environ=environ), NAME)
    source = (code / "ipubuild" / "kernels" / "matmul.c").read_bytes()
    key = hashlib.sha256(source).hexdigest()
    assert key not in _blob_rows(tree) and key not in _produced(tree)   # sources are pinned
    _flip_pinned(tree, key, random.Random(5))
    # other compiler flags: every kernel compiles again and reads its source blob
    flags = dict(environ, IPUBUILD_CFLAGS="-O1 -std=c11 -Wall -fPIC -shared")
    run = doit(tree, f"build:{NAME}", environ=flags)
    assert_passed(run, NAME)


# --- 3. two builds at once in one tree ----------------------------------------------------------

@pytest.mark.parametrize("offset", [0.0, 0.8])
def test_two_concurrent_builds_in_one_tree(tmp_path, environ, reference, offset):
    tree = make_tree(tmp_path / "tree")
    a = start(tree, f"build:{NAME}", log=tmp_path / "a.log", environ=environ)
    time.sleep(offset)
    b = start(tree, f"build:{NAME}", log=tmp_path / "b.log", environ=environ)
    try:
        ra, rb = a.wait(timeout=300), b.wait(timeout=300)
    finally:
        for p in (a, b):
            _kill_group(p)
    logs = {n: (tmp_path / f"{n}.log").read_text() for n in "ab"}
    for n, rc in (("a", ra), ("b", rb)):
        assert rc == 0, f"build {n} exited {rc}\n{logs[n][-3000:]}"
        assert "numericalTest=PASS" in logs[n] and "Traceback" not in logs[n], logs[n][-3000:]
    # the runs overlapped: one of them waited for the tree's build lock
    assert any("waiting for another build in this tree" in text for text in logs.values())
    assert package(tree, NAME) == reference

    db = sqlite3.connect(tree / ".doit.db")
    try:
        assert db.execute("pragma integrity_check").fetchone() == ("ok",)
        (count,) = db.execute("select count(*) from doit").fetchone()
    finally:
        db.close()
    assert count > 0
    third = doit(tree, f"build:{NAME}", environ=environ)
    assert third.returncode == 0, third.tail()
    assert third.executed == [], third.tail()
    assert store_problems(tree) == []


# --- 4. reproducible packages of the real target ------------------------------------------------

def test_two_clean_builds_of_vit_fp8_in_two_trees_are_byte_identical(tmp_path, environ):
    text = (ROOT / "targets" / "vit_fp8.toml").read_text()
    trees = [make_tree(tmp_path / n, {"vit_fp8": text}) for n in ("one", "two")]
    # both at once: two cores, and the two trees must not disturb each other
    procs = [start(t, "build:vit_fp8", log=t / "build.log", environ=environ) for t in trees]
    try:
        codes = [p.wait(timeout=600) for p in procs]
    finally:
        for p in procs:
            _kill_group(p)
    for t, rc in zip(trees, codes):
        out = (t / "build.log").read_text()
        assert rc == 0 and "numericalTest=PASS" in out and "Traceback" not in out, out[-3000:]
    one, two = (package(t, "vit_fp8") for t in trees)
    assert one == two
    assert (trees[0] / "artifacts/vit_fp8/vit_fp8.profile.json").read_bytes() == \
        (trees[1] / "artifacts/vit_fp8/vit_fp8.profile.json").read_bytes()


# --- 5./6. kernel edits in a tree-local copy of ipubuild ----------------------------------------

def local_tree(path: Path, code: Path) -> tuple[Path, dict]:
    """A small tree with its own copy of ipubuild/ (of the module's snapshot), imported first by
    doit in it."""
    tree = make_tree(path)
    copy_ipubuild(tree, source=code)
    environ = env(tree)
    where = subprocess.run([sys.executable, "-c", "import ipubuild; print(ipubuild.__file__)"], cwd=tree,
                           env=environ, capture_output=True, text=True, check=True).stdout.strip()
    assert Path(where).resolve() == (tree / "ipubuild" / "__init__.py").resolve(), where
    return tree, environ


def test_kernel_compile_error_is_one_line_and_keeps_the_cache(tmp_path, code):
    tree, environ = local_tree(tmp_path / "tree", code)
    assert_passed(doit(tree, f"build:{NAME}", environ=environ), NAME)
    good = package(tree, NAME)
    src = tree / "ipubuild" / "kernels" / "matmul.c"
    original = src.read_bytes()
    src.write_bytes(original + b"\nint broken( {\n")

    bad = doit(tree, f"build:{NAME}", environ=environ)
    assert bad.returncode != 0, bad.tail()
    assert "Traceback" not in bad.output, bad.tail()
    assert len(bad.error_lines) == 1, bad.tail()
    line = bad.error_lines[0]
    assert line.startswith("error: kernel matmul_") and "matmul.c" in line and "compile failed" in line, line
    # the compiler's own diagnostics, naming the source as the user knows it
    assert "ipubuild/kernels/matmul.c:" in bad.stderr and "error" in bad.stderr, bad.tail()
    # once for the source, naming the variants that share it (not once per variant, unnamed)
    heads = re.findall(r"^kernel (.+) \(ipubuild/kernels/matmul\.c\): compiler diagnostics:$", bad.stderr, re.M)
    assert len(heads) == 1 and len(heads[0].split(", ")) >= 2, bad.stderr
    assert bad.stderr.count("int broken( {") == 1, bad.stderr
    assert not any(t.startswith(PLANNING_TASKS) for t in bad.executed), bad.executed

    src.write_bytes(original)
    fixed = doit(tree, f"build:{NAME}", environ=environ)
    assert_passed(fixed, NAME)
    ran = fixed.executed
    assert not [t for t in ran if t.split(":")[0] in PLANNING_TASKS], ran
    assert set(ran) <= {f"build:{NAME}", f"compile_kernels:{NAME}", f"compile_kernels_counted:{NAME}"}, ran
    assert package(tree, NAME) == good
    assert store_problems(tree) == []


def test_wrong_kernel_fails_the_numerical_test(tmp_path, code):
    tree, environ = local_tree(tmp_path / "tree", code)
    src = tree / "ipubuild" / "kernels" / "ipu_kernel.h"       # ipu_gelu, which gelu.c calls
    original = src.read_text()
    # 0.5*x*(1 + tanh(...)) -> 0.5*x*(1 - tanh(...)): valid C, wrong GELU (milder bugs: see
    # test_numerics_mutations.py)
    assert original.count("(1.0f + tanhf") == 1
    src.write_text(original.replace("(1.0f + tanhf", "(1.0f - tanhf"))

    run = doit(tree, f"build:{NAME}", environ=environ)
    assert run.returncode != 0, run.tail()
    assert "numericalTest=FAIL" in run.stdout, run.tail()
    assert "Traceback" not in run.output, run.tail()
    assert len(run.error_lines) == 1, run.tail()
    line = run.error_lines[0]
    assert line.startswith(f"error: targets/{NAME}.toml: numerics:"), line
    assert "operation block0.gelu (gelu) diverges first" in line and "computed by kernel gelu_f32_fp8" in line, line

    # a failed check is not remembered as a pass
    again = doit(tree, f"build:{NAME}", environ=environ)
    assert again.returncode != 0 and "numericalTest=FAIL" in again.stdout, again.tail()
    assert again.executed == [f"build:{NAME}"], again.tail()   # only the verdict, which fails again

    # the right kernel again: no planning phase re-runs, and the numbers pass
    src.write_text(original)
    fixed = doit(tree, f"build:{NAME}", environ=environ)
    assert_passed(fixed, NAME)
    assert not [t for t in fixed.executed if t.split(":")[0] in PLANNING_TASKS], fixed.executed
