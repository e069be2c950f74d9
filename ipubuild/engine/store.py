"""The content-addressed store: blobs by sha256, an action cache, and the provenance of blobs.

Blobs live in one diskcache (``cas/``: size-limited, least-recently-*used* eviction); action
records, provenance and *pinned* blobs (sources and other inputs no phase can rebuild) in another
(``actions/``), never evicted, so an evicted blob can always be rebuilt by re-running an action
that produced it. Values are raw bytes (never pickled) and keys hex digests. Every read is
verified: a blob whose digest does not match, or a record whose checksum does not, is dropped with
a warning and reported as missing, never returned.

Eviction never happens in the middle of a build: the blob store is opened with diskcache's
automatic culling off, and a build trims it to its size limit when it ends (``Store.trim``), so a
blob a running build has read or written stays until it is done.

The store heals its own damage: a diskcache index that SQLite reports as corrupt is moved aside
(``cas.corrupt-<time>``) and recreated, with one warning — everything in it can be rebuilt. A
full file system stops the build with one line naming the folder and the fix; a read-only one
(a shared cache mounted read-only) serves what it holds, and what the build makes is kept in
memory for that build only (``ReadOnlyCache``), with one warning.
"""
from __future__ import annotations

import contextlib
import errno
import importlib
import io
import os
import sqlite3
import threading
import time
import uuid
from pathlib import Path

from . import canonical
from .errors import UserError
from .files import storage_error, write_atomic
from .log import log
from .readonly_cache import ReadOnlyCache
from .registry import SHARED_TIER

DEFAULT_SIZE_LIMIT = 4 * 2**30
PROVENANCE_KEPT = 4          # producers remembered per blob (newest first)
_origin = threading.local()  # .remote: whether this thread's last action record came from the shared tier

# SQLite's primary result codes (sqlite3.Error.sqlite_errorcode & 0xFF)
_SQLITE_READONLY, _SQLITE_CORRUPT, _SQLITE_CANTOPEN, _SQLITE_FULL, _SQLITE_NOTADB = 8, 11, 14, 13, 26


def cache_dir(project_root: Path) -> Path:
    """Where the cache lives: ``$IPUBUILD_CACHE_DIR`` or ``<project>/.ipubuild/cache``."""
    return Path(os.environ.get("IPUBUILD_CACHE_DIR") or Path(project_root) / ".ipubuild" / "cache")


def size_limit() -> int:
    """The blob store's size limit in bytes: ``$IPUBUILD_CACHE_SIZE`` (default 4 GiB)."""
    raw = os.environ.get("IPUBUILD_CACHE_SIZE") or str(DEFAULT_SIZE_LIMIT)
    try:
        return int(raw)
    except ValueError:
        raise UserError("IPUBUILD_CACHE_SIZE", f"expected a number of bytes, got {raw!r}") from None


def cache_identity(root: Path, *, create: bool = True) -> str | None:
    """The cache directory's identity: a random id written when the cache is first used. Build
    tasks carry it in their up-to-date signature, so a deleted, replaced or re-pointed cache makes
    every task run again (and find or rebuild its results there) instead of trusting references to
    blobs the cache no longer has."""
    path = Path(root) / "id"
    try:
        text = path.read_text().strip()
        if len(text) == 32:
            return text
    except OSError:
        pass
    if not create:
        return None
    ident = uuid.uuid4().hex
    try:
        write_atomic(path, ident.encode() + b"\n")
    except UserError:
        return None   # a read-only or full cache folder: reported when a build writes to it
    return ident


def _read_only(path: Path) -> bool:
    """Whether a cache folder exists but may not be written (a read-only mount, or permissions)."""
    db = path / "cache.db"
    writable = os.access(path, os.W_OK) and (not db.exists() or os.access(db, os.W_OK))
    return path.is_dir() and not writable


def _set(cache, key: str, data: bytes) -> None:
    """``cache.set(key, data)``, a large blob written in chunks: diskcache writes a ``bytes``
    value by iterating ``io.BytesIO(value)``, that is line by line, one ``write`` per newline
    byte (4.5 M writes for one ViT-B/16 candidate's blobs: int32 arrays hold many 0x0A bytes).
    Given a reader it writes 4 MiB at a time, into the same kind of file, read back the same way."""
    if isinstance(cache, ReadOnlyCache) or len(data) < cache.disk.min_file_size:
        cache.set(key, bytes(data))
    else:
        cache.set(key, io.BytesIO(data), read=True)


def _is_read_only_error(exc: Exception) -> bool:
    code = (getattr(exc, "sqlite_errorcode", None) or 0) & 0xFF
    return code in (_SQLITE_READONLY, _SQLITE_CANTOPEN) or getattr(exc, "errno", None) in (
        errno.EROFS, errno.EACCES, errno.EPERM)


_read_only_said = False
_OPEN_ATTEMPTS = 8      # about 2.5 s of waiting in all for a transient "read-only" index


class Store:
    """Blobs, action records and provenance on disk; safe across threads and processes.

    The diskcache databases are opened on first use, so a build that finds everything up to
    date never opens them.
    """

    def __init__(self, root: Path, size_limit: int = DEFAULT_SIZE_LIMIT):
        self.root = Path(root)
        self.size_limit = size_limit
        self._caches: dict[str, object] = {}
        self._open_lock = threading.RLock()
        self._pinned: set[str] = set()       # pinned blobs this process wrote or found whole
        # the shared tier (ipubuild.remote), if $IPUBUILD_REMOTE_CACHE is set; imported by name,
        # and only then: it only moves verified bytes, so its code stays out of the phases'
        # fingerprints
        self.remote = (importlib.import_module(SHARED_TIER).from_environment()
                       if os.environ.get("IPUBUILD_REMOTE_CACHE", "").strip() else None)

    # opening and healing ------------------------------------------------------------------------
    def _cache(self, name: str):
        cache = self._caches.get(name)
        if cache is None:
            with self._open_lock:
                # ``is None``, not ``or``: an empty diskcache is falsy, and a second object on the
                # same index would not see the first one's open transaction (``batch``)
                cache = self._caches.get(name)
                if cache is None:
                    cache = self._caches[name] = self._open(name)
        return cache

    def _open(self, name: str):
        import diskcache
        path = self.root / name
        if name == "cas":
            settings = dict(size_limit=self.size_limit, eviction_policy="least-recently-used", cull_limit=0)
        else:
            settings = dict(size_limit=2**62, eviction_policy="none", cull_limit=0)
        if _read_only(path):
            return self._open_read_only(name)
        healed = False
        for attempt in range(_OPEN_ATTEMPTS):
            try:
                return diskcache.Cache(str(path), **settings)
            except (sqlite3.DatabaseError, OSError) as exc:
                if not healed and self._heal(name, exc):
                    healed = True
                    continue
                if _is_read_only_error(exc):
                    # sqlite says read-only or cannot-open of an index in a folder that may be
                    # written: another process may be setting up the index or its WAL files (seen
                    # with concurrent openers under load); try again for a while before keeping
                    # this build's writes in memory only
                    if (isinstance(exc, sqlite3.DatabaseError) and not _read_only(path)
                            and attempt + 1 < _OPEN_ATTEMPTS):
                        time.sleep(0.02 * 2 ** attempt)
                        continue
                    return self._open_read_only(name)
                raise self._error(name, exc) from None

    def _open_read_only(self, name: str):
        """A read-only folder: read what it holds, keep this build's writes in memory (one
        warning per process)."""
        path = self.root / name
        try:
            cache = ReadOnlyCache(path)
        except FileNotFoundError:
            raise UserError(f"cache {path}", "is read-only and holds no cache yet; make it writable or "
                            "point IPUBUILD_CACHE_DIR at a writable folder") from None
        except (sqlite3.DatabaseError, OSError) as exc:
            raise self._error(name, exc) from None
        global _read_only_said
        if not _read_only_said:
            _read_only_said = True
            log.warning(f"cache {self.root} is read-only: this build restores what it holds and "
                        "keeps nothing new (point IPUBUILD_CACHE_DIR at a writable folder to keep "
                        "results)")
        return cache

    @property
    def blobs(self):
        return self._cache("cas")

    @property
    def meta(self):
        return self._cache("actions")

    def _call(self, name: str, fn):
        """Run ``fn(cache)`` on one of the two caches, healing a corrupt index once."""
        for attempt in (1, 2):
            cache = self._cache(name)
            try:
                return fn(cache)
            except (sqlite3.DatabaseError, OSError) as exc:
                if attempt == 1 and self._heal(name, exc):
                    continue
                raise self._error(name, exc) from None

    @property
    def inline_max(self) -> int:
        """Blobs of this many bytes or more are files of their own (diskcache's
        ``min_file_size``); smaller ones are rows of the index."""
        disk = getattr(self.blobs, "disk", None)
        return getattr(disk, "min_file_size", 0)

    @contextlib.contextmanager
    def batch(self):
        """This thread's writes inside the block committed together: one transaction per index
        (the blobs', then the records', always in that order, so two batches never wait on each
        other in a circle) instead of one per write. A phase's small outputs, their provenance
        and its action record are written as one batch: on vit_fp8 a candidate's store writes
        took ~20 ms of its ~73, most of it one commit per small record. Other writers (and
        readers of blobs, which record each access) wait while a batch is open, so a batch holds
        only small writes, never a phase's work nor a blob of ``inline_max`` bytes or more;
        nested batches join the outer one; a failure rolls the records back."""
        with contextlib.ExitStack() as stack:
            for name in ("cas", "actions"):
                cache = self._cache(name)
                if hasattr(cache, "transact"):       # a read-only cache keeps writes in memory
                    stack.enter_context(self._transaction(name, cache))
            yield

    @contextlib.contextmanager
    def _transaction(self, name: str, cache):
        try:
            with cache.transact():
                yield
        except (sqlite3.DatabaseError, OSError) as exc:      # beginning or committing it
            raise self._error(name, exc) from None

    def _heal(self, name: str, exc: Exception) -> bool:
        """Move a corrupt cache index aside (with one warning) so that it is recreated."""
        code = getattr(exc, "sqlite_errorcode", None)
        if code is None or code & 0xFF not in (_SQLITE_CORRUPT, _SQLITE_NOTADB):
            return False
        with self._open_lock:
            if name == "actions":
                self._pinned.clear()        # the new index holds none of them
            cache = self._caches.pop(name, None)
            if cache is not None:
                with contextlib.suppress(Exception):
                    cache.close()
            path = self.root / name
            aside = path.with_name(f"{name}.corrupt-{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}")
            try:
                os.replace(path, aside)
            except OSError:
                return False
        log.warning("moved a damaged cache index aside and started a new one; its results will be "
                    "rebuilt", damaged=aside, error=f'"{exc}"')
        return True

    def _error(self, name: str, exc: Exception) -> Exception:
        path = self.root / name
        code = (getattr(exc, "sqlite_errorcode", None) or 0) & 0xFF
        if code == _SQLITE_FULL or getattr(exc, "errno", None) in (errno.ENOSPC, errno.EDQUOT):
            return UserError(f"cache {path}", "the disk is full; free some space or point "
                             "IPUBUILD_CACHE_DIR at another disk, then build again (nothing was half-written)")
        if _is_read_only_error(exc):
            return UserError(f"cache {path}", "is read-only and this build must write to it; make it "
                             "writable or point IPUBUILD_CACHE_DIR at a writable folder")
        if isinstance(exc, OSError):
            return storage_error(path, exc)
        return exc

    # blobs ---------------------------------------------------------------------------------
    def put(self, data: bytes, *, pin: bool = False) -> str:
        """Store a blob (idempotent) and return its digest. A *pinned* blob — one no phase can
        rebuild, such as a source file or a sub-phase's input — goes to the never-evicted store,
        and a corrupt stored copy of it is replaced (the stored copy is checked the first time
        this process puts it; a copy that goes bad later is dropped when read, as any blob)."""
        key = canonical.digest(data)
        if pin:
            # checked once a process: a search puts every exchange phase's transfers again for
            # each candidate (a gigabyte on ViT-B/16), read back and hashed each time before
            if key in self._pinned:
                return key
            if self._get_pinned(key) is not None:
                self._pinned.add(key)
                return key
            self._call("actions", lambda c: _set(c, "pin:" + key, data))
            self._pinned.add(key)
        elif not self._call("cas", lambda c: key in c):
            self._call("cas", lambda c: _set(c, key, data))
        else:
            return key
        if self.remote is not None:          # new here: written behind to the shared tier
            self.remote.put_blob(key, data)
        return key

    def holds_pinned(self, key: str) -> bool:
        """Whether this process wrote the pinned blob ``key`` here, or found it whole (without
        reading it: a caller may skip putting it again)."""
        return key in self._pinned

    def _get_pinned(self, key: str) -> bytes | None:
        data = self._read("actions", "pin:" + key)
        if data is not None and canonical.digest(data) != key:
            log.warning(f"dropped corrupt pinned blob digest={key[:16]}")
            self._pinned.discard(key)
            self._call("actions", lambda c: c.delete("pin:" + key))
            return None
        return data

    def _read(self, name: str, key: str):
        def read(cache):
            try:
                return cache.get(key)
            except OSError as exc:
                if exc.errno in (errno.ENOENT, errno.EISDIR):
                    return None   # its file is gone (or was never whole): a miss
                raise
        return self._call(name, read)

    def get(self, key: str) -> bytes | None:
        """The verified blob for a digest, or None if it is missing or was corrupt (then dropped);
        a local miss asks the shared tier, if any (its answer verified, and kept here)."""
        data = self._get_local(key)
        if data is None and self.remote is not None:
            data = self.remote.get_blob(key)
            if data is not None:
                self._call("cas", lambda c: _set(c, key, data))
        return data

    def _get_local(self, key: str) -> bytes | None:
        data = self._read("cas", key)
        if data is None:
            if self._call("cas", lambda c: key in c):   # its file is gone but its row is not
                self._call("cas", lambda c: c.delete(key))
            return self._get_pinned(key)
        if canonical.digest(data) != key:
            log.warning(f"dropped corrupt cache blob digest={key[:16]}; it will be rebuilt")
            self._call("cas", lambda c: c.delete(key))
            return None
        return data

    def has(self, key: str) -> bool:
        """Whether a blob is present (unverified: a cheap check before a rebuild decision)."""
        return self._call("cas", lambda c: key in c) or self._call("actions", lambda c: "pin:" + key in c)

    def drop(self, key: str) -> None:
        self._call("cas", lambda c: c.delete(key))

    def trim(self) -> None:
        """Evict least-recently-used blobs down to the size limit (a build calls it at its end)."""
        if "cas" in self._caches:
            self._call("cas", lambda c: c.cull())

    # checksummed records ------------------------------------------------------------------
    def _put_record(self, key: str, value) -> None:
        payload = canonical.dumps(value)
        self._call("actions", lambda c: c.set(key, canonical.digest(payload).encode() + payload))

    def _get_record(self, key: str):
        raw = self._read("actions", key)
        if raw is None:
            return None
        check, payload = raw[:64], raw[64:]
        if canonical.digest(payload).encode() != check:
            log.warning(f"dropped corrupt cache record key={key[:24]}")
            self._call("actions", lambda c: c.delete(key))
            return None
        return canonical.loads(payload)

    def get_action(self, action_key: str) -> dict | None:
        """The output digests recorded for an action key, or None (asking the shared tier, if any:
        its record comes with how to rebuild each output, kept first)."""
        record = self._get_record("ac:" + action_key)
        _origin.remote = False
        if self.remote is not None:
            found = self.remote.get_action(action_key, local_hit=record is not None)   # verified
            _origin.remote = found is not None
            if found is not None:
                record, provenance = found
                for digest, prov in provenance.items():
                    self._put_record("prov:" + digest, prov)
                self._put_record("ac:" + action_key, record)
        return record

    @staticmethod
    def last_hit_remote() -> bool:
        """Whether this thread's last ``get_action`` found its record in the shared tier."""
        return getattr(_origin, "remote", False)

    def put_action(self, action_key: str, outputs: dict) -> None:
        self._put_record("ac:" + action_key, outputs)
        if self.remote is not None:          # written behind, with how to rebuild its outputs
            self.remote.put_action(action_key, outputs, {d: self.get_provenance(d) for d in outputs.values()})

    def get_provenance(self, digest: str) -> list[dict]:
        """How a blob was made, newest first: each record names the phase, its input digests and
        configuration, and the output slot that held the blob."""
        found = self._get_record("prov:" + digest)
        if isinstance(found, dict):          # written by an older ipubuild: one record
            return [found]
        return found if isinstance(found, list) else []

    def add_provenance(self, digest: str, record: dict) -> None:
        """Remember one more way to make a blob (a few are kept: identical bytes can come from
        several phases, and rebuilding a blob must never need the blob itself)."""
        known = [r for r in self.get_provenance(digest) if r != record]
        self._put_record("prov:" + digest, [record, *known][:PROVENANCE_KEPT])

    def close(self) -> None:
        if self.remote is not None:          # a bounded flush of the uploads
            self.remote.close()
        with self._open_lock:
            for cache in self._caches.values():
                with contextlib.suppress(Exception):
                    cache.close()
            self._caches.clear()
