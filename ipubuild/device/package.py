"""The application package (``.ipuexe``): one file a device loads, and its validating reader.

Layout: a 96-byte header, a canonical-JSON manifest, then members (tile images, kernel objects,
the host program) at 16-byte aligned offsets, sorted by member name::

    0   magic  b"IPUEXE\\r\\n"             8   u32 format version    12  u32 flags (0)
    16  compiler version (16 bytes, NUL padded)
    32  u64 manifest offset   40  u64 manifest size   48  sha256 of the manifest (32 bytes)
    80  u64 file size         88  reserved (8 zero bytes)

Every member is named by its sha256 in the manifest and verified when read. The reader accepts
a package only if every byte a consumer reads (``summarize``, a device backend) is what the
schema below says: the manifest, the host program and every tile image's header are canonical
JSON, nested at most ``MAX_DEPTH`` deep (checked before parsing), of the declared types and
bounds; member paths cannot escape an extraction folder; members, segments, exchange entries
and bindings lie inside the file, tile memory and their tensors; tile programs and exchange
tables decode exactly and agree with the manifest's kernels, tiles and phases; every tile of the
target (``used_tiles``: tiles ``0 … used_tiles-1``) runs an image of its own — its exchange table
sends from that tile only — and every tile past it the idle image. Anything else is
a one-line :class:`PackageError` naming what is wrong.
"""
from __future__ import annotations

import concurrent.futures
import hashlib
import json
import math
import re
import struct
from pathlib import Path

import numpy as np

from .. import __version__
from ..engine import canonical
from ..engine.errors import PackageError
from ..engine.files import write_atomic
from ..graph.ir import DTYPES
from ..compiler.planning import codegen, codegen_native
from ..compiler.planning.codegen import read_image

MAGIC = b"IPUEXE\r\n"
FORMAT_VERSION = 3   # 2: exchange tables of version 2 (broadcast entries; planning/codegen.py); 3: the host
                     # program gives each run phase's exchange cycles (the compiler's schedule)
HEADER = struct.Struct("<8sII16sQQ32sQ8s")
_SAFE_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*(/[A-Za-z0-9_][A-Za-z0-9_.-]*)*")


# limits: generous for any real machine and model, small enough that no consumer's loop,
# allocation or recursion can be driven out of bounds by a hostile package
MAX_JSON_BYTES = 16 << 20      # the manifest, the host program, a tile image's header
MAX_DEPTH = 32                 # JSON nesting (real documents nest at most 5 deep)
MAX_TILES = 1 << 14
MAX_SRAM = 1 << 24             # bytes of one tile's memory
MAX_PHASES = 1 << 16           # host-call phases (BSP steps)
MAX_ITEMS = 1 << 20            # entries of any list: members, segments, binding ranges
U64 = (1 << 64) - 1


# schema ------------------------------------------------------------------------------------
class _Invalid(Exception):
    """A JSON value that does not match its schema: where it is (``inputs[0].ranges[2][1]``)
    and what is wrong with it. Containers add where their item was as the error passes up
    (``within``), so that checking a valid document formats no paths."""

    def __init__(self, problem: str):
        super().__init__(problem)
        self.problem, self.parts = problem, []       # innermost first: field names, [index], " key"

    def within(self, part) -> "_Invalid":
        self.parts.append(part)
        return self

    def __str__(self) -> str:
        path = ""
        for part in reversed(self.parts):
            path += part if part.startswith(("[", " ")) or not path else f".{part}"
        return f"{path or 'the document'} {self.problem}"


def _show(v) -> str:
    """A short one-line picture of a hostile value for an error message."""
    if isinstance(v, dict):
        return f"an object of {len(v)} fields"
    if isinstance(v, list):
        return f"a list of {len(v)} items"
    if isinstance(v, str):
        return repr(v[:40]) + ("..." if len(v) > 40 else "")
    return repr(v)


def _types(values: list) -> set:
    """The exact types of ``values`` (``bool`` is not ``int`` here), found without a Python loop."""
    return set(map(type, values))


class _Schema:
    """A schema: ``check(value)`` raises ``_Invalid``; ``valid(values)`` says whether every one of
    a list of values would pass, as fast as it can: over the whole list at once, in C where it
    can (a list's items are checked one by one, with their paths, only when they do not all
    pass)."""

    def valid(self, values: list) -> bool:
        try:
            for v in values:
                self.check(v)
        except _Invalid:
            return False
        return True


class Int(_Schema):
    def __init__(self, lo: int = 0, hi: int = U64):
        self.lo, self.hi = lo, hi

    def check(self, v):
        if type(v) is not int or not self.lo <= v <= self.hi:
            raise _Invalid(f"is {_show(v)}, expected an integer in [{self.lo}, {self.hi}]")

    def valid(self, values: list) -> bool:
        return _types(values) <= {int} and (not values or self.lo <= min(values) and max(values) <= self.hi)


class Num(_Schema):
    """A finite int or float in ``[lo, hi]``."""

    def __init__(self, lo: float, hi: float):
        self.lo, self.hi = lo, hi

    def check(self, v):
        if type(v) not in (int, float) or not math.isfinite(v) or not self.lo <= v <= self.hi:
            raise _Invalid(f"is {_show(v)}, expected a number in [{self.lo}, {self.hi}]")


class Bool(_Schema):
    def check(self, v):
        if type(v) is not bool:
            raise _Invalid(f"is {_show(v)}, expected true or false")


class Str(_Schema):
    """A printable string of at most ``max_len`` characters, matching ``pattern`` if given."""

    def __init__(self, max_len: int = 256, pattern: str | None = None, what: str = ""):
        self.max_len, self.pattern = max_len, pattern and re.compile(pattern)
        self.what = what or f"a printable string of at most {max_len} characters"

    def check(self, v):
        if not (type(v) is str and len(v) <= self.max_len and v.isprintable()
                and (self.pattern is None or self.pattern.fullmatch(v))):
            raise _Invalid(f"is {_show(v)}, expected {self.what}")

    def valid(self, values: list) -> bool:
        if not (_types(values) <= {str} and max(map(len, values), default=0) <= self.max_len
                and "".join(values).isprintable()):
            return False
        return self.pattern is None or all(map(self.pattern.fullmatch, values))


class Enum(_Schema):
    def __init__(self, *values):
        self.values, self.typed = values, {(type(x), x) for x in values}

    def check(self, v):
        if type(v) not in (int, str) or (type(v), v) not in self.typed:
            raise _Invalid(f"is {_show(v)}, expected one of {', '.join(map(repr, self.values))}")

    def valid(self, values: list) -> bool:
        return _types(values) <= {int, str} and set(zip(map(type, values), values)) <= self.typed


class List(_Schema):
    def __init__(self, item, max_len: int = MAX_ITEMS):
        self.item, self.max_len = item, max_len

    def check(self, v):
        if type(v) is not list or len(v) > self.max_len:
            raise _Invalid(f"is {_show(v)}, expected a list of at most {self.max_len} items")
        if self.item.valid(v):
            return
        check = self.item.check
        for i, x in enumerate(v):
            try:
                check(x)
            except _Invalid as exc:
                raise exc.within(f"[{i}]") from None


class Tuple(_Schema):
    """A list of exactly ``len(items)`` items, each of its own schema."""

    def __init__(self, *items):
        self.items = items

    def valid(self, values: list) -> bool:
        return _types(values) <= {list} and set(map(len, values)) <= {len(self.items)} and \
            all(schema.valid(list(column)) for schema, column in zip(self.items, zip(*values)))

    def check(self, v):
        if type(v) is not list or len(v) != len(self.items):
            raise _Invalid(f"is {_show(v)}, expected a list of {len(self.items)} items")
        for i, (schema, x) in enumerate(zip(self.items, v)):
            try:
                schema.check(x)
            except _Invalid as exc:
                raise exc.within(f"[{i}]") from None


class Obj(_Schema):
    """An object with exactly these fields (``extra``: other fields allowed and not looked at)."""

    def __init__(self, fields: dict, extra: bool = False):
        self.fields, self.extra = fields, extra

    def check(self, v):
        if type(v) is not dict:
            raise _Invalid(f"is {_show(v)}, expected an object")
        for name, schema in self.fields.items():
            if name not in v:
                raise _Invalid("is missing").within(name)
            try:
                schema.check(v[name])
            except _Invalid as exc:
                raise exc.within(name) from None
        if not self.extra:
            for name in v:
                if name not in self.fields:
                    raise _Invalid(f"has an unknown field {_show(name)}")


class Map(_Schema):
    """An object whose keys match ``key`` and whose values match ``value``."""

    def __init__(self, key: Str, value, max_len: int = MAX_ITEMS):
        self.key, self.value, self.max_len = key, value, max_len

    def check(self, v):
        if type(v) is not dict or len(v) > self.max_len:
            raise _Invalid(f"is {_show(v)}, expected an object of at most {self.max_len} fields")
        for name, x in v.items():
            try:
                self.key.check(name)
            except _Invalid as exc:
                raise exc.within(" key") from None
            try:
                self.value.check(x)
            except _Invalid as exc:
                raise exc.within(name) from None


DIGEST = Str(64, r"[0-9a-f]{64}", "a sha256 hex digest")
LABEL = Str()                                   # names of values, steps, targets: printed, never parsed
KERNEL = Str(128, r"[A-Za-z_][A-Za-z0-9_.-]*", "a kernel name")
MEMBER_PATH = Str(255, _SAFE_NAME.pattern, "a member path that cannot escape the extraction folder")
ADDRESS, SIZE = Int(0, MAX_SRAM), Int(0, MAX_SRAM)
COUNT, RATE = Int(0, 1 << 32), Int(1, 1 << 32)   # cycles, and per-cycle rates (divisors)
PHASES = Obj({"phases": Int(0, MAX_PHASES)})

MACHINE = Obj({                                 # what the simulator and the kernels' estimators read
    "name": LABEL, "tiles": Int(1, MAX_TILES), "clock_hz": Num(1, 1e13), "workers": Int(1, 1 << 10),
    "sram_base": ADDRESS, "sram_end": ADDRESS, "executable_end": ADDRESS, "loader_limit": ADDRESS,
    "memory": Obj({"sram_base": ADDRESS, "sram_end": ADDRESS, "executable_end": ADDRESS,
                   "loader_limit": ADDRESS}, extra=True),
    "exchange": Obj({"bytes_per_cycle": RATE, "paired_bytes_per_cycle": RATE,
                     "local_copy_bytes_per_cycle": RATE, "paired_setup_cycles": COUNT,
                     "transfer_setup_cycles": COUNT, "sync_cycles": COUNT}, extra=True),
    "compute": Obj({"vertex_overhead_cycles": COUNT, "amp_macs_per_cycle": Obj({d: RATE for d in DTYPES}),
                    "vector_flops_per_cycle": RATE, "transcendental_cycles": COUNT,
                    "copy_bytes_per_cycle": RATE}, extra=True),
}, extra=True)                                  # the rest of the machine description rides along

BINDING = Obj({                                 # a graph input or output and where its bytes live
    "name": LABEL, "dtype": Enum(*DTYPES), "shape": List(Int(0, 1 << 31), 8),
    "scale_exp": Int(-(1 << 31), (1 << 31) - 1),
    "ranges": List(Tuple(Int(0, U64), SIZE, Int(0, MAX_TILES - 1), ADDRESS)),   # [offset, size, tile, address]
})

MANIFEST = Obj({
    "format": Enum(FORMAT_VERSION), "compiler": Str(64), "target": LABEL,
    "tiles": Int(1, MAX_TILES), "used_tiles": Int(0, MAX_TILES),
    "idle_image": DIGEST, "tile_images": List(DIGEST, MAX_TILES),
    "machine": MACHINE,
    "kernels": Map(KERNEL, DIGEST, 1 << 12),
    "host": Obj({"initialize": PHASES, "run": PHASES, "program": DIGEST}),
    "inputs": List(BINDING, 1 << 12), "outputs": List(BINDING, 1 << 12),
    "members": List(Tuple(MEMBER_PATH, Int(0, U64), Int(0, U64), DIGEST), 1 << 16),   # [path, offset, size, sha256]
})

HOST_PROGRAM = Obj({                            # member host/program.json
    "initialize": PHASES, "run": PHASES,
    "steps": List(LABEL, MAX_PHASES), "paired": List(Bool(), MAX_PHASES),   # per run phase
    "horizons": List(COUNT, MAX_PHASES),        # per run phase: its exchange's cycles, as scheduled
    "inputs": List(BINDING, 1 << 12), "outputs": List(BINDING, 1 << 12),
})

IMAGE_ARRAYS = List(Tuple(                      # a tile image's array table (ipubuild.tensors layout)
    Str(32, r"header|program|exchange|data@[0-9]{1,10}", "header, program, exchange or data@<address>"),
    Enum("|u1"), Tuple(Int(0, U64)), Int(0, U64), Int(0, U64)),
    MAX_ITEMS)                                  # [name, dtype, [size], offset, size]: placed in order

TILE_IMAGE = Obj({                              # a tile image's header
    "tile_image": Enum(1),
    "segments": List(Tuple(Enum("kernel", "program", "exchange", "data"), LABEL, ADDRESS, SIZE, DIGEST)),
})                                              # [kind, name, address, size, sha256]


def _parse(raw: bytes, integers: bool, too_deep=lambda: False):
    """JSON ``raw`` (ASCII only) parsed; with ``integers``, by orjson where it can (json for what
    it refuses, such as integers beyond 64 bits, unless ``too_deep()``: a ValueError then)."""
    raw.decode("ascii")
    if integers:
        import orjson
        try:
            return orjson.loads(raw)
        except orjson.JSONDecodeError:
            if too_deep():
                raise ValueError("nests too deep") from None
    return json.loads(raw)


def _orjson_dumps(value) -> bytes:
    import orjson
    return orjson.dumps(value, option=orjson.OPT_SORT_KEYS)


_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"?', re.S)


def _nesting(raw: bytes) -> int:
    """How deep the brackets of JSON text nest outside its strings, without parsing it."""
    brackets = np.frombuffer(_JSON_STRING.sub(b"", raw).translate(None, _NOT_BRACKETS), np.uint8)
    steps = np.where((brackets == ord("[")) | (brackets == ord("{")), 1, -1)
    return int(np.cumsum(steps).max(initial=0))


#: exchange rows the reader checks at once (``Package._check_exchanges``): enough to amortise
#: numpy's calls over a few hundred small tables, few enough to stay in the processor's caches
CHECK_ROWS = 1 << 16


def _chunks(tables: list, limit: int):
    """``[(digest, (steps, rows, entry)), ...]`` in runs of at most ``limit`` rows (or one table)."""
    run, size = [], 0
    for item in tables:
        if run and size + len(item[1][1]) > limit:
            yield run
            run, size = [], 0
        run.append(item)
        size += len(item[1][1])
    if run:
        yield run


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
    """A validated package: its manifest, and verified member bytes by name or digest.

    ``images`` maps each tile image's digest to ``(header, {array name: bytes})``; the data
    segments' arrays (``data@<address>``) are memoryviews of the package's bytes, not copies.

    ``content_verified``: the caller checked the whole bytes against their content address (the
    store does on every read). The members' and segments' own checksums are then not hashed
    again: they detect corruption, which that check already rules out, and a crafted package can
    carry consistent checksums, so they never defended against one. Everything else is checked.
    """

    def __init__(self, data: bytes, where: str = "package", content_verified: bool = False):
        self.data, self.where = data, where
        self._hash_parts = not content_verified
        self._data_view = memoryview(data)
        self.manifest = self._check()

    def _fail(self, message: str):
        raise PackageError(self.where, message)

    def _document(self, raw: bytes, schema, what: str, integers: bool = False):
        """Parse canonical JSON ``raw`` and check it against ``schema``. ``integers``: the
        schema admits no floats and has no free-form parts, so orjson may parse and write it
        (the same canonical bytes as ``canonical.dumps`` for such documents; several times
        faster on tile images' headers), and its nesting is measured only when it fails
        (orjson refuses what nests past its own limit; a value that passes the schema nests as
        the schema does)."""
        if len(raw) > MAX_JSON_BYTES:
            self._fail(f"{what} is larger than {MAX_JSON_BYTES} bytes")
        too_deep = lambda: _nesting(raw) > MAX_DEPTH        # noqa: E731
        if not integers and too_deep():
            self._fail(f"{what} nests deeper than {MAX_DEPTH} levels")
        try:
            value = _parse(raw, integers, too_deep)
        except ValueError:          # UnicodeDecodeError and JSONDecodeError are ValueErrors
            self._fail(f"{what} nests deeper than {MAX_DEPTH} levels" if integers and too_deep()
                       else f"{what} is not valid JSON")
        try:
            schema.check(value)
        except _Invalid as exc:
            if integers and too_deep():
                self._fail(f"{what} nests deeper than {MAX_DEPTH} levels")
            self._fail(f"{what} is not valid: {exc}")
        try:
            canonical_form = (integers and _orjson_dumps(value) == raw) or canonical.dumps(value) == raw
        except (ValueError, TypeError):          # NaN or infinity where the schema looks at nothing
            canonical_form = False
        if not canonical_form:
            self._fail(f"{what} is not in canonical form")
        return value

    def _check(self) -> dict:
        d = self.data
        if len(d) < HEADER.size:
            self._fail(f"truncated: {len(d)} bytes is shorter than the {HEADER.size}-byte header")
        magic, version, flags, compiler, moff, msize, mhash, total, reserved = HEADER.unpack_from(d)
        if magic != MAGIC:
            self._fail("not an ipubuild package (wrong magic)")
        if version != FORMAT_VERSION:
            self._fail(f"unknown format version {version}; this reader knows {FORMAT_VERSION}: "
                       "rebuild the package with this ipubuild")
        if flags != 0 or reserved != b"\0" * 8:
            self._fail("unknown header flags or reserved bytes")
        if total != len(d):
            self._fail(f"truncated or padded: header says {total} bytes, file has {len(d)}")
        if moff != HEADER.size or moff + msize > len(d):
            self._fail("manifest lies outside the file")
        raw = d[moff:moff + msize]
        if hashlib.sha256(raw).digest() != mhash:
            self._fail("bad checksum of the manifest")
        m = self._document(raw, MANIFEST, "manifest")
        if compiler != m["compiler"].encode()[:16].ljust(16, b"\0"):
            self._fail(f"the header's compiler field is not the manifest's compiler {_show(m['compiler'])}")
        self.compiler = m["compiler"]
        self._check_members(m["members"], moff + msize)
        self._check_machine(m)
        used = self._check_tiles(m)
        host = self._check_host(m)
        self.images, self._data_digests = {}, []
        self.decoded: dict[str, tuple] = {}     # image digest -> (decoded program, exchange table)
        for digest in sorted(set(m["tile_images"])):
            self.images[digest] = self._image(m, digest, used if digest != m["idle_image"] else None,
                                              host["run"]["phases"])
        self._check_programs(host["run"]["phases"])
        sending = self._check_exchanges(m, used, host["run"]["phases"])
        self._check_digests(self._data_digests)
        for t, digest in enumerate(m["tile_images"]):   # an image in its own tile's slot
            senders = sending.get(digest)
            if senders is not None and senders != (t, t):
                sent = self.decoded[digest][1][1][:, 0]
                self._fail(f"tile {t} holds tile image {digest[:16]}, whose exchange table sends from tile "
                           f"{int(sent[sent != t].min())}: the tile table does not put each image in its tile's slot")
        for side in ("inputs", "outputs"):
            self._check_bindings(m, side, used)
        return m

    def _check_members(self, members: list, start: int) -> None:
        d = self.data
        spans, self.by_name, self.by_digest = [], {}, {}
        for name, off, size, digest in members:
            if off < start or off + size > len(d):
                self._fail(f"member {name} lies outside the file")
            spans.append((off, off + size, name))
            self.by_name[name] = (off, size, digest)
            self.by_digest[digest] = name
        if len(self.by_name) != len(members):
            self._fail("duplicate member names")
        for name in self.by_name:
            parts = name.split("/")
            for i in range(1, len(parts)):
                if "/".join(parts[:i]) in self.by_name:
                    self._fail(f"member {'/'.join(parts[:i])} is also the folder of member {name}")
        spans.sort()
        for (a0, a1, an), (b0, b1, bn) in zip(spans, spans[1:]):
            if b0 < a1:
                self._fail(f"members {an} and {bn} overlap")
        self._check_digests([(self._view(name), digest, f"bad checksum of member {name}")
                             for name, (_, _, digest) in self.by_name.items()])

    def _check_digests(self, expected: list) -> None:
        """Each ``(bytes, digest, message)``: fails with the first message whose bytes do not hash
        to their digest (unless the whole bytes were verified). hashlib lets go of the GIL on large
        buffers, so two threads hash them (a ViT-B/16 package's 426 MB), each a half of the bytes
        (a task per item would cost more than hashing the small ones)."""
        if not self._hash_parts:
            return
        sizes = np.cumsum([len(item[0]) for item in expected])
        half = int(np.searchsorted(sizes, sizes[-1] / 2)) + 1 if len(expected) else 0
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            later = pool.submit(lambda: [canonical.digest(item[0]) for item in expected[half:]])
            found = [canonical.digest(item[0]) for item in expected[:half]]
            found += later.result()
        for (_, digest, message), got in zip(expected, found):
            if got != digest:
                self._fail(message)

    def _check_machine(self, m: dict) -> None:
        mc = m["machine"]
        if not mc["sram_base"] <= mc["executable_end"] <= mc["loader_limit"] <= mc["sram_end"]:
            self._fail("machine: expected sram_base <= executable_end <= loader_limit <= sram_end")
        for k in ("sram_base", "sram_end", "executable_end", "loader_limit"):
            if mc["memory"][k] != mc[k]:
                self._fail(f"machine: memory.{k} is {mc['memory'][k]}, not {k} {mc[k]}")
        if mc["tiles"] != m["tiles"]:
            self._fail(f"machine has {mc['tiles']} tiles, the manifest {m['tiles']}")

    def _check_tiles(self, m: dict) -> set[int]:
        """The tiles that do not run the idle image (the ones a device loads)."""
        tiles, images, idle = m["tiles"], m["tile_images"], m["idle_image"]
        if len(images) != tiles:
            self._fail(f"{len(images)} tile images for {tiles} tiles")
        if m["used_tiles"] > tiles or any(d != idle for d in images[m["used_tiles"]:]):
            self._fail(f"used_tiles {m['used_tiles']}: a tile past it does not run the idle image")
        for digest in sorted(set(images)):
            if digest not in self.by_digest:
                self._fail(f"tile image {digest[:16]} is not in the package")
        for name, digest in sorted(m["kernels"].items()):
            if digest not in self.by_digest:
                self._fail(f"object {digest[:16]} of kernel {name} is not in the package")
        loaded = {t for t, d in enumerate(images) if d != idle}
        if len(loaded) != m["used_tiles"]:    # every tile of the target runs a program of its own
            self._fail(f"used_tiles is {m['used_tiles']} but the tile table loads {len(loaded)} tiles: "
                       "the counts disagree")
        return loaded

    def _check_host(self, m: dict) -> dict:
        host = m["host"]
        if self.by_name.get("host/program.json", (0, 0, None))[2] != host["program"]:
            self._fail(f"host program {host['program'][:16]} is not the package's member host/program.json")
        p = self._document(self.member("host/program.json"), HOST_PROGRAM, "host program")
        same = {"initialize": host["initialize"], "run": host["run"], "inputs": m["inputs"], "outputs": m["outputs"]}
        for k, v in same.items():
            if p[k] != v:
                self._fail(f"host program: {k} differs from the manifest's")
        phases = host["run"]["phases"]
        for k in ("steps", "paired", "horizons"):
            if len(p[k]) != phases:
                self._fail(f"host program: {len(p[k])} {k} for {phases} run phases")
        self.host_program = p
        return host

    def _image(self, m: dict, digest: str, used: set | None, phases: int) -> tuple[dict, dict]:
        """A tile image's header and arrays; ``used`` (the loaded tiles) unless it is the idle
        image: then it must also carry a program and an exchange table for ``phases`` phases."""
        what = f"tile image {digest[:16]}"
        blob = self._view(self.by_digest[digest])
        if len(blob) < 4 or 4 + struct.unpack_from("<I", blob)[0] > len(blob):
            self._fail(f"{what} is malformed: truncated")
        base = 4 + struct.unpack_from("<I", blob)[0]
        arrays, pos = {}, base
        for name, _, (length,), off, size in self._document(bytes(blob[4:base]), IMAGE_ARRAYS, f"{what} array table",
                                                            True):
            if (arrays and name <= next(reversed(arrays))) or length != size or base + off != pos:
                self._fail(f"{what} is malformed: array {name} is out of order or place")
            part = blob[pos:pos + size]       # data (most of a package's bytes) not copied
            arrays[name], pos = part if name.startswith("data@") else bytes(part), pos + size
        if pos != len(blob) or "header" not in arrays:
            self._fail(f"{what} is malformed: its arrays do not fill it or lack the header")
        header = self._document(arrays.pop("header"), TILE_IMAGE, what, True)
        self._check_segments(m, what, header["segments"], arrays)
        if used is not None:
            kinds = [s[0] for s in header["segments"]]
            if kinds.count("program") != 1 or kinds.count("exchange") != 1:
                self._fail(f"{what} is loaded on a tile but lacks its program or exchange table")
            kernels = {s[1] for s in header["segments"] if s[0] == "kernel"}
            self.decoded[digest] = (self._decode_program(what, arrays["program"], kernels),
                                    self._decode_exchange(what, arrays["exchange"]))
        return header, arrays

    def _check_segments(self, m: dict, what: str, segments: list, arrays: dict) -> None:
        mc = m["machine"]
        lo, hi, xend = mc["sram_base"], mc["loader_limit"], mc["executable_end"]
        kinds, blobs = set(), set()
        prev_end, prev = 0, None
        for kind, name, addr, size, sd in sorted(segments, key=lambda s: (s[2], s[3])):
            if addr < lo or addr + size > hi:
                self._fail(f"segment {name} of {what} at {addr} (+{size}) is outside tile memory [{lo}, {hi})")
            if kind != "data" and addr + size > xend:
                self._fail(f"code segment {name} at {addr} is outside the executable region")
            if addr < prev_end:
                self._fail(f"segments {prev} and {name} of {what} overlap")
            prev_end, prev = addr + size, name
            if kind == "kernel":
                if (kind, name) in kinds:
                    self._fail(f"{what} reserves kernel {name} twice")
                if m["kernels"].get(name) != sd:
                    self._fail(f"{what} uses kernel {name} not in the package")
                kinds.add((kind, name))
                continue
            key = kind if kind != "data" else f"data@{addr}"
            if key in blobs:
                self._fail(f"{what} has two {kind} segments at {addr}" if kind == "data"
                           else f"{what} has two {kind} segments")
            blobs.add(key)
            if key not in arrays:
                self._fail(f"bad checksum of the {kind} segment of {what}" if kind != "data"
                           else f"bad checksum of data segment {name} of {what}")
            if kind == "data":      # no later check reads data: hashed with every image's at the end
                self._data_digests.append((arrays[key], sd, f"bad checksum of data segment {name} of {what}"))
            elif self._hash_parts and canonical.digest(arrays[key]) != sd:
                self._fail(f"bad checksum of the {kind} segment of {what}")
            if len(arrays[key]) != size:
                self._fail(f"{kind} segment {name} of {what} holds {len(arrays[key])} bytes, not {size}")
        if set(arrays) != blobs:
            self._fail(f"{what} has arrays no segment places: {', '.join(sorted(set(arrays) - blobs))}")

    def _decode_program(self, what: str, raw: bytes, kernels: set) -> tuple:
        """The program (``codegen.decode_program_arrays``), its kernels checked; its steps and
        kernel indices are checked with every image's (``_check_programs``)."""
        try:
            names, steps, vertex_kernels, starts, args = codegen.decode_program_arrays(raw)
        except (ValueError, struct.error):      # a program that decodes is exactly its bytes
            self._fail(f"the program of {what} does not decode")
        for name in names:
            if name not in kernels:
                self._fail(f"the program of {what} calls kernel {_show(name)} the image does not hold")
        return names, steps, vertex_kernels, starts, args

    def _check_programs(self, phases: int) -> None:
        """Every decoded program's steps in order and within ``phases``, and its kernel indices
        within its kernel list: over all of them at once (a check per image cost ViT-B/16's 1,472
        images more than their decoding), then the first image that fails is checked alone for
        its message."""
        programs = [program for program, _ in self.decoded.values()]
        if not programs:
            return
        order = np.concatenate([steps[:, 0] for _, steps, *_ in programs])
        starts = np.cumsum([0] + [len(steps) for _, steps, *_ in programs[:-1]])
        before = np.concatenate([[-1], order[:-1]])
        before[starts[starts < len(order)]] = -1
        bad_step = (order >= phases) | (order <= before)
        kernels = np.concatenate([vk for _, _, vk, *_ in programs])
        limit = np.repeat([len(names) for names, *_ in programs], [len(vk) for _, _, vk, *_ in programs])
        if not bad_step.any() and not (kernels >= limit).any():
            return
        for (digest, (program, _)) in self.decoded.items():
            self._check_program(f"tile image {digest[:16]}", program, phases)
        raise AssertionError("a program failed the joint check but not its own")

    def _check_program(self, what: str, program: tuple, phases: int) -> None:
        names, steps, vertex_kernels, starts, args = program
        order = steps[:, 0]
        bad = (order >= phases) | (np.diff(order, prepend=-1) <= 0)
        if bad.any():
            step = int(order[np.argmax(bad)])
            self._fail(f"the program of {what} has step {step} out of order or past {phases} run phases")
        past = vertex_kernels >= len(names)
        if past.any():
            step = int(order[np.searchsorted(steps[:, 2], np.argmax(past), "right")])
            self._fail(f"the program of {what} calls a kernel index past its kernel list at step {step}")

    def _decode_exchange(self, what: str, raw: bytes):
        """The exchange table (``codegen.decode_exchange_rows``: each entry's step, its
        destinations as rows and each row's entry); checked with every image's
        (``_check_exchanges``). Decoding reads every word of the table as it was written, so a
        table that decodes is exactly its bytes."""
        try:
            return codegen.decode_exchange_rows(raw)
        except (ValueError, struct.error):
            self._fail(f"the exchange table of {what} does not decode")

    @staticmethod
    def _outside(mc: dict, rows: np.ndarray, loaded: np.ndarray) -> np.ndarray:
        """Whether each row leaves the loaded tiles (``loaded``: a mask over the machine's tiles
        and one past them) or their memory (in C where it can: ViT-B/16's exchange check took
        0.30 s with numpy, 0.13 s with it)."""
        lo, hi = mc["sram_base"], mc["loader_limit"]
        found = codegen_native.rows_outside(rows, loaded, lo, hi)
        if found is not None:
            return found
        r = rows.astype(np.uint64)      # the rows' words are u32: their spans fit, without wrapping
        span = (np.maximum(r[:, [6]], 1) - 1) * r[:, [2, 5]] + r[:, [7]]     # bytes from the first row's start
        tiles = np.minimum(rows[:, [0, 3]], mc["tiles"])
        return (~loaded[tiles] | (rows[:, [1, 4]] < lo) | (r[:, [1, 4]] + span > hi)).any(axis=1)

    def _check_exchanges(self, m: dict, used: set, phases: int) -> dict[str, tuple[int, int]]:
        """Every decoded exchange table's entries within the run phases, the loaded tiles and
        their memory, checked over many tables at once (``CHECK_ROWS`` rows at a time; then the
        first image that fails alone, for its message). Returns each sending table's first and
        last sending tile, by image digest."""
        mc = m["machine"]
        loaded = np.zeros(mc["tiles"] + 1, bool)
        loaded[sorted(used)] = True
        sending: dict[str, tuple[int, int]] = {}
        tables = [(digest, table) for digest, (_, table) in self.decoded.items()]
        bad = any(len(steps) and int(steps.max()) >= phases for _, (steps, _, _) in tables)
        for chunk in _chunks([(d, t) for d, t in tables if len(t[1])], CHECK_ROWS) if not bad else ():
            rows = np.concatenate([r for _, (_, r, _) in chunk])
            if self._outside(mc, rows, loaded).any():
                bad = True
                break
            at = np.cumsum([0] + [len(r) for _, (_, r, _) in chunk[:-1]])
            lows, highs = np.minimum.reduceat(rows[:, 0], at), np.maximum.reduceat(rows[:, 0], at)
            sending.update({d: (lo, hi) for (d, _), lo, hi in zip(chunk, lows.tolist(), highs.tolist())})
        if bad:
            for digest, table in tables:
                self._check_exchange(mc, f"tile image {digest[:16]}", table, loaded, phases)
            raise AssertionError("an exchange table failed the joint check but not its own")
        return sending

    def _check_exchange(self, mc: dict, what: str, table: tuple, loaded: np.ndarray, phases: int) -> None:
        steps, rows, entry = table
        bad = steps >= phases
        bad[entry[self._outside(mc, rows, loaded)]] = True
        if bad.any():
            i = int(np.argmax(bad))
            e = [int(steps[i]), *rows[np.searchsorted(entry, i)].tolist()]
            self._fail(f"entry {i} {e} of the exchange table of {what} is past the run phases, a "
                       "loaded tile or tile memory")

    def _check_bindings(self, m: dict, side: str, used: set) -> None:
        mc = m["machine"]
        lo, hi = mc["sram_base"], mc["loader_limit"]
        names = set()
        for b in m[side]:
            name = b["name"]
            if name in names:
                self._fail(f"{side}: {name} is bound twice")
            names.add(name)
            nbytes = math.prod(b["shape"]) * DTYPES[b["dtype"]]
            if nbytes > m["tiles"] * mc["sram_end"]:
                self._fail(f"{side}: {name} of shape {b['shape']} is larger than the device's memory")
            for off, size, tile, addr in b["ranges"]:
                if tile >= m["tiles"] or addr < lo or addr + size > hi:
                    self._fail(f"binding of {name} to tile {tile} address {addr} is out of range")
                if tile not in used:
                    self._fail(f"binding of {name} to tile {tile}: that tile runs the idle image")
                if off + size > nbytes:
                    self._fail(f"binding of {name}: bytes [{off}, {off + size}) are past its {nbytes} bytes")

    def member(self, name: str) -> bytes:
        off, size, digest = self.by_name[name]
        return self.data[off:off + size]

    def _view(self, name: str) -> memoryview:
        """A member's bytes without a copy."""
        off, size, digest = self.by_name[name]
        return self._data_view[off:off + size]

    def tile_image(self, tile: int) -> tuple[dict, dict]:
        """The ``(header, arrays)`` of the image ``tile`` runs; its data segments' arrays
        (``data@<address>``) are memoryviews of the package's bytes (``bytes(view)`` for a copy)."""
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


def validated(data: bytes, where: str = "package", digest: str | None = None) -> Package:
    """``Package(data, where)``, validated once per process for the same bytes (the device run
    and the kernel measurement of one build read the same package): the last one is kept, found
    again by the bytes object itself or by their sha256 — ``digest`` if the caller knows it (the
    store verified it when it read them), else computed. Bytes given with their ``digest`` are
    ``content_verified``: their members' checksums are not hashed again."""
    found = _validated.get(where)
    if found is not None and (found[2] is data or (digest or _sha256(data)) == found[0]):
        _validated[where] = (found[0], found[1], data)      # these bytes are found by identity next time
        return found[1]
    pkg = Package(data, where, content_verified=digest is not None)
    _validated.clear()
    _validated[where] = (digest or _sha256(data), pkg, data)
    return pkg


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


_validated: dict = {}


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
from ..engine.engine import phase  # noqa: E402


@phase("write_package", inputs=("images", "objects", "host_program", "machine"),
       outputs=("package",), config=("name", "target.tile_count"))
def write_package_phase(ctx):
    from ..graph.artifacts import machine_of
    from ..engine.log import log
    m = machine_of(ctx)
    used = ctx.config["target"]["tile_count"]
    images = ctx.family("images")
    idle = images.pop("idle")
    tile_images = [images.get(str(t), idle) if t < used else idle for t in range(m["tiles"])]
    members = {f"images/{d}.img": ctx.engine.fetch(d) for d in sorted(set(tile_images))}
    objects = ctx.family("objects")
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
