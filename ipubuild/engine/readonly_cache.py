"""A diskcache folder the build may read but not write: a shared cache mounted read-only.

diskcache cannot open such a folder (opening it writes its settings), so this reads its
``Cache`` table through SQLite's read-only mode and its value files directly. What the build
writes (new results, access times, the records a remote hit copies here) is kept in this
process only and never reaches the folder: the build restores what the cache holds and makes
the rest, and the next build makes the rest again.
"""
from __future__ import annotations

import sqlite3
import threading
import time
from pathlib import Path


class ReadOnlyCache:
    """The part of ``diskcache.Cache`` the store uses, over a folder it must not write."""

    def __init__(self, directory: Path):
        import diskcache
        self.directory = Path(directory)
        if not (self.directory / "cache.db").is_file():
            raise FileNotFoundError(f"{self.directory / 'cache.db'} does not exist")
        self._disk = diskcache.Disk(str(self.directory))
        self._local = threading.local()
        self._kept: dict[str, bytes] = {}       # written by this build, kept in memory only
        self._gone: set[str] = set()            # deleted by this build (a corrupt entry)
        self._lock = threading.Lock()
        self._params = "mode=ro"
        try:
            self._row(None)                      # fail now if the database cannot be read
        except sqlite3.OperationalError:
            # a WAL database whose shared-memory file is gone and cannot be made on a read-only
            # mount: SQLite reads it only as immutable (nobody writes it through this mount)
            self.close()
            self._params = "mode=ro&immutable=1"
            self._row(None)

    def _connection(self) -> sqlite3.Connection:
        con = getattr(self._local, "con", None)
        if con is None:
            uri = (self.directory / "cache.db").resolve().as_uri() + "?" + self._params
            con = self._local.con = sqlite3.connect(uri, uri=True, check_same_thread=False)
        return con

    def _row(self, key: str | None):
        return self._connection().execute(
            "SELECT mode, filename, value FROM Cache WHERE key = ? AND raw = 1 "
            "AND (expire_time IS NULL OR expire_time > ?)", (key, time.time())).fetchone()

    def get(self, key: str, default=None):
        with self._lock:
            if key in self._kept:
                return self._kept[key]
            if key in self._gone:
                return default
        row = self._row(key)
        if row is None:
            return default
        return self._disk.fetch(*row, read=False)     # an OSError if its file is gone

    def __contains__(self, key: str) -> bool:
        with self._lock:
            if key in self._kept:
                return True
            if key in self._gone:
                return False
        return self._row(key) is not None

    def set(self, key: str, value: bytes) -> bool:
        with self._lock:
            self._kept[key] = bytes(value)
            self._gone.discard(key)
        return True

    def delete(self, key: str) -> bool:
        with self._lock:
            self._kept.pop(key, None)
            self._gone.add(key)
        return True

    def cull(self) -> int:
        return 0

    def close(self) -> None:
        con = getattr(self._local, "con", None)
        if con is not None:
            con.close()
            self._local.con = None
