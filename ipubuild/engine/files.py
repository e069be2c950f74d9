"""Files: atomic writes, content digests, and a memo of per-file facts keyed by a stat key.

An atomic write renames a temporary file over the target: a reader sees the old file or the new
one, never a torn one, and a process killed mid-write leaves at most a stray ``.*.tmp``. (No
fsync: the guarantee is against killed processes, which is what a build meets; power loss is out
of scope.)

A file's *stat key* is ``(size, mtime_ns, ctime_ns, inode)``. Tools that preserve an mtime
(``cp -p``, ``rsync -a``, ``tar x``) cannot preserve the ctime, and an atomic replacement changes
the inode, so a fact computed from a file's content may be trusted while its stat key is unchanged
(Bazel's digest cache does the same). Nothing here trusts the mtime alone.
"""
from __future__ import annotations

import contextlib
import errno
import functools
import hashlib
import json
import os
import tempfile
from pathlib import Path

from .errors import UserError

_UMASK = os.umask(0)
os.umask(_UMASK)


def write_atomic(path, data: bytes) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    except OSError as exc:
        raise storage_error(path, exc) from None
    try:
        os.fchmod(fd, 0o666 & ~_UMASK)   # as an ordinary file would be, not mkstemp's 0600
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException as exc:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        if isinstance(exc, OSError):
            raise storage_error(path, exc) from None
        raise


def storage_error(path, exc: OSError) -> Exception:
    """A one-line error for a write that the file system refused (full, read-only, denied);
    other OSErrors are returned unchanged."""
    if exc.errno == errno.ENOSPC or exc.errno == errno.EDQUOT:
        return UserError(str(path), "the disk is full; free some space (nothing was half-written) "
                         "and build again")
    if exc.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
        return UserError(str(path), f"cannot write here ({exc.strerror}); make it writable or build "
                         "in a writable copy of the tree")
    return exc


def write_if_changed(path, data: bytes) -> bool:
    """Atomically write unless the file already holds exactly these bytes (keeps its mtime)."""
    path = Path(path)
    try:
        if path.stat().st_size == len(data) and path.read_bytes() == data:
            return False
    except OSError:
        pass
    write_atomic(path, data)
    return True


def stat_key(st: os.stat_result) -> list[int]:
    """``[size, mtime_ns, ctime_ns, inode]``: changes whenever the file's content can have."""
    return [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino]


def stat_key_of(path) -> list[int] | None:
    try:
        return stat_key(os.stat(path))
    except OSError:
        return None


#: each source file as this process's steps read it: ``{real path: (stat key before the read,
#: sha256 of the bytes read)}``; doit records what a phase read, not the file's bytes at the end
_read: dict[str, tuple] = {}


def read_recorded(path) -> bytes:
    """A source file's bytes, remembered (``read_record``) as what this build read."""
    key = stat_key_of(path)
    data = Path(path).read_bytes()
    _read[os.path.realpath(path)] = (key, hashlib.sha256(data).hexdigest())
    return data


def read_record(path) -> tuple | None:
    """``(stat key before the read, digest read)`` of a source this process read, or None."""
    return _read.get(os.path.realpath(path)) if _read else None


def file_digest(path) -> str | None:
    """sha256 of a file's bytes, or None if it cannot be read."""
    try:
        with open(path, "rb") as f:
            return hashlib.file_digest(f, "sha256").hexdigest()
    except OSError:
        return None


class StatMemo:
    """Facts computed from files' contents (digests, parsed imports), remembered in a JSON file
    and trusted while the file's stat key is unchanged. Losing or corrupting the memo file costs
    a recomputation, never a wrong answer."""

    def __init__(self, path: Path | None):
        self.path = Path(path) if path else None
        self._entries: dict | None = None
        self._dirty = False
        self._unsettled: dict = {}      # facts about files too new to remember on disk: this process's

    def _load(self) -> dict:
        if self._entries is None:
            self._entries = {}
            if self.path is not None:
                try:
                    data = json.loads(self.path.read_bytes())
                    if isinstance(data, dict):
                        self._entries = data
                except (OSError, ValueError):
                    pass
        return self._entries

    def get(self, path, compute, kind: str = "sha256"):
        """``compute(path)`` for this file, memoised under ``kind`` by its stat key."""
        key = stat_key_of(path)
        if key is None:
            return compute(path)
        name = f"{kind}:{os.path.abspath(path)}"
        held = self._fact(name, key)
        if held is not None:
            return held
        value = compute(path)
        # a file modified within the clock's granularity of this read could change again under
        # the same mtime: only remember facts about files older than a second
        if value is not None and settled(key):
            self._load()[name] = [key, value]
            self._dirty = True
        return value

    def digest(self, path) -> str | None:
        return self.get(path, file_digest)

    def _fact(self, name: str, key):
        """The fact remembered under ``name`` (on disk, or this process's) for stat key ``key``,
        or None."""
        for hit in (self._load().get(name), self._unsettled.get(name)):
            if isinstance(hit, list) and len(hit) == 2 and hit[0] == key:
                return hit[1]
        return None

    def missing(self, paths, kind: str) -> list[tuple[str, list, int]]:
        """``[(path, stat key, when it was read)]`` of those of ``paths`` (each once) with no fact
        under ``kind`` for their current stat key: what ``remember`` takes back."""
        import time
        out, seen = [], set()
        for path in paths:
            name = f"{kind}:{os.path.abspath(path)}"
            key = stat_key_of(path)
            if key is not None and name not in seen and self._fact(name, key) is None:
                seen.add(name)
                out.append((path, key, time.time_ns()))
        return out

    def remember(self, path, key: list, read_at: int, value, kind: str) -> None:
        """Remember ``value``, computed from ``path`` after its stat key ``key`` was read at
        ``read_at`` (ns), as ``get`` would have; facts about a file changed within a second of
        that read are kept for this process only, as ``code_fingerprint``'s are."""
        if value is None:
            return
        name = f"{kind}:{os.path.abspath(path)}"
        if settled(key, read_at):
            self._load()[name] = [key, value]
            self._dirty = True
        else:
            self._unsettled[name] = [key, value]

    def save(self) -> None:
        if self._dirty and self.path is not None:
            with contextlib.suppress(OSError, UserError):
                write_atomic(self.path, json.dumps(self._entries, sort_keys=True).encode())
            self._dirty = False


@functools.lru_cache(maxsize=None)
def tree_memo(root) -> StatMemo:
    """The digests of a tree's output files (one memo per tree and process)."""
    return StatMemo(Path(root) / ".ipubuild" / "digests.json")


def settled(key: list[int], now: int | None = None) -> bool:
    """Whether a file of stat key ``key``, read at ``now`` (ns; by default, now), was last changed
    over a second before: a later change cannot then leave the same key."""
    import time
    return (time.time_ns() if now is None else now) - max(key[1], key[2]) > 1_000_000_000


def tree_path(path, root: Path) -> Path:
    """``path`` relative to ``root`` when it lies inside it, else absolute."""
    path = Path(path).resolve()
    try:
        return path.relative_to(root)
    except ValueError:
        return path
