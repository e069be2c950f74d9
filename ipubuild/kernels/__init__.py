"""C kernels (codelets): compiling one kernel variant with the system C compiler.

The C ABI is documented in ``README.md`` beside the sources. A variant's object is keyed by its
source, every header it includes, its defines, the compiler, its flags and identity, and the
machine description (for the reservation quantum).
Its code space is reserved in whole quanta (``machine.code.reservation_quantum``) with at least
one byte of slack, so that an edit which keeps the code inside its reservation leaves the tile
memory plan, and so every planning phase, untouched (as an incremental linker would).
"""
from __future__ import annotations

import functools
import os
import re
import shlex
import struct
import subprocess
import sys
import tempfile
from pathlib import Path

from ..artifacts import machine_of, to_json
from ..engine import phase
from ..errors import UserError

KERNEL_DIR = Path(__file__).resolve().parent
DEFAULT_CFLAGS = "-O2 -std=c11 -Wall -fPIC -shared"


def compiler() -> tuple[str, str]:
    """The C compiler and flags: ``$IPUBUILD_CC`` (else ``$CC``, else ``cc``) and
    ``$IPUBUILD_CFLAGS`` (default ``-O2 -std=c11 -Wall -fPIC -shared``)."""
    return (os.environ.get("IPUBUILD_CC") or os.environ.get("CC") or "cc",
            os.environ.get("IPUBUILD_CFLAGS") or DEFAULT_CFLAGS)


@functools.lru_cache(maxsize=None)
def compiler_identity(cc: str) -> str:
    """The first line of ``cc --version`` and the target triple: part of every compile key."""
    try:
        version = subprocess.run([*shlex.split(cc), "--version"], capture_output=True, text=True,
                                 timeout=30).stdout.splitlines()[:1]
        machine = subprocess.run([*shlex.split(cc), "-dumpmachine"], capture_output=True, text=True,
                                 timeout=30).stdout.strip()
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise UserError(f"C compiler {cc!r}", f"cannot run it ({exc}); install a C compiler or set "
                        "IPUBUILD_CC") from None
    return f"{version[0] if version else cc} {machine}".strip()


_INCLUDE = re.compile(rb'^\s*#\s*include\s*"([^"]+)"', re.M)


def included_headers(source: Path) -> list[Path]:
    """Every local header ``source`` includes, transitively (quoted includes beside it)."""
    seen: dict[Path, None] = {}
    todo = [source]
    while todo:
        text = todo.pop().read_bytes()
        for name in _INCLUDE.findall(text):
            h = (source.parent / name.decode()).resolve()
            if h.is_file() and h not in seen:
                seen[h] = None
                todo.append(h)
    return sorted(seen)


def text_bytes(elf: bytes) -> int:
    """Bytes of executable sections (SHF_EXECINSTR) in an ELF64 little-endian object."""
    if elf[:4] != b"\x7fELF" or elf[4] != 2:
        return len(elf)
    shoff, = struct.unpack_from("<Q", elf, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", elf, 0x3A)
    total = 0
    for i in range(shnum):
        _, _, flags, _, _, size = struct.unpack_from("<IIQQQQ", elf, shoff + i * shentsize)
        if flags & 0x4:
            total += size
    return total


def reserve(code: int, quantum: int) -> int:
    """Code space reserved for ``code`` bytes: whole quanta with at least one byte of slack."""
    return (code // quantum + 1) * quantum


def compile_kernel(name: str, source_name: str, source: bytes, headers: dict[str, bytes],
                   defines: list, cc: str, cflags: str, where: str) -> bytes:
    """Compile one variant in a scratch folder; a failure prints the compiler's diagnostics and
    raises a one-line error naming the kernel."""
    with tempfile.TemporaryDirectory(prefix="ipubuild-cc-") as tmp:
        (Path(tmp) / source_name).write_bytes(source)
        for h, data in headers.items():
            (Path(tmp) / h).write_bytes(data)
        cmd = [*shlex.split(cc), *shlex.split(cflags), *[f"-D{k}={v}" for k, v in defines],
               "-o", "kernel.so", source_name, "-lm"]
        try:
            proc = subprocess.run(cmd, cwd=tmp, capture_output=True, text=True, timeout=300)
        except OSError as exc:
            raise UserError(f"kernel {name}", f"cannot run the C compiler {cc!r}: {exc.strerror}") from None
        except subprocess.TimeoutExpired:
            raise UserError(f"kernel {name} ({where})", "the C compiler took more than 300 s; "
                            "check the source or IPUBUILD_CFLAGS") from None
        if proc.returncode != 0:
            sys.stderr.write(proc.stderr.replace(source_name, where))
            first = next((ln for ln in proc.stderr.splitlines() if "error" in ln), "see the diagnostics above")
            raise UserError(f"kernel {name} ({where})", "compile failed: "
                            + first.replace(source_name, where).strip())
        return (Path(tmp) / "kernel.so").read_bytes()


@phase("compile_kernels", inputs=("source", "header/*", "machine"), outputs=("object", "reservation", "code_size"),
       config=("kernel", "compiler"))
def compile_kernels(ctx):
    """One kernel variant's shared object, its reservation and its exact code size."""
    k, c = ctx.config["kernel"], ctx.config["compiler"]
    headers = {name: ctx.engine.fetch(d) for name, d in ctx.family("header/").items()}
    obj = compile_kernel(k["name"], k["source_name"], ctx.bytes("source"), headers, k["defines"],
                         c["cc"], c["cflags"], k["where"])
    code = text_bytes(obj)
    quantum = machine_of(ctx)["code"]["reservation_quantum"]
    # the reservation alone feeds planning: the exact size changes with every edit, it does not
    return {"object": obj, "reservation": to_json({"reserved": reserve(code, quantum)}),
            "code_size": to_json({"code_bytes": code})}
