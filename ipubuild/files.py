"""Atomic file writes: a reader sees the old file or the new one, never a torn one.

The temporary file is renamed over the target; a process killed mid-write leaves at most a
stray ``.*.tmp``. (No fsync: the guarantee is against killed processes, which is what a build
meets; power loss is out of scope.)
"""
from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path


_UMASK = os.umask(0)
os.umask(_UMASK)


def write_atomic(path, data: bytes) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, 0o666 & ~_UMASK)   # as an ordinary file would be, not mkstemp's 0600
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def write_if_changed(path, data: bytes) -> bool:
    """Atomically write unless the file already holds exactly these bytes (keeps its mtime)."""
    path = Path(path)
    try:
        if path.read_bytes() == data:
            return False
    except OSError:
        pass
    write_atomic(path, data)
    return True
