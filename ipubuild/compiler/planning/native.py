"""The planner's loops in C: sources in their modules (so that the code fingerprint of the phases
that run them covers them), compiled once per source and compiler by the system C compiler
(``ipubuild.kernels.compiler``: ``$IPUBUILD_CC``, ``$CC`` or ``cc``) into a private folder of the
user's temporary directory, and loaded with ctypes.

The loops are integer-only, so their results are the compiler's no more than Python's are; each
has a Python form it is tested equal to, which runs where no compiler works or where
``$IPUBUILD_NATIVE=0`` (or a loop's own switch) says so.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shlex
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

BACKGROUND_NICE = 10     # the compiler's niceness increment for a library made ahead of its use

_loaded: dict = {}
_compiling: dict[str, threading.Lock] = {}    # one compile of a library at a time in a process
os.register_at_fork(after_in_child=_compiling.clear)


def library(name: str, source: str, functions: dict, switch: str | None = None, nice: int = 0):
    """The library compiled from ``source`` with ``functions`` (``{name: (restype, argtypes)}``)
    typed, or None (no working compiler, or switched off). ``nice``: the compiler's niceness
    increment, if it must run (a library made ahead of its use, beside other work)."""
    if os.environ.get("IPUBUILD_NATIVE", "1") == "0" or (switch and os.environ.get(switch, "1") == "0"):
        return None
    if name not in _loaded:
        with _compiling.setdefault(name, threading.Lock()):
            if name not in _loaded:
                _loaded[name] = _typed(name, source, functions, nice)
    return _loaded[name]


def _typed(name: str, source: str, functions: dict, nice: int):
    try:
        lib = _compile(name, source, nice)
        for fn, (restype, argtypes) in functions.items():
            getattr(lib, fn).restype = restype
            getattr(lib, fn).argtypes = argtypes
        return lib
    except (OSError, subprocess.SubprocessError, ValueError, AttributeError):
        return None


def _compile(name: str, source: str, nice: int = 0):
    from ..kernels import compiler
    cc, cflags = compiler()
    raw = source.encode()
    version = _version(cc)
    key = hashlib.sha256(b"\0".join([raw, cc.encode(), cflags.encode(), version])).hexdigest()[:24]
    folder = Path(tempfile.gettempdir()) / f"ipubuild-native-{os.getuid()}"
    path = folder / f"{name}-{key}.so"
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    if folder.stat().st_uid != os.getuid():       # someone else's folder: not a library to load
        raise ValueError(f"{folder} belongs to another user")
    if not path.exists():
        tmp = folder / f".{path.name}.{os.getpid()}"
        src = folder / f".{name}-{key}.{os.getpid()}.c"
        src.write_bytes(raw)
        try:
            # niced by nice(1), not a preexec_fn: this may run on a thread beside others
            niced = ["nice", "-n", str(nice)] if nice and shutil.which("nice") else []
            subprocess.run([*niced, *shlex.split(cc), *shlex.split(cflags), "-fPIC", "-shared", "-o", str(tmp), str(src)],
                           check=True, capture_output=True, timeout=120)
            os.replace(tmp, path)
        finally:
            src.unlink(missing_ok=True)
    return ctypes.CDLL(str(path))


@functools.lru_cache(maxsize=8)
def _version(cc: str) -> bytes:
    """What ``cc --version`` prints (once a process: each library's key takes it)."""
    return subprocess.run([*shlex.split(cc), "--version"], capture_output=True, timeout=30).stdout
