"""Tests for the content-addressed store (ipubuild/store.py): blobs, checksummed records,
verification on read, raw (unpickled) storage and concurrent writers."""

from __future__ import annotations

import hashlib
import multiprocessing
import os
import re
import sqlite3
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ipubuild.engine import canonical
from ipubuild.engine.store import Store, cache_dir

BIG = 100 * 1024  # > diskcache's 32 KiB min_file_size: stored as a file cas/**/*.val


@pytest.fixture
def store(tmp_path):
    s = Store(tmp_path / "cache")
    yield s
    s.close()


def _val_files(root: Path) -> list[Path]:
    return sorted(root.rglob("*.val"))


# --- blobs ------------------------------------------------------------------------------------

def test_put_get_round_trip_small_and_large(store):
    small, large = b"hello, tile", bytes(range(256)) * (BIG // 256 + 1)
    ks, kl = store.put(small), store.put(large)
    assert store.get(ks) == small
    assert store.get(kl) == large
    assert isinstance(store.get(ks), bytes)


def test_keys_are_sha256_hex(store):
    data = b"\x00\x01 some bytes \xff"
    key = store.put(data)
    assert re.fullmatch(r"[0-9a-f]{64}", key)
    assert key == hashlib.sha256(data).hexdigest()


def test_put_is_idempotent_and_content_addressed(store):
    a = store.put(b"same")
    b = store.put(bytearray(b"same"))
    assert a == b
    assert store.get(a) == b"same"
    assert store.put(b"other") != a
    assert len(store.blobs) == 2


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.binary(max_size=2048))
def test_round_trip_property(store, data):
    key = store.put(data)
    assert key == canonical.digest(data)
    assert store.get(key) == data


def test_unknown_key_reads_none(store):
    assert store.get("0" * 64) is None
    assert store.get_action("0" * 64) is None
    assert store.get_provenance("0" * 64) == []


def test_corrupt_blob_file_reads_none_warns_and_is_dropped(store, tmp_path, capsys):
    data = os.urandom(BIG)
    key = store.put(data)
    (val,) = _val_files(tmp_path / "cache" / "cas")
    raw = bytearray(val.read_bytes())
    assert bytes(raw) == data  # stored raw in the file
    raw[BIG // 2] ^= 0xFF
    val.write_bytes(bytes(raw))

    assert store.get(key) is None
    err = capsys.readouterr().err
    assert "WARN" in err and "corrupt cache blob" in err and key[:16] in err
    # dropped: the entry is gone, its file removed, and a second read is silent
    assert key not in store.blobs
    assert not val.exists()
    assert store.get(key) is None
    assert "corrupt" not in capsys.readouterr().err
    # and a fresh put restores it
    assert store.put(data) == key
    assert store.get(key) == data


def test_corrupt_small_blob_in_sqlite_is_dropped(store, tmp_path, capsys):
    key = store.put(b"small value kept inside sqlite")
    con = sqlite3.connect(tmp_path / "cache" / "cas" / "cache.db")
    with con:
        n = con.execute("UPDATE Cache SET value = ? WHERE key = ?",
                        (sqlite3.Binary(b"small value kept inside sqlitX"), key)).rowcount
    con.close()
    assert n == 1
    assert store.get(key) is None
    assert "corrupt cache blob" in capsys.readouterr().err
    assert key not in store.blobs


def test_missing_blob_file_reads_none(store, tmp_path):
    key = store.put(os.urandom(BIG))
    (val,) = _val_files(tmp_path / "cache" / "cas")
    val.unlink()
    assert store.get(key) is None


def test_missing_blob_file_can_be_restored_by_put(store, tmp_path):
    data = os.urandom(BIG)
    key = store.put(data)
    (val,) = _val_files(tmp_path / "cache" / "cas")
    val.unlink()
    assert store.get(key) is None
    store.put(data)
    assert store.get(key) == data


def test_drop_removes_blob(store):
    key = store.put(b"x" * 10)
    store.drop(key)
    assert store.get(key) is None
    store.drop(key)  # dropping twice is harmless


# --- checksummed records ----------------------------------------------------------------------

def test_action_and_provenance_round_trip(store):
    outs = {"b": "1" * 64, "a": "2" * 64}
    store.put_action("k" * 64, outs)
    assert store.get_action("k" * 64) == outs
    prov = {"phase": "p", "inputs": {"x": "3" * 64}, "config": {"a.b": 1}, "output": "a"}
    store.add_provenance("d" * 64, prov)
    assert store.get_provenance("d" * 64) == [prov]
    # action records and provenance live in different namespaces
    assert store.get_provenance("k" * 64) == []
    assert store.get_action("d" * 64) is None


def test_provenance_keeps_every_producer_newest_first(store):
    """Identical bytes can come from several phases (an optimisation that changed nothing
    outputs its input): every producer is kept, so a rebuild can pick one that does not need
    the blob itself."""
    store.add_provenance("d" * 64, {"phase": "first"})
    store.add_provenance("d" * 64, {"phase": "second"})
    store.add_provenance("d" * 64, {"phase": "first"})
    assert store.get_provenance("d" * 64) == [{"phase": "first"}, {"phase": "second"}]
    for i in range(10):
        store.add_provenance("d" * 64, {"phase": f"p{i}"})
    assert len(store.get_provenance("d" * 64)) == 4


def test_pinned_blobs_survive_eviction_and_heal(store):
    key = store.put(b"a source file", pin=True)
    store.drop(key)                               # as eviction would
    assert store.get(key) == b"a source file"
    raw = store.meta.get("pin:" + key)
    store.meta.set("pin:" + key, raw[:-1] + b"X")  # corrupt the pinned copy
    assert store.get(key) is None
    assert store.put(b"a source file", pin=True) == key
    assert store.get(key) == b"a source file"


@pytest.mark.parametrize("where", ["checksum", "payload", "truncated"])
def test_corrupt_action_record_is_dropped(store, capsys, where):
    store.put_action("a" * 64, {"out": "f" * 64})
    raw = bytearray(store.meta.get("ac:" + "a" * 64))
    assert raw[:64] == canonical.digest(bytes(raw[64:])).encode()
    if where == "checksum":
        raw[3] = ord("0") if raw[3] != ord("0") else ord("1")
    elif where == "payload":
        raw[-3] ^= 0x01
    else:
        raw = raw[:-5]
    store.meta.set("ac:" + "a" * 64, bytes(raw))
    assert store.get_action("a" * 64) is None
    assert "corrupt cache record" in capsys.readouterr().err
    assert "ac:" + "a" * 64 not in store.meta
    assert store.get_action("a" * 64) is None


def test_corrupt_provenance_record_is_dropped(store, capsys):
    store.add_provenance("d" * 64, {"phase": "p"})
    raw = bytearray(store.meta.get("prov:" + "d" * 64))
    raw[70] ^= 0x20
    store.meta.set("prov:" + "d" * 64, bytes(raw))
    assert store.get_provenance("d" * 64) == []
    assert "corrupt cache record" in capsys.readouterr().err


# --- raw storage ------------------------------------------------------------------------------

def _all_bytes(root: Path) -> bytes:
    return b"".join(p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file())


def test_a_large_blob_is_written_in_chunks_not_line_by_line(store, monkeypatch):
    """diskcache writes a bytes value line by line (one write per newline byte): a planning
    artifact of int32 arrays has millions. The store hands it a reader instead."""
    import builtins
    import diskcache.core
    writes = []

    class Counted:
        def __init__(self, f):
            self.f = f

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

        def write(self, chunk):
            writes.append(len(chunk))
            return self.f.write(chunk)

    monkeypatch.setattr(diskcache.core, "open", lambda *a, **k: Counted(builtins.open(*a, **k)), raising=False)
    data = b"\n" * (1 << 20)
    key = store.put(data)
    pinned = store.put(data + b"pinned", pin=True)
    monkeypatch.undo()
    assert len(writes) == 2 and sum(writes) == 2 * len(data) + 6
    assert store.get(key) == data and store.get(pinned) == data + b"pinned"


def test_a_pinned_blob_is_read_back_once_a_process(store, monkeypatch):
    """A search puts the same sub-phase inputs for every candidate: the stored copy is checked
    the first time, not read and hashed again each time."""
    key = store.put(b"a phase's transfers", pin=True)
    fresh = Store(store.root)
    reads = []
    real = fresh._read
    monkeypatch.setattr(fresh, "_read", lambda name, k: reads.append(k) or real(name, k))
    for _ in range(3):
        assert fresh.put(b"a phase's transfers", pin=True) == key
    assert reads == ["pin:" + key] and fresh.holds_pinned(key)
    fresh.close()


def test_values_are_stored_raw_not_pickled(store, tmp_path):
    marker = b"RAW-MARKER-\x00\x01-" + os.urandom(8).hex().encode()
    small_key = store.put(marker)
    big = marker * (BIG // len(marker) + 1)
    store.put(big)
    outs = {"slot": small_key}
    store.put_action("e" * 64, outs)
    store.add_provenance(small_key, {"phase": "raw-phase-marker"})

    # greppable on disk (the sqlite db and its WAL, and the .val file)
    blob = _all_bytes(tmp_path / "cache" / "cas")
    assert marker in blob
    assert big in blob
    meta = _all_bytes(tmp_path / "cache" / "actions")
    assert canonical.dumps(outs) in meta
    assert b"raw-phase-marker" in meta

    # and in the database: every row is raw bytes (diskcache MODE_RAW=1 / MODE_BINARY=2),
    # never MODE_PICKLE=4, with hex digests as plain text keys
    for sub in ("cas", "actions"):
        con = sqlite3.connect(tmp_path / "cache" / sub / "cache.db")
        rows = con.execute("SELECT key, raw, mode, filename, value FROM Cache").fetchall()
        con.close()
        assert rows
        for key, raw, mode, filename, value in rows:
            assert isinstance(key, str) and raw == 1, (sub, key)
            assert mode in (1, 2), (sub, key, mode)
            if mode == 1:
                assert isinstance(value, bytes) and not value.startswith(b"\x80")
            else:
                assert filename and (tmp_path / "cache" / sub / filename).read_bytes() == big
    con = sqlite3.connect(tmp_path / "cache" / "cas" / "cache.db")
    assert con.execute("SELECT value FROM Cache WHERE key=?", (small_key,)).fetchone()[0] == marker
    con.close()


def test_cache_dir_env_override(tmp_path, monkeypatch):
    monkeypatch.delenv("IPUBUILD_CACHE_DIR", raising=False)
    assert cache_dir(tmp_path) == tmp_path / ".ipubuild" / "cache"
    monkeypatch.setenv("IPUBUILD_CACHE_DIR", str(tmp_path / "elsewhere"))
    assert cache_dir(tmp_path) == tmp_path / "elsewhere"


# --- concurrency ------------------------------------------------------------------------------

N_WORKERS, N_ITEMS = 4, 200


def _blob(worker: int, i: int) -> bytes:
    base = f"worker={worker} item={i} ".encode()
    # every 25th blob is big enough to be a file; the rest live in sqlite
    return base * (BIG // len(base) + 1) if i % 25 == 0 else base * (1 + i % 7)


def _writer(root: str, worker: int, start) -> None:
    start.wait(10)
    s = Store(Path(root))
    try:
        for i in range(N_ITEMS):
            d = s.put(_blob(worker, i))
            s.put_action(f"{worker}-{i}".rjust(64, "0"), {"out": d, "i": i})
            s.add_provenance(d, {"phase": f"w{worker}", "i": i})
            s.put(b"shared blob written by everyone")
    finally:
        s.close()


def test_concurrent_writers_processes(tmp_path):
    ctx = multiprocessing.get_context("fork")
    root = tmp_path / "cache"
    Store(root).close()  # create the databases first
    start = ctx.Event()
    procs = [ctx.Process(target=_writer, args=(str(root), w, start)) for w in range(N_WORKERS)]
    for p in procs:
        p.start()
    start.set()
    for p in procs:
        p.join(60)
    assert [p.exitcode for p in procs] == [0] * N_WORKERS

    s = Store(root)
    try:
        seen = set()
        for w in range(N_WORKERS):
            for i in range(N_ITEMS):
                data = _blob(w, i)
                d = canonical.digest(data)
                assert s.get(d) == data, (w, i)
                assert s.get_action(f"{w}-{i}".rjust(64, "0")) == {"out": d, "i": i}
                assert s.get_provenance(d) == [{"phase": f"w{w}", "i": i}]
                seen.add(d)
        assert len(seen) == N_WORKERS * N_ITEMS
        assert s.get(canonical.digest(b"shared blob written by everyone")) is not None
        assert len(s.blobs) == N_WORKERS * N_ITEMS + 1
    finally:
        s.close()


@pytest.mark.parametrize("code", [8, 14])   # SQLITE_READONLY, SQLITE_CANTOPEN
def test_a_writable_cache_that_sqlite_briefly_calls_read_only_keeps_what_is_written(
        tmp_path, monkeypatch, code):
    """Under load, a process opening the index while others set it up can be told "read-only"
    or "cannot open" (CI saw it): the folder is writable, so the store waits and opens it for
    writing instead of keeping this build's results in memory and losing them."""
    import diskcache
    root = tmp_path / "cache"
    Store(root).close()
    real, refusals = diskcache.Cache, []

    def flaky(*args, **kwargs):
        if len(refusals) < 2:
            exc = sqlite3.OperationalError("attempt to write a readonly database")
            exc.sqlite_errorcode = code
            refusals.append(exc)
            raise exc
        return real(*args, **kwargs)

    monkeypatch.setattr(diskcache, "Cache", flaky)
    s = Store(root)
    key = s.put(b"kept across processes")
    s.close()
    assert len(refusals) == 2
    monkeypatch.setattr(diskcache, "Cache", real)
    again = Store(root)
    try:
        assert again.get(key) == b"kept across processes"
    finally:
        again.close()


# ---------------------------------------------------------------- batches of writes

def test_threads_opening_an_empty_index_share_one_handle(tmp_path):
    """Two threads that both find an index unopened get the same handle, also when it holds
    nothing yet (an empty diskcache is falsy): a second handle on one index does not see the
    first one's open batch, and a phase's writes then waited for its own batch to end."""
    import threading
    store = Store(tmp_path / "cache")
    got = []
    with store._open_lock:              # both threads pass the first look before either opens it
        threads = [threading.Thread(target=lambda: got.append(store.meta)) for _ in range(2)]
        for t in threads:
            t.start()
        threading.Event().wait(0.3)
    for t in threads:
        t.join(10)
    assert len(got) == 2 and got[0] is got[1] and len(got[0]) == 0
    store.close()


def test_a_batch_commits_each_index_once(store):
    """A phase's outputs, their provenance and its action record are written in one transaction
    per index (``Store.batch``), not one per write; nested batches join it."""
    statements = []
    for cache in (store.blobs, store.meta):
        cache._con.set_trace_callback(statements.append)
    with store.batch():
        with store.batch():
            digests = [store.put(os.urandom(n)) for n in (10, 50_000, 100_000)]
        for d in digests:
            store.add_provenance(d, {"phase": "p", "output": d[:4]})
        store.put_action("k" * 64, {"out": digests[0]})
    assert [s for s in statements if s in ("BEGIN IMMEDIATE", "COMMIT")] == ["BEGIN IMMEDIATE"] * 2 + ["COMMIT"] * 2
    assert all(store.get(d) is not None for d in digests) and store.get_action("k" * 64) == {"out": digests[0]}
    assert store.get_provenance(digests[2]) == [{"phase": "p", "output": digests[2][:4]}]


def test_a_failed_batch_records_nothing(store):
    """A write that fails inside a batch leaves no action record and no provenance behind."""
    d = store.put(b"before")
    with pytest.raises(RuntimeError):
        with store.batch():
            store.add_provenance(d, {"phase": "p"})
            store.put_action("a" * 64, {"out": d})
            raise RuntimeError("the disk filled up")
    assert store.get_action("a" * 64) is None and store.get_provenance(d) == []
    assert store.get(d) == b"before"
