"""Never stuck, never wrong: damage to the cache, its references and databases, and storage
faults either heal on the next plain build (same package as a clean build) or stop with one line
naming the fix — never a traceback, never a request to delete ``.ipubuild`` by hand."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import uuid
from pathlib import Path

import pytest
from buildtree import SMALL, assert_passed, doit, make_tree, package, snapshot

from ipubuild.engine import canonical
from ipubuild.engine.engine import PHASES, Engine, phase
from ipubuild.engine.registry import load_phases
from ipubuild.engine.store import Store
from ipubuild.compiler.search import state_bytes

NAME = "small"
TEXT = SMALL.replace("rounds = 3", "rounds = 1")


@pytest.fixture(scope="module")
def environ(tmp_path_factory) -> dict:
    return snapshot(tmp_path_factory.mktemp("code"))


@pytest.fixture(scope="module")
def reference(tmp_path_factory, environ) -> bytes:
    tree = make_tree(tmp_path_factory.mktemp("reference"), {NAME: TEXT})
    assert_passed(doit(tree, f"build:{NAME}", environ=environ), NAME)
    return package(tree, NAME)


@pytest.fixture
def built(tmp_path, environ) -> Path:
    tree = make_tree(tmp_path / "tree", {NAME: TEXT})
    assert_passed(doit(tree, f"build:{NAME}", environ=environ), NAME)
    return tree


def heals(tree: Path, environ: dict, reference: bytes, *, says: str | None = None):
    run = doit(tree, f"build:{NAME}", environ=environ)
    assert_passed(run, NAME)
    assert package(tree, NAME) == reference
    if says:
        assert says in run.output, run.tail()
    settled = doit(tree, f"build:{NAME}", environ=environ)
    assert settled.returncode == 0 and settled.executed == [], settled.tail()
    return run


# --- provenance without cycles (engine) ---------------------------------------------------------

def test_a_blob_that_is_its_own_producers_input_is_rebuilt_by_its_first_producer(tmp_path):
    """``optimize`` outputs its input unchanged (as optimize_exchange_placement may): the blob
    then has two producers, one of which needs the blob itself. Rebuilding it must use the other,
    and must not recurse."""
    make, keep = f"make_{uuid.uuid4().hex[:6]}", f"keep_{uuid.uuid4().hex[:6]}"
    calls = []

    @phase(make, inputs=("seed",), outputs=("table",))
    def _make(ctx):
        calls.append(make)
        return {"table": ctx.bytes("seed") * 3}

    @phase(keep, inputs=("table",), outputs=("placed",))
    def _keep(ctx):
        calls.append(keep)
        return {"placed": ctx.bytes("table")}

    store = Store(tmp_path / "cache")
    try:
        eng = Engine(store)
        seed = store.put(b"xyz", pin=True)
        table = eng.run(make, {"seed": seed}, {}).outputs["table"]
        placed = eng.run(keep, {"table": table}, {}).outputs["placed"]
        assert placed == table and len(store.get_provenance(table)) == 2
        store.drop(table)
        assert Engine(store).fetch(placed) == b"xyzxyzxyz"
        assert calls == [make, keep, make]
    finally:
        store.close()
        PHASES.pop(make)
        PHASES.pop(keep)


# --- whole builds --------------------------------------------------------------------------------

def test_a_tiny_cache_still_builds(tmp_path, environ, reference):
    tree = make_tree(tmp_path / "tree", {NAME: TEXT})
    small = dict(environ, IPUBUILD_CACHE_SIZE="1000000")
    assert_passed(doit(tree, f"build:{NAME}", environ=small), NAME)
    assert package(tree, NAME) == reference
    # a change that needs results the tiny cache evicted after the first build
    (tree / "targets" / f"{NAME}.toml").write_text(TEXT + "[numerics]\nmin_cosine = 0.995\n")
    run = doit(tree, f"build:{NAME}", environ=small)
    assert_passed(run, NAME)
    assert package(tree, NAME) == reference


@pytest.mark.parametrize("damage", ["garbage", "empty", "deleted"])
def test_a_damaged_reference_is_remade(built, environ, reference, damage):
    for artifact in ("placed_exchanges", "graph"):
        ref = built / ".ipubuild" / "refs" / NAME / f"{artifact}.ref"
        if damage == "deleted":
            ref.unlink()
        else:
            ref.write_bytes(b"\x00garbage\xff" if damage == "garbage" else b"")
    heals(built, environ, reference)


def test_a_deleted_cache_is_rebuilt(built, environ, reference):
    shutil.rmtree(built / ".ipubuild" / "cache")
    heals(built, environ, reference)


def test_a_changed_cache_directory_is_filled(built, environ, reference, tmp_path):
    heals(built, dict(environ, IPUBUILD_CACHE_DIR=str(tmp_path / "elsewhere")), reference)


def test_lost_action_records_and_blobs_are_rebuilt(built, environ, reference):
    """The blob store emptied behind doit's back: refs point at blobs no provenance can rebuild
    from (their sources went too), so the steps that made them run again."""
    shutil.rmtree(built / ".ipubuild" / "cache" / "cas")
    shutil.rmtree(built / ".ipubuild" / "cache" / "actions")
    os.unlink(built / "artifacts" / NAME / f"{NAME}.ipuexe")
    heals(built, environ, reference)


@pytest.mark.parametrize("db", [".doit.db", ".ipubuild/cache/cas/cache.db", ".ipubuild/cache/actions/cache.db"])
def test_a_damaged_database_is_moved_aside(built, environ, reference, db):
    path = built / db
    path.write_bytes(b"this is not a database" * 100)
    # a build that must read the cache: a numerics gate changed, and the package file is gone
    (built / "targets" / f"{NAME}.toml").write_text(TEXT + "[numerics]\nmin_cosine = 0.995\n")
    (built / "artifacts" / NAME / f"{NAME}.ipuexe").unlink()
    run = heals(built, environ, reference, says="moved a damaged")
    assert list(path.parent.glob(f"{path.name.split('/')[-1]}.corrupt-*")) or \
        list(path.parent.parent.glob(f"{path.parent.name}.corrupt-*")), run.tail()
    if db != ".ipubuild/cache/actions/cache.db":
        # healed from the action cache, not by a cold rebuild: every phase the build ran is a
        # hit but those whose signature the gate edit moved (the README promises seconds)
        assert_from_the_action_cache(run, changed={"numerics.min_cosine"}, at_least=10 if db == ".doit.db" else 1)


def phase_runs(run) -> list[tuple[str, bool]]:
    """(phase, served by the action cache) of every phase a build ran, from its log."""
    return [(m.group(1), m.group(2) is not None) for m in re.finditer(
        r'package build phase finished phase="(\w+)"[^\n]*?( cached=true)?$', run.output, re.M)]


def assert_from_the_action_cache(run, changed: set[str], at_least: int) -> None:
    """Every phase ``run`` executed came from the action cache, except those declaring one of the
    configuration keys in ``changed``; and at least ``at_least`` did (the heal is not vacuous)."""
    load_phases()
    runs = phase_runs(run)
    moved = {n for n, ph in PHASES.items() if any(k == d or k.startswith(d + ".") for k in changed for d in ph.config)}
    cold = sorted({name for name, hit in runs if not hit} - moved)
    assert not cold, f"phases rebuilt cold instead of from the action cache: {cold}\n{run.tail()}"
    assert sum(hit for _, hit in runs) >= at_least, runs


def test_a_damaged_row_of_the_doit_database_is_moved_aside(built, environ, reference):
    """A row PRAGMA quick_check passes but doit cannot read (a 0xff byte: UnicodeDecodeError;
    bad JSON): the database is moved aside with one warning, the tasks come from the cache."""
    import sqlite3
    path = built / ".doit.db"
    con = sqlite3.connect(path)
    task = con.execute("select task_id from doit order by task_id limit 1").fetchone()[0]
    con.execute("update doit set task_data = cast(x'7b22ff22' as text) where task_id = ?", (task,))
    con.commit()
    assert con.execute("pragma quick_check").fetchone() == ("ok",)
    con.close()
    run = heals(built, environ, reference, says="moved a damaged doit database aside")
    assert run.output.count("moved a damaged doit database aside") == 1, run.tail()
    assert list(built.glob(".doit.db.corrupt-*")), run.tail()


def test_a_warm_tree_builds_without_its_compiler(tmp_path, environ):
    cc = tmp_path / "bin" / "cc"
    cc.parent.mkdir()
    cc.write_text('#!/bin/sh\nexec gcc "$@"\n')
    cc.chmod(0o755)
    with_cc = dict(environ, IPUBUILD_CC=str(cc))
    tree = make_tree(tmp_path / "tree", {NAME: TEXT})
    assert_passed(doit(tree, f"build:{NAME}", environ=with_cc), NAME)
    cc.unlink()                                   # the compiler is uninstalled
    run = doit(tree, f"build:{NAME}", environ=with_cc)
    assert run.returncode == 0 and "numericalTest=PASS" in run.stdout, run.tail()
    assert run.executed == [] and "Traceback" not in run.output, run.tail()
    # something that must compile now fails in one line naming the compiler
    bad = doit(tree, f"build:{NAME}", environ=dict(with_cc, IPUBUILD_CFLAGS="-O1 -std=c11 -fPIC -shared"))
    assert bad.returncode != 0 and "Traceback" not in bad.output, bad.tail()
    assert len(bad.error_lines) == 1 and str(cc) in bad.error_lines[0], bad.tail()


# --- storage faults --------------------------------------------------------------------------------

def _mount(*args) -> bool:
    return subprocess.run(["mount", *args], capture_output=True).returncode == 0


@pytest.fixture
def small_disk(tmp_path):
    where = tmp_path / "disk"
    where.mkdir()
    if os.geteuid() != 0 or not _mount("-t", "tmpfs", "-o", "size=2m", "tmpfs", str(where)):
        pytest.skip("needs permission to mount a small tmpfs (root with CAP_SYS_ADMIN)")
    yield where
    subprocess.run(["umount", "-l", str(where)], capture_output=True)


def test_a_full_disk_stops_with_one_line_every_time(tmp_path, environ, small_disk):
    tree = make_tree(tmp_path / "tree", {NAME: TEXT})
    full = dict(environ, IPUBUILD_CACHE_DIR=str(small_disk / "cache"))
    for attempt in (1, 2):
        run = doit(tree, f"build:{NAME}", environ=full)
        assert run.returncode != 0, run.tail()
        assert "Traceback" not in run.output, run.tail()
        assert len(run.error_lines) == 1, run.tail()
        assert "disk is full" in run.error_lines[0], run.error_lines[0]
    # room again: the same cache builds, with nothing half-written in it
    subprocess.run(["mount", "-o", "remount,size=256m", str(small_disk)], check=True)
    assert_passed(doit(tree, f"build:{NAME}", environ=full), NAME)


def _files(root: Path, but: tuple = ()) -> dict:
    """Every file under ``root`` and its bytes, but those whose names end with one of ``but``."""
    return {p.relative_to(root): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file() and not p.name.endswith(but)}


def test_the_read_only_reader_serves_what_diskcache_wrote_and_keeps_writes_in_memory(tmp_path):
    """``ReadOnlyCache`` over a folder diskcache wrote (small values in rows, large ones in files):
    the same bytes back, a miss for an unknown key, writes and deletes seen by this process only."""
    import diskcache

    from ipubuild.engine.readonly_cache import ReadOnlyCache
    small, large = b"x" * 100, os.urandom(3 * 2**20)
    with diskcache.Cache(str(tmp_path / "cas")) as c:
        c.set("a" * 64, small)
        c.set("b" * 64, large)
    # (SQLite's reader makes its -shm/-wal files where it may: not a write of the cache)
    before = _files(tmp_path / "cas", but=("-shm", "-wal"))
    ro = ReadOnlyCache(tmp_path / "cas")
    assert ro.get("a" * 64) == small and ro.get("b" * 64) == large and ro.get("c" * 64) is None
    ro.set("c" * 64, b"new")
    ro.delete("a" * 64)
    assert ro.get("c" * 64) == b"new" and "a" * 64 not in ro and "b" * 64 in ro
    ro.close()
    assert _files(tmp_path / "cas", but=("-shm", "-wal")) == before


def test_a_read_only_cache_restores_what_it_holds_and_builds_the_rest(tmp_path, environ, reference):
    tree = make_tree(tmp_path / "tree", {NAME: TEXT})
    assert_passed(doit(tree, f"build:{NAME}", environ=environ), NAME)
    cache = tree / ".ipubuild" / "cache"
    if os.geteuid() != 0 or not (_mount("--bind", str(cache), str(cache))
                                 and _mount("-o", "remount,ro,bind", str(cache))):
        pytest.skip("needs permission to bind-mount the cache read-only")
    try:
        held = _files(cache)
        noop = doit(tree, f"build:{NAME}", environ=environ)
        assert noop.returncode == 0 and noop.executed == [], noop.tail()
        # the workspace's artifacts lost: restored from the read-only cache, nothing re-made
        shutil.rmtree(tree / "artifacts")
        restored = doit(tree, f"build:{NAME}", environ=environ)
        assert_passed(restored, NAME)
        assert package(tree, NAME) == reference
        assert "cached=true" in restored.output and "cached=false" not in restored.output, restored.tail()
        said = [ln for ln in restored.output.splitlines() if "read-only" in ln]
        assert len(said) == 1 and str(cache) in said[0] and "IPUBUILD_CACHE_DIR" in said[0], said
        # a change: built here, kept out of the cache, with the same one line
        (tree / "targets" / f"{NAME}.toml").write_text(TEXT.replace("mlp = 128", "mlp = 96"))
        changed = doit(tree, f"build:{NAME}", environ=environ)
        assert_passed(changed, NAME)
        assert package(tree, NAME) != reference
        assert len([ln for ln in changed.output.splitlines() if "read-only" in ln]) == 1, changed.tail()
        assert _files(cache) == held
    finally:
        subprocess.run(["umount", "-l", str(cache)], capture_output=True)


# --- the search state -------------------------------------------------------------------------------

def _state(tree: Path) -> Path:
    return tree / ".ipubuild" / "search" / f"{NAME}.state.json"


def _resign(path: Path, state: dict) -> None:
    path.write_bytes(state_bytes(state))


def _saved(tree: Path) -> dict:
    return json.loads(_state(tree).read_bytes())["state"]      # plain JSON, its digest beside the state


def _flip_round(tree: Path) -> None:
    raw = _state(tree).read_bytes()
    _state(tree).write_bytes(raw.replace(b'"round":1', b'"round":3', 1))


def _bad_incumbent(tree: Path) -> None:
    state = _saved(tree)
    state["incumbent"]["ops"]["0"]["plan"] = 999
    _resign(_state(tree), state)


def _wrong_cycles(tree: Path) -> None:
    state = _saved(tree)
    state["cycles"] -= 1000
    _resign(_state(tree), state)


@pytest.mark.parametrize("tamper", [_flip_round, _bad_incumbent, _wrong_cycles],
                         ids=["flipped round", "re-signed bad incumbent", "re-signed wrong cycles"])
def test_a_tampered_search_state_never_changes_the_outcome(built, environ, reference, tamper):
    assert b'"round":1' in _state(built).read_bytes()
    saved = json.loads(_state(built).read_bytes())          # plain JSON, the digest beside the state
    assert set(saved) == {"sha256", "state"} and len(saved["sha256"]) == 64
    tamper(built)
    shutil.rmtree(built / ".ipubuild" / "cache")      # so that the search runs again
    run = heals(built, environ, reference)
    assert "ignored a search state" in run.output, run.tail()
