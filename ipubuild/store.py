"""The content-addressed store: blobs by sha256, an action cache, and the provenance of blobs.

Blobs live in one diskcache (size-limited, evicted least-recently-stored); action records,
provenance and *pinned* blobs (sources and other inputs no phase can rebuild) in another, never
evicted, so an evicted blob can always be rebuilt by re-running the action that produced it. Values are raw bytes (never pickled) and keys hex
digests. Every read is verified: a blob whose digest does not match, or an action record whose
checksum does not, is dropped with a warning and reported as missing, never returned.
"""
from __future__ import annotations

import importlib
import os
from pathlib import Path

import diskcache

from . import canonical
from .log import log

DEFAULT_SIZE_LIMIT = 4 * 2**30


def cache_dir(project_root: Path) -> Path:
    """Where the cache lives: ``$IPUBUILD_CACHE_DIR`` or ``<project>/.ipubuild/cache``."""
    return Path(os.environ.get("IPUBUILD_CACHE_DIR") or project_root / ".ipubuild" / "cache")


def size_limit() -> int:
    """The blob store's size limit in bytes: ``$IPUBUILD_CACHE_SIZE`` (default 4 GiB)."""
    raw = os.environ.get("IPUBUILD_CACHE_SIZE") or str(DEFAULT_SIZE_LIMIT)
    try:
        return int(raw)
    except ValueError:
        from .errors import UserError
        raise UserError("IPUBUILD_CACHE_SIZE", f"expected a number of bytes, got {raw!r}") from None


class Store:
    """Blobs, action records and provenance on disk; safe across threads and processes."""

    def __init__(self, root: Path, size_limit: int = DEFAULT_SIZE_LIMIT):
        self.root = Path(root)
        self.blobs = diskcache.Cache(str(self.root / "cas"), size_limit=size_limit,
                                     eviction_policy="least-recently-stored")
        self.meta = diskcache.Cache(str(self.root / "actions"), size_limit=2**62,
                                    eviction_policy="none")
        # [remote tier] None unless $IPUBUILD_REMOTE_CACHE is set (and only then imported). Imported
        # by name: it only moves verified bytes, so its code stays out of the phases' fingerprints.
        self.remote = (importlib.import_module("ipubuild.remote").from_environment()
                       if os.environ.get("IPUBUILD_REMOTE_CACHE", "").strip() else None)

    # blobs ---------------------------------------------------------------------------------
    def put(self, data: bytes, *, pin: bool = False) -> str:
        """Store a blob (idempotent) and return its digest. A *pinned* blob — one no phase can
        rebuild, such as a source file or a sub-phase's input — goes to the never-evicted store,
        and a corrupt stored copy of it is replaced."""
        key = canonical.digest(data)
        if pin:
            if self._get_pinned(key) is None:
                self.meta.set("pin:" + key, bytes(data))
                if self.remote is not None:                      # [remote tier] write behind
                    self.remote.put_blob(key, data)
        elif key not in self.blobs:
            self.blobs.set(key, bytes(data))
            if self.remote is not None:                          # [remote tier] write behind
                self.remote.put_blob(key, data)
        return key

    def _get_pinned(self, key: str) -> bytes | None:
        try:
            data = self.meta.get("pin:" + key)
        except OSError:
            data = None
        if data is not None and canonical.digest(data) != key:
            log.warning(f"dropped corrupt pinned blob digest={key[:16]}")
            self.meta.delete("pin:" + key)
            return None
        return data

    def get(self, key: str) -> bytes | None:
        """The verified blob for a digest, or None if it is missing or was corrupt (then dropped)."""
        data = self._get_local(key)
        if data is None and self.remote is not None:             # [remote tier] read through
            data = self.remote.get_blob(key)                     # verified
            if data is not None:
                self.blobs.set(key, data)
        return data

    def _get_local(self, key: str) -> bytes | None:
        try:
            data = self.blobs.get(key)
        except OSError:
            data = None
        if data is None:
            if key in self.blobs:      # its file is gone but its row is not: forget it
                self.blobs.delete(key)
            return self._get_pinned(key)
        if canonical.digest(data) != key:
            log.warning(f"dropped corrupt cache blob digest={key[:16]}; it will be rebuilt")
            self.blobs.delete(key)
            return None
        return data

    def drop(self, key: str) -> None:
        self.blobs.delete(key)

    # checksummed records ------------------------------------------------------------------
    def _put_record(self, key: str, value) -> None:
        payload = canonical.dumps(value)
        self.meta.set(key, canonical.digest(payload).encode() + payload)

    def _get_record(self, key: str):
        try:
            raw = self.meta.get(key)
        except OSError:
            raw = None
        if raw is None:
            return None
        check, payload = raw[:64], raw[64:]
        if canonical.digest(payload).encode() != check:
            log.warning(f"dropped corrupt cache record key={key[:24]}")
            self.meta.delete(key)
            return None
        return canonical.loads(payload)

    def get_action(self, action_key: str) -> dict | None:
        """The output digests recorded for an action key, or None."""
        record = self._get_record("ac:" + action_key)
        if self.remote is not None:                              # [remote tier] read through
            found = self.remote.get_action(action_key, local_hit=record is not None)   # verified
            if found is not None:    # the record, and how to rebuild each output (kept first)
                record, provenance = found
                for digest, prov in provenance.items():
                    self._put_record("prov:" + digest, prov)
                self._put_record("ac:" + action_key, record)
        return record

    def put_action(self, action_key: str, outputs: dict) -> None:
        self._put_record("ac:" + action_key, outputs)
        if self.remote is not None:                              # [remote tier] write behind, with
            self.remote.put_action(action_key, outputs,         # how to rebuild its outputs
                                   {d: self.get_provenance(d) for d in outputs.values()})

    def get_provenance(self, digest: str) -> dict | None:
        """How a blob was made: the phase, its input digests and configuration, the output slot."""
        return self._get_record("prov:" + digest)

    def put_provenance(self, digest: str, record: dict) -> None:
        """Record how a blob was made (the latest maker wins: its inputs are the freshest)."""
        self._put_record("prov:" + digest, record)

    def close(self) -> None:
        if self.remote is not None:                              # [remote tier] bounded flush
            self.remote.close()
        self.blobs.close()
        self.meta.close()
