"""Test helper: compile ipubuild C kernels and run them on a numpy tile memory.

Each kernel variant is compiled with ``cc -O2 -shared -fPIC -std=c11 -D...``
into a temporary directory and called through ctypes:

    int ipu_vertex(uint8_t *mem, const uint32_t *args);

``mem`` is a numpy uint8 array standing in for the tile SRAM; addresses in
``args`` are byte offsets into it.
"""

from __future__ import annotations

import ctypes
import os
import subprocess
import tempfile
from pathlib import Path

import numpy as np

KERNEL_DIR = Path(__file__).resolve().parent.parent / "ipubuild" / "kernels"
CFLAGS = ["-O2", "-Wall", "-Werror", "-shared", "-fPIC", "-std=c11"]

IPU_F32, IPU_F16, IPU_F143, IPU_F152 = 0, 1, 2, 3
TYPE_CODES = {"f32": IPU_F32, "f16": IPU_F16, "f143": IPU_F143, "f152": IPU_F152}

TILE_BYTES = 0xE8000
DATA_BASE = 0x4C000


def compile_kernel(name: str, out_dir: str | os.PathLike, defines: dict | None = None) -> Path:
    """Compile ``ipubuild/kernels/<name>.c`` with the given -D defines; return the .so path."""
    defines = dict(defines or {})
    tag = "_".join(f"{k}{v}" for k, v in sorted(defines.items()))
    out = Path(out_dir) / f"{name}{'_' + tag if tag else ''}.so"
    cmd = ["cc", *CFLAGS, *[f"-D{k}={v}" for k, v in sorted(defines.items())],
           "-o", str(out), str(KERNEL_DIR / f"{name}.c"), "-lm"]
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    return out


class Kernel:
    """A loaded kernel shared object."""

    def __init__(self, path: Path):
        self.path = path
        self._lib = ctypes.CDLL(str(path))
        self._fn = self._lib.ipu_vertex
        self._fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
        self._fn.restype = ctypes.c_int

    def __call__(self, tile: "TileMemory", args) -> int:
        a = np.ascontiguousarray(np.asarray(args, dtype=np.int64).astype(np.uint32))
        return int(self._fn(tile.mem.ctypes.data, a.ctypes.data))

    # the checked build (-DIPU_CHECKED=1) -----------------------------------------------------
    def set_tile(self, tile_bytes: int, map_address: int = 0) -> None:
        """What a device tells a checked build when it loads it: the tile memory's size and the
        address of the tile's data map (0: none)."""
        ctypes.c_uint32.in_dll(self._lib, "ipu_tile_bytes").value = tile_bytes
        ctypes.c_uint32.in_dll(self._lib, "ipu_tile_map").value = map_address

    def reason(self) -> str | None:
        """Why the last failing call on this thread failed (a checked build), once."""
        fn = self._lib.ipu_trap_reason
        fn.restype = ctypes.c_char_p
        out = fn()
        return out.decode() if out else None


class KernelCache:
    """Compiles each (kernel, defines) variant once."""

    def __init__(self, out_dir: str | os.PathLike | None = None):
        self.out_dir = Path(out_dir or tempfile.mkdtemp(prefix="ipukern_"))
        self._cache: dict = {}

    def get(self, name: str, **defines) -> Kernel:
        key = (name, tuple(sorted(defines.items())))
        if key not in self._cache:
            self._cache[key] = Kernel(compile_kernel(name, self.out_dir, defines))
        return self._cache[key]


class TileMemory:
    """A 0xE8000-byte uint8 tile memory with a bump allocator from 0x4C000."""

    def __init__(self, size: int = TILE_BYTES, base: int = DATA_BASE, fill: int = 0xA5):
        self.mem = np.full(size, fill, dtype=np.uint8)
        self._next = base

    def alloc(self, nbytes: int, align: int = 4, offset: int = 0) -> int:
        """Reserve ``nbytes``; ``offset`` lets tests force misaligned addresses."""
        addr = (self._next + align - 1) // align * align + offset
        self._next = addr + max(int(nbytes), 1)
        assert self._next <= self.mem.size, "tile memory exhausted"
        return addr

    def write(self, addr: int, arr: np.ndarray) -> int:
        raw = np.ascontiguousarray(arr).view(np.uint8).reshape(-1)
        self.mem[addr:addr + raw.size] = raw
        return addr

    def put(self, arr: np.ndarray, align: int = 4, offset: int = 0) -> int:
        """Allocate space for ``arr`` and copy it in; returns its address."""
        arr = np.ascontiguousarray(arr)
        return self.write(self.alloc(arr.nbytes, align, offset), arr)

    def read(self, addr: int, dtype, shape) -> np.ndarray:
        dtype = np.dtype(dtype)
        n = int(np.prod(shape)) * dtype.itemsize
        return self.mem[addr:addr + n].copy().view(dtype).reshape(shape)


def f32_bits(x: float) -> int:
    return int(np.array(x, dtype=np.float32).view(np.uint32))
