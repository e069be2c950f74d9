"""The application package (``.ipuexe``): one file a device loads, and its validating reader.

Layout: a 96-byte header, a canonical-JSON manifest, then members (tile images, kernel objects,
the host program) at 16-byte aligned offsets, sorted by member name::

    0   magic  b"IPUEXE\\r\\n"             8   u32 format version    12  u32 flags (0)
    16  compiler version (16 bytes, NUL padded)
    32  u64 manifest offset   40  u64 manifest size   48  sha256 of the manifest (32 bytes)
    80  u64 file size         88  reserved (8 zero bytes)

Every member is named by its sha256 in the manifest and verified when read. The reader rejects
a wrong magic, an unknown version, a bad checksum, a truncated file, members that overlap or fall
outside the file, member paths that could escape an extraction folder, and tile images whose
segments overlap or fall outside tile memory.
"""
from __future__ import annotations

import hashlib
import re
import struct
from pathlib import Path

from . import __version__, canonical
from .errors import PackageError
from .files import write_atomic
from .planning.codegen import decode_exchange, read_image

MAGIC = b"IPUEXE\r\n"
FORMAT_VERSION = 2   # 2: exchange tables of version 2 (broadcast entries; planning/codegen.py)
HEADER = struct.Struct("<8sII16sQQ32sQ8s")
_SAFE_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*(/[A-Za-z0-9_][A-Za-z0-9_.-]*)*")


def _align(x: int, a: int = 16) -> int:
    return -(-x // a) * a


def write_package(manifest: dict, members: dict[str, bytes]) -> bytes:
    """The package bytes for a manifest (without ``members``) and ``{name: bytes}``."""
    names = sorted(members)
    for n in names:
        if not _SAFE_NAME.fullmatch(n) or ".." in n.split("/"):
            raise ValueError(f"unsafe member name {n!r}")
    # members are laid out after the manifest, whose size depends on their offsets: lay out
    # relative offsets first, then shift by the manifest's (aligned) end.
    rel, table = 0, []
    for n in names:
        table.append([n, rel, len(members[n]), canonical.digest(members[n])])
        rel = _align(rel + len(members[n]))
    base = 0
    while True:
        full = dict(manifest, members=[[n, base + off, size, d] for n, off, size, d in table])
        raw = canonical.dumps(full)
        start = _align(HEADER.size + len(raw))
        if start == base:
            break
        base = start
    body = bytearray(raw)
    body += b"\0" * (base - HEADER.size - len(raw))
    for n, off, size, d in table:
        body += b"\0" * (base + off - HEADER.size - len(body))
        body += members[n]
    total = HEADER.size + len(body)
    header = HEADER.pack(MAGIC, FORMAT_VERSION, 0, __version__.encode()[:16].ljust(16, b"\0"),
                         HEADER.size, len(raw), hashlib.sha256(raw).digest(), total, b"\0" * 8)
    return header + bytes(body)


class Package:
    """A validated package: its manifest, and verified member bytes by name or digest."""

    def __init__(self, data: bytes, where: str = "package"):
        self.data, self.where = data, where
        self.manifest = self._validate()

    def _fail(self, message: str):
        raise PackageError(self.where, message)

    def _validate(self) -> dict:
        try:
            return self._check()
        except (TypeError, KeyError, ValueError, IndexError, AttributeError, struct.error) as exc:
            # a well-formed JSON manifest of the wrong shape: never a traceback for the user
            self._fail(f"manifest is not valid ({type(exc).__name__})")

    def _check(self) -> dict:
        d = self.data
        if len(d) < HEADER.size:
            self._fail(f"truncated: {len(d)} bytes is shorter than the {HEADER.size}-byte header")
        magic, version, flags, compiler, moff, msize, mhash, total, _ = HEADER.unpack_from(d)
        if magic != MAGIC:
            self._fail("not an ipubuild package (wrong magic)")
        if version != FORMAT_VERSION:
            self._fail(f"unknown format version {version}; this reader knows {FORMAT_VERSION}: "
                       "rebuild the package with this ipubuild")
        if total != len(d):
            self._fail(f"truncated or padded: header says {total} bytes, file has {len(d)}")
        if moff != HEADER.size or moff + msize > len(d):
            self._fail("manifest lies outside the file")
        raw = d[moff:moff + msize]
        if hashlib.sha256(raw).digest() != mhash:
            self._fail("bad checksum of the manifest")
        try:
            m = canonical.loads(raw)
            members = m["members"]
        except (ValueError, KeyError, TypeError):
            self._fail("manifest is not valid")
        self.compiler = compiler.rstrip(b"\0").decode(errors="replace")
        spans, self.by_name, self.by_digest = [], {}, {}
        for entry in members:
            if not (isinstance(entry, list) and len(entry) == 4):
                self._fail("malformed member entry")
            name, off, size, digest = entry
            if not isinstance(name, str) or not _SAFE_NAME.fullmatch(name) or ".." in name.split("/"):
                self._fail(f"member path {name!r} could escape the extraction folder")
            if not (isinstance(off, int) and isinstance(size, int)) or off < moff + msize or off + size > len(d) or size < 0:
                self._fail(f"member {name} lies outside the file")
            spans.append((off, off + size, name))
            self.by_name[name] = (off, size, digest)
            self.by_digest[digest] = name
        names = set(self.by_name)
        if len(names) != len(members):
            self._fail("duplicate member names")
        for name in names:
            parts = name.split("/")
            for i in range(1, len(parts)):
                if "/".join(parts[:i]) in names:
                    self._fail(f"member {'/'.join(parts[:i])} is also the folder of member {name}")
        spans.sort()
        for (a0, a1, an), (b0, b1, bn) in zip(spans, spans[1:]):
            if b0 < a1:
                self._fail(f"members {an} and {bn} overlap")
        for name, (off, size, digest) in self.by_name.items():
            if canonical.digest(d[off:off + size]) != digest:
                self._fail(f"bad checksum of member {name}")
        self._check_tiles(m)
        return m

    def _check_tiles(self, m: dict) -> None:
        try:
            mem = m["machine"]
            tiles, images, kernels = m["tiles"], m["tile_images"], m["kernels"]
            lo, hi, xend = mem["sram_base"], mem["loader_limit"], mem["executable_end"]
            if not (isinstance(kernels, dict) and isinstance(images, list) and isinstance(tiles, int)):
                raise TypeError
        except (KeyError, TypeError):
            self._fail("manifest lacks the machine, tile or kernel tables")
        if len(images) != tiles:
            self._fail(f"{len(images)} tile images for {tiles} tiles")
        self.images = {}
        for digest in sorted(set(images)):
            if digest not in self.by_digest:
                self._fail(f"tile image {digest[:16]} is not in the package")
            try:
                header, blobs = read_image(self.member(self.by_digest[digest]))
                segments = header["segments"]
                if not all(isinstance(s, list) and len(s) == 5 for s in segments):
                    raise ValueError("segment arity")
            except (ValueError, KeyError, TypeError, UnicodeDecodeError, struct.error):
                self._fail(f"tile image {digest[:16]} is malformed")
            prev_end, prev = 0, None
            for kind, name, addr, size, sd in sorted(segments, key=lambda s: s[2]):
                if not (isinstance(addr, int) and isinstance(size, int)) or addr < lo or addr + size > hi:
                    self._fail(f"segment {name} of tile image {digest[:16]} at {addr} (+{size}) is "
                               f"outside tile memory [{lo}, {hi})")
                if kind != "data" and addr + size > xend:
                    self._fail(f"code segment {name} at {addr} is outside the executable region")
                if addr < prev_end:
                    self._fail(f"segments {prev} and {name} of tile image {digest[:16]} overlap")
                prev_end, prev = addr + size, name
                if kind == "kernel":
                    if kernels.get(name) != sd:
                        self._fail(f"tile image {digest[:16]} uses kernel {name} not in the package")
                elif kind in ("program", "exchange"):
                    if canonical.digest(blobs.get(kind, b"")) != sd:
                        self._fail(f"bad checksum of the {kind} segment of tile image {digest[:16]}")
                    if kind == "exchange":
                        try:
                            decode_exchange(blobs[kind])
                        except ValueError as exc:
                            self._fail(f"exchange segment of tile image {digest[:16]}: {exc}")
                elif canonical.digest(blobs.get(f"data@{addr}", b"")) != sd:
                    self._fail(f"bad checksum of data segment {name} of tile image {digest[:16]}")
            self.images[digest] = (header, blobs)
        for binding in m.get("inputs", []) + m.get("outputs", []):
            for off, size, tile, addr in binding["ranges"]:
                if not 0 <= tile < tiles or addr < lo or addr + size > hi:
                    self._fail(f"binding of {binding['name']} to tile {tile} address {addr} is out of range")

    def member(self, name: str) -> bytes:
        off, size, digest = self.by_name[name]
        return self.data[off:off + size]

    def tile_image(self, tile: int) -> tuple[dict, dict]:
        return self.images[self.manifest["tile_images"][tile]]

    def kernel_object(self, name: str) -> bytes:
        return self.member(self.by_digest[self.manifest["kernels"][name]])

    def extract(self, dest) -> list[Path]:
        """Write every member under ``dest``; refuses any path that would land outside it."""
        dest = Path(dest).resolve()
        written = []
        for name in sorted(self.by_name):
            target = (dest / name).resolve()
            if dest not in target.parents:
                self._fail(f"member path {name!r} escapes the extraction folder")
            write_atomic(target, self.member(name))
            written.append(target)
        return written


def read_package(path) -> Package:
    """Read and validate a package file; every problem is a one-line PackageError."""
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise PackageError(str(path), f"cannot read: {exc.strerror}") from None
    return Package(data, str(path))


def summarize(pkg: Package) -> list[str]:
    """Lines for ``doit inspect:<target>``."""
    m = pkg.manifest
    tiles = m["tiles"]
    idle = m["idle_image"]
    used = [t for t, d in enumerate(m["tile_images"]) if d != idle]
    regions = {"code": [], "data": [], "exchange": []}
    for t in used:
        header, _ = pkg.tile_image(t)
        sizes = {"code": 0, "data": 0, "exchange": 0}
        for kind, name, addr, size, _d in header["segments"]:
            sizes["data" if kind == "data" else "exchange" if kind == "exchange" else "code"] += size
        for k, v in sizes.items():
            regions[k].append(v)
    lines = [f"package {pkg.where}: format {FORMAT_VERSION}, compiler {pkg.compiler}, "
             f"{len(pkg.data)} bytes, target {m['target']}",
             f"tiles={tiles} tiles_used={len(used)} distinct_images={len(set(m['tile_images']))}"]
    for k, v in regions.items():
        if v:
            lines.append(f"{k}_bytes_per_tile max={max(v)} mean={sum(v) // len(v)} total={sum(v)}")
    lines.append(f"kernels={len(m['kernels'])} " + " ".join(sorted(m["kernels"])))
    host = m["host"]
    lines.append(f"host calls: initialize phases={host['initialize']['phases']}, run phases={host['run']['phases']}")
    for b in m["inputs"]:
        lines.append(f"input {b['name']} {b['dtype']}{b['shape']} ranges={len(b['ranges'])}")
    for b in m["outputs"]:
        lines.append(f"output {b['name']} {b['dtype']}{b['shape']} ranges={len(b['ranges'])}")
    return lines


# the phase that writes it -----------------------------------------------------------------------
from .engine import phase  # noqa: E402


@phase("write_package", inputs=("image/*", "idle_image", "object/*", "host_program", "machine"),
       outputs=("package",), config=("name", "target.tile_count"))
def write_package_phase(ctx):
    from .artifacts import machine_of
    from .log import log
    m = machine_of(ctx)
    used = ctx.config["target"]["tile_count"]
    images = ctx.family("image/")
    idle = ctx.digest("idle_image")
    tile_images = [images.get(str(t), idle) if t < used else idle for t in range(m["tiles"])]
    members = {f"images/{d}.img": ctx.engine.fetch(d) for d in sorted(set(tile_images))}
    objects = ctx.family("object/")
    kernels = {}
    for digest in sorted(set(tile_images)):
        header, _ = read_image(members[f"images/{digest}.img"])
        kernels.update({s[1]: s[4] for s in header["segments"] if s[0] == "kernel"})
    for name, d in sorted(kernels.items()):
        if objects.get(name) != d:
            raise ValueError(f"image refers to kernel {name} object {d[:16]} that is not an input")
        members[f"kernels/{name}.so"] = ctx.engine.fetch(d)
    host = ctx.json("host_program")
    members["host/program.json"] = ctx.bytes("host_program")
    mem = m["memory"]
    manifest = {
        "format": FORMAT_VERSION, "compiler": __version__, "target": ctx.config["name"],
        "tiles": m["tiles"], "used_tiles": used, "idle_image": idle, "tile_images": tile_images,
        "machine": {**m, "sram_base": mem["sram_base"], "sram_end": mem["sram_end"],
                    "executable_end": mem["executable_end"], "loader_limit": mem["loader_limit"]},
        "kernels": kernels,
        "host": {"initialize": host["initialize"], "run": host["run"],
                 "program": canonical.digest(members["host/program.json"])},
        "inputs": host["inputs"], "outputs": host["outputs"]}
    log.info("writing application package", tiles=m["tiles"])
    data = write_package(manifest, members)
    log.info("application package written", bytes=len(data))
    return {"package": data}
