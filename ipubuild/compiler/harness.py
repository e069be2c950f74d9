"""Kernels on numpy arrays, as a build compiles and a device calls them: the harness behind
``ipubuild.testing``'s kernel helpers and ``doit kernel:<variant>`` (the compiler layer: it
compiles with ``compiler.kernels`` and needs nothing of builds, devices or plugins)."""
from __future__ import annotations

import ctypes
import dataclasses
import tempfile
from pathlib import Path

import numpy as np

from ..engine.errors import UserError
from ..graph.operators import KernelVariant

#: ipu_kernel.h's type codes (the ``*_TYPE`` defines of the built-in kernels)
TYPE_CODES = {"f32": 0, "f16": 1, "f143": 2, "f152": 3}
#: numpy storage of each dtype (FP8 values are uint8 codes)
STORAGE = {"f32": np.float32, "f16": np.float16, "f143": np.uint8, "f152": np.uint8}


# kernels ---------------------------------------------------------------------------------------
class TileMemory:
    """A tile's SRAM as a numpy uint8 array (the machine description's size), filled with a
    pattern, with a bump allocator from the first SRAM address. Addresses are byte offsets."""

    def __init__(self, machine: str = "ipu21", fill: int = 0xA5):
        from .machine import load_machine
        mem = load_machine(machine)["memory"]
        self.mem = np.full(mem["sram_end"], fill, dtype=np.uint8)
        self.base = self._next = mem["sram_base"]

    def alloc(self, nbytes: int, align: int = 4, offset: int = 0) -> int:
        """Reserve ``nbytes``; ``offset`` misaligns the address on purpose (kernels must cope)."""
        addr = (self._next + align - 1) // align * align + offset
        if addr + max(int(nbytes), 1) > self.mem.size:
            raise MemoryError(f"tile memory exhausted: {nbytes} bytes at {addr:#x} of {self.mem.size:#x}")
        self._next = addr + max(int(nbytes), 1)
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
        dtype = np.dtype(STORAGE.get(dtype, dtype))
        n = int(np.prod(shape)) * dtype.itemsize
        return self.mem[addr:addr + n].copy().view(dtype).reshape(shape)


class Kernel:
    """A compiled kernel variant, loaded: ``kernel(tile, args) -> status`` calls
    ``int ipu_vertex(uint8_t *mem, const uint32_t *args)`` on ``tile``'s memory."""

    def __init__(self, path: Path, name: str = ""):
        self.path, self.name = Path(path), name or Path(path).stem
        self._lib = ctypes.CDLL(str(path))
        self._fn = self._lib.ipu_vertex
        self._fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
        self._fn.restype = ctypes.c_int

    def __call__(self, tile: TileMemory, args) -> int:
        a = np.ascontiguousarray(np.asarray([int(x) & 0xFFFFFFFF for x in args] or [0], dtype=np.uint32))
        return int(self._fn(tile.mem.ctypes.data, a.ctypes.data))

    # the checked build (``IPU_CHECKED=1``, as every build compiles kernels) ---------------------
    @property
    def checked(self) -> bool:
        """Whether this object is a checked build (it exports ``ipu_tile_bytes``, as a kernel
        including ``ipu_kernel.h`` compiled with ``-DIPU_CHECKED=1`` does)."""
        return hasattr(self._lib, "ipu_tile_bytes")

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


def compile_source(source, out_dir=None, defines=(), *, werror: bool = True, name: str = "") -> Path:
    """Compile one C kernel source (with ``-D`` ``defines``: a dict or ``(name, value)`` pairs)
    as ``compile_kernels`` does, into ``out_dir`` (default: a new temporary folder); return the
    shared object's path. A failure raises ``UserError`` naming the kernel, its first error
    line and, in ``diagnostics``, the compiler's whole output."""
    from .kernels import SOURCE_SUFFIXES, compile_kernel, compiler, header_sources, included, source_slot
    source = Path(source).resolve()
    defines = sorted(defines.items()) if isinstance(defines, dict) else sorted(tuple(d) for d in defines)
    slot = source_slot(source)
    folder_slot = slot.rpartition("/")[0]
    sources = {slot: f.read_bytes() for slot, f in header_sources().items()}    # ipu_kernel.h
    sources.update({f"{folder_slot}/{f.name}" if folder_slot else f.name: f.read_bytes()
                    for f in sorted(source.parent.iterdir()) if f.suffix in SOURCE_SUFFIXES and f.is_file()})
    headers = {h: sources[h] for h in included(slot, sources)}
    cc, cflags = compiler()
    if werror:
        cflags += " -Werror"
    name = name or source.stem + "".join(f"_{k}{v}" for k, v in defines)
    obj, _ = compile_kernel(name, source.name, source.read_bytes(), headers, defines, cc, cflags, slot, record=False)
    out = Path(out_dir or tempfile.mkdtemp(prefix="ipubuild-kernel-")) / f"{name}.so"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_bytes(obj)
    return out


_loaded: dict = {}


def load_variant(variant, out_dir=None, *, werror: bool = True, checked: bool = False) -> Kernel:
    """A kernel variant compiled and loaded (once per process for the same source, defines and
    flags): a :class:`ipubuild.operators.KernelVariant`, or the name of one some registered
    operator declares (built-in, installed or on ``$IPUBUILD_PLUGINS``). ``checked``: the
    checked build a device runs (``-DIPU_CHECKED=1``), told a whole tile (``set_tile``)."""
    if isinstance(variant, str):
        from ..graph.operators import registry
        kernels = registry().kernels
        if variant not in kernels:
            raise UserError(f"kernel variant {variant!r}", "no registered operator declares it; known: "
                            f"{', '.join(sorted(kernels))}")
        variant = kernels[variant]
    if not isinstance(variant, KernelVariant):
        raise TypeError(f"load_variant takes a KernelVariant or its name, not {type(variant).__name__}")
    from .kernels import CHECKED, compiler
    defines = (*variant.defines, CHECKED) if checked else tuple(variant.defines)
    key = (str(Path(variant.source).resolve()), defines, compiler(), werror, Path(variant.source).stat().st_mtime_ns)
    if key not in _loaded:
        path = compile_source(variant.source, out_dir, defines, werror=werror,
                              name=variant.name + ("_checked" if checked else ""))
        kernel = Kernel(path, variant.name)
        if checked:
            if not kernel.checked:
                raise UserError(f"kernel {variant.name} ({variant.source})", "is not a checked build: "
                                '#include "ipu_kernel.h" (installed with ipubuild) and check each buffer with '
                                "IPU_REQUIRE_BUFFER (docs/plugins.md, 'The kernel')")
            kernel.set_tile(TileMemory().mem.size)
        _loaded[key] = kernel
    return _loaded[key]


def compile_builtin(name: str, out_dir=None, defines=(), *, werror: bool = True) -> Path:
    """Compile the built-in kernel source ``ipubuild/kernels/<name>.c`` with ``defines``."""
    from .kernels import KERNEL_DIR
    return compile_source(KERNEL_DIR / f"{name}.c", out_dir, defines, werror=werror)


@dataclasses.dataclass
class VertexRun:
    """What :func:`run_vertex` gives: the kernel's return status (0: success), the written
    buffers as arrays, and the tile memory (to look further)."""
    status: int
    outputs: list
    tile: TileMemory


def run_vertex(kernel: Kernel, args: list, reads=(), writes=(), *, offset: int = 0,
               tile: TileMemory | None = None) -> VertexRun:
    """Run one vertex: place each array of ``reads`` in a tile memory (``offset`` bytes past
    an aligned address: a plain build must take unaligned data, a checked one refuses it), allocate each ``(shape, dtype)`` of
    ``writes``, resolve ``("r", i, byte_offset)`` / ``("w", i, byte_offset)`` arguments to their
    addresses (as ``Operator.lower``'s vertices give them) and call the kernel. A dtype is an
    ipubuild dtype name (``f32``, ``f16``, ``f143``, ``f152``) or a numpy dtype."""
    tile = tile or TileMemory()
    r_addr = [tile.put(np.asarray(a), offset=offset) for a in reads]
    shapes = [(tuple(np.atleast_1d(shape)) if not isinstance(shape, int) else (shape,), dt) for shape, dt in writes]
    w_addr = [tile.alloc(int(np.prod(s)) * np.dtype(STORAGE.get(dt, dt)).itemsize, offset=offset) for s, dt in shapes]

    def resolve(a):
        if isinstance(a, (tuple, list)):
            kind, i, off = a
            return (r_addr if kind == "r" else w_addr)[i] + off
        return int(a)
    status = kernel(tile, [resolve(a) for a in args])
    return VertexRun(status, [tile.read(addr, dt, s) for addr, (s, dt) in zip(w_addr, shapes)], tile)
