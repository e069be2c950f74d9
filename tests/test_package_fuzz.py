"""Fuzzing the package reader: over 10,000 mutated packages, and every one is either a valid
package that ``summarize`` (``doit inspect``) describes, or a one-line PackageError.

Mutations reach past the checksums: the manifest, the host program and the tile images are
mutated as JSON (keys dropped, types changed, numbers nudged or made huge or negative, deep
nesting, duplicated or swapped entries, non-canonical encodings) or as binary (tile programs,
exchange tables, array tables), then re-signed: member digests, the member table, the manifest
checksum and the header's sizes are recomputed, so the check a mutation targets is the one that
has to catch it. A second base package runs a real compiled kernel, so that mutated packages the
reader accepts are also run on the simulator, which may refuse them only with a UserError.
"""
from __future__ import annotations

import collections
import copy
import hashlib
import json
import random
import re
import struct
import tempfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ipubuild import __version__
from ipubuild.engine import canonical
from ipubuild.builtin.simulator import Simulator
from ipubuild.errors import PackageError, UserError
from ipubuild.package import FORMAT_VERSION, HEADER, MAX_DEPTH, Package, summarize
from ipubuild.compiler.planning import codegen

from ipubuild.testing import compile_builtin
from test_package import CODE, DATA, MACHINE, MEM, header, make

DEEP = "@@deep@@"          # a value that the encoder replaces by deeply nested brackets
NASTY = [None, True, False, 0, -1, -16, 1, 7, 2 ** 31, 2 ** 32 + 5, 2 ** 63, 2 ** 64, 10 ** 40, 0.5, -2.5,
         1e300, "", "x", "f143", "kernels/x.so", "../../etc/passwd", "/abs", "a\nb", "\u00e9", "\0",
         "0" * 64, "f" * 64, "y" * 300, [], [0], [[0, 64, 0, DATA]], {}, {"phases": -1}, {"a": 1}, DEEP]
DELTAS = [-2 ** 32, -4096, -17, -16, -1, 1, 8, 16, 4096, 2 ** 20, 2 ** 32]
BAD_PATHS = ["../x", "/etc/passwd", "a//b", ".hidden", "", "kernels", "kernels/x.so/y", "host/program.json",
             "images", "a\\..\\b", "x" * 300, "k\u00e9"]


# building and signing packages -----------------------------------------------------------------
def encode(value, deep: int = 0, style: str = "canonical") -> bytes:
    """JSON bytes of ``value``: canonical, or deliberately not (``style``); ``DEEP`` strings
    become ``deep`` nested lists."""
    if style == "pretty":
        raw = json.dumps(value, indent=1, sort_keys=True).encode()
    elif style == "nan":
        raw = json.dumps(value, sort_keys=True, separators=(",", ":")).encode()
        raw = re.sub(rb":(\d+)([,}])", rb":NaN\2", raw, count=1)
    else:
        raw = canonical.dumps(value)
        if style == "duplicate_key":
            raw = raw.replace(b'{"compiler":', b'{"compiler":"0.0.0","compiler":', 1)
        elif style == "trailing":
            raw += b" "
        elif style == "latin1":
            raw = raw.replace(b"synthetic", b"synth\xe9tic")
    return raw.replace(b'"' + DEEP.encode() + b'"', b"[" * deep + b"]" * deep)


def sign(manifest, members: dict[str, bytes], tweak=None, deep: int = 0, style: str = "canonical") -> bytes:
    """The package bytes, laid out like write_package, with any manifest and member names,
    ``tweak(table)`` applied to the member table, and the header's checksum and sizes right."""
    names = sorted(members)
    base = HEADER.size
    while True:
        table, rel = [], 0
        for n in names:
            table.append([n, base + rel, len(members[n]), canonical.digest(members[n])])
            rel = -(-(rel + len(members[n])) // 16) * 16
        if tweak:
            tweak(table)
        raw = encode(dict(manifest, members=table) if isinstance(manifest, dict) else manifest, deep, style)
        start = -(-(HEADER.size + len(raw)) // 16) * 16
        if start <= base:
            break
        base = start + 64                                   # room for the offsets' longer digits
    body = bytearray(raw) + b"\0" * (base - HEADER.size - len(raw))
    rel = 0
    for n in names:
        body += b"\0" * (base + rel - HEADER.size - len(body)) + members[n]
        rel = -(-(rel + len(members[n])) // 16) * 16
    return header(raw, HEADER.size + len(body)) + bytes(body)


def image_bytes(header_value, arrays: dict[str, bytes], deep: int = 0, table_tweak=None) -> bytes:
    """A tile image (the ipubuild.graph.tensors layout) with this header and these arrays."""
    chunks = {"header": encode(header_value, deep), **arrays}
    table, off = [], 0
    for name in sorted(chunks):
        table.append([name, "|u1", [len(chunks[name])], off, len(chunks[name])])
        off += len(chunks[name])
    if table_tweak:
        table_tweak(table)
    head = encode(table, deep)
    return struct.pack("<I", len(head)) + head + b"".join(chunks[n] for n in sorted(chunks))


def copy_package(kernel: bytes):
    """(manifest, members) of a package that really runs: tile 0 copies its input buffer to
    its output buffer with the ``copy`` kernel (step 0), the exchange sends that to tile 1 (step
    1), whose buffer is the output; tile 2 is idle."""
    src, dst = DATA, DATA + 64
    prog0 = codegen.encode_program(["copy"], [[0, [[0, [src, dst, 1, 64, 64, 64]]]]])
    xch0 = codegen.encode_exchange([[1, 0, dst, 64, 1, DATA, 64, 1, 64]])
    img0 = codegen.build_image(
        {"program": prog0, "exchange": xch0, "addresses": {"program": CODE + 4096, "exchange": CODE + 4096 + len(prog0)}},
        {f"in@{src}": np.zeros(16, np.float32), f"out@{dst}": np.zeros(16, np.float32)},
        [["copy", CODE, 4096, canonical.digest(kernel)]])
    prog1, xch1 = codegen.encode_program([], []), codegen.encode_exchange([])
    img1 = codegen.build_image({"program": prog1, "exchange": xch1,
                                "addresses": {"program": CODE, "exchange": CODE + len(prog1)}},
                               {f"recv@{DATA}": np.zeros(16, np.float32)}, [])
    idle = codegen.build_image({}, {}, [])
    d0, d1, di = (canonical.digest(b) for b in (img0, img1, idle))
    inputs = [{"name": "in", "dtype": "f32", "shape": [16], "scale_exp": 0, "ranges": [[0, 64, 0, src]]}]
    outputs = [{"name": "out", "dtype": "f32", "shape": [4, 4], "scale_exp": 0, "ranges": [[0, 64, 1, DATA]]}]
    program = canonical.dumps({"initialize": {"phases": 1}, "run": {"phases": 2}, "steps": ["copy", "send"],
                               "paired": [False, True], "horizons": [0, 7], "inputs": inputs, "outputs": outputs})
    manifest = {
        "format": FORMAT_VERSION, "compiler": __version__, "target": "copy", "tiles": 3, "used_tiles": 2,
        "idle_image": di, "tile_images": [d0, d1, di],
        "machine": {**MACHINE, "tiles": 3, "sram_base": MEM["sram_base"], "sram_end": MEM["sram_end"],
                    "executable_end": MEM["executable_end"], "loader_limit": MEM["loader_limit"]},
        "kernels": {"copy": canonical.digest(kernel)},
        "host": {"initialize": {"phases": 1}, "run": {"phases": 2}, "program": canonical.digest(program)},
        "inputs": inputs, "outputs": outputs}
    members = {f"images/{d0}.img": img0, f"images/{d1}.img": img1, f"images/{di}.img": idle,
               "kernels/copy.so": kernel, "host/program.json": program}
    return manifest, members


@pytest.fixture(scope="module")
def copy_kernel(tmp_path_factory) -> bytes:
    return compile_builtin("copy", tmp_path_factory.mktemp("kernels")).read_bytes()


@pytest.fixture(scope="module")
def bases(copy_kernel):
    """The packages mutations start from, as canonical JSON of (manifest, members) so that each
    example gets a fresh copy cheaply."""
    out = []
    for manifest, members in (make(), copy_package(copy_kernel)):
        Package(sign(manifest, members))                     # both are valid to begin with
        out.append((canonical.dumps(manifest), members))
    return out


# the oracle ------------------------------------------------------------------------------------
def judge(data: bytes) -> str:
    """'accepted' or the kind of PackageError; any other outcome fails the test."""
    try:
        pkg = Package(data, "fuzz.ipuexe")
    except PackageError as exc:
        msg = str(exc)
        assert "\n" not in msg and "\r" not in msg and msg.startswith("fuzz.ipuexe: ") and exc.message, msg
        head, invalid, path = exc.message.partition("not valid: ")
        return re.sub(r"[0-9a-f]{16}|\d+|'[^']*'", "#", head + invalid + path.split(" is ")[0].split(" has ")[0])
    lines = summarize(pkg)
    assert lines and all(isinstance(x, str) and "\n" not in x for x in lines)
    for t in range(pkg.manifest["tiles"]):
        pkg.tile_image(t)
    for name in pkg.manifest["kernels"]:
        pkg.kernel_object(name)
    return "accepted"


# mutations: each takes a random.Random seeded by hypothesis (one draw per example keeps 10,000
# examples fast; hypothesis still chooses the seeds, replays failures and shrinks them) ---------
def _paths(value, parent=None, key=None, out=None) -> list:
    """Every (container, key) in a JSON value, the root as ``(None, None)``."""
    out = [] if out is None else out
    out.append((parent, key))
    if isinstance(value, dict):
        for k in value:
            _paths(value[k], value, k, out)
    elif isinstance(value, list):
        for i in range(len(value)):
            _paths(value[i], value, i, out)
    return out


def mutate_json(rnd, doc, ints_only: bool = False):
    """One structural mutation of a JSON document; returns the (maybe replaced) document."""
    paths = _paths(doc)
    parent, key = rnd.choice(paths)
    value = doc if parent is None else parent[key]
    op = rnd.choice(["nudge", "nudge", "nasty", "delete", "duplicate", "swap", "extra", "wrap"])
    if ints_only and op not in ("nudge", "delete", "duplicate", "swap"):
        op = "nudge"
    if op == "nudge" and type(value) is int:
        new = rnd.choice([value + d for d in DELTAS] + [-value, 2 * value, 0])
    elif op in ("nudge", "nasty"):
        new = copy.deepcopy(rnd.choice(NASTY))
    elif op == "delete" and parent is not None:
        del parent[key]
        return doc
    elif op == "duplicate" and isinstance(parent, list):
        parent.insert(key, copy.deepcopy(value))
        return doc
    elif op == "swap":
        other_parent, other_key = rnd.choice(paths)
        new = copy.deepcopy(doc if other_parent is None else other_parent[other_key])
    elif op == "extra" and isinstance(value, dict):
        value[rnd.choice(["extra", "members", "x\ny"])] = 1
        return doc
    elif op == "extra" and isinstance(value, list):
        value.append(copy.deepcopy(value[0]) if value else 0)
        return doc
    else:
        new = [value]
    if ints_only:
        new = new & 0xFFFFFFFF if type(new) is int else 0
    if parent is None:
        return new
    parent[key] = new
    return doc


def deep_level(rnd) -> int:
    return rnd.choice([0, 0, 0, 0, 0, 1, MAX_DEPTH - 3, MAX_DEPTH + 1, 5000, 200_000])


def replace_member(manifest, members, old_name, new_bytes, kind):
    """Put ``new_bytes`` where member ``old_name`` was, renamed and referenced by its new digest."""
    old = members.pop(old_name)
    d_old, d_new = canonical.digest(old), canonical.digest(new_bytes)
    members[old_name.replace(d_old, d_new)] = new_bytes
    if kind == "image":
        manifest["tile_images"] = [d_new if d == d_old else d for d in manifest["tile_images"]]
        if manifest["idle_image"] == d_old:
            manifest["idle_image"] = d_new
    elif kind == "host":
        manifest["host"]["program"] = d_new
    else:
        manifest["kernels"] = {k: d_new if d == d_old else d for k, d in manifest["kernels"].items()}


def mutate_program(rnd, raw: bytes) -> bytes:
    names, steps = codegen.decode_program(raw)
    op = rnd.choice(["index", "step", "name", "args", "truncate", "extend", "count"])
    steps = [[s, [[k, list(a)] for k, a in v]] for s, v in steps]
    if op == "index" and steps:
        steps[0][1][0][0] = rnd.choice([1, 5, 65535])
    elif op == "step" and steps:
        steps[-1][0] = rnd.choice([1, 2, 7, 2 ** 32 - 1])
        steps.append([0, []])
    elif op == "name":
        names = names + ["y"] if rnd.random() < 0.5 or not names else ["x\n"] + names[1:]
    elif op == "args" and steps:
        steps[0][1][0][1].append(7)
    raw = codegen.encode_program(names, steps)
    if op == "truncate":
        raw = raw[:rnd.randrange(len(raw))]
    elif op == "extend":
        raw += b"\0" * rnd.randint(1, 9)
    elif op == "count":
        raw = raw[:8] + struct.pack("<II", rnd.choice([0, 1, 2 ** 32 - 1]), rnd.choice([0, 1, 3, 2 ** 31])) + raw[16:]
    return raw


def mutate_exchange(rnd, raw: bytes) -> bytes:
    entries = codegen.decode_exchange(raw)
    op = rnd.choice(["json", "json", "json", "truncate", "count"])
    if op == "json":
        entries = mutate_json(rnd, entries, ints_only=True)
        if not (isinstance(entries, list) and all(isinstance(e, list) and len(e) == 9 for e in entries)):
            entries = []
        return codegen.encode_exchange(entries)
    if op == "truncate":
        return raw[:rnd.randrange(len(raw))]
    return raw[:4] + struct.pack("<I", rnd.choice([0, 2, 2 ** 32 - 1])) + raw[8:]


def mutate_image(rnd, manifest, members, program=True):
    """Mutate a tile image: its header, tile program (unless not ``program``), exchange table,
    data, array table or raw bytes; segment sizes and digests usually follow the new arrays."""
    name = rnd.choice(sorted(n for n in members if n.startswith("images/")))
    head, arrays = codegen.read_image(members[name])
    ops = ["header", "header", "exchange", "data"] + (["program", "table", "bytes"] if program else [])
    op = rnd.choice(ops)
    deep, tweak = 0, None
    if op == "program" and "program" in arrays:
        arrays["program"] = mutate_program(rnd, arrays["program"])
    elif op == "exchange" and "exchange" in arrays:
        arrays["exchange"] = mutate_exchange(rnd, arrays["exchange"])
    elif op == "data" and any(k.startswith("data@") for k in arrays):
        key = rnd.choice(sorted(k for k in arrays if k.startswith("data@")))
        blob = bytearray(arrays[key])
        blob[rnd.randrange(len(blob))] ^= 0x5A
        arrays[key] = bytes(blob) + (b"\0\0\0\0" if rnd.random() < 0.3 and program else b"")
    if rnd.random() < 0.9 or not program:                    # usually: segments name the new blobs
        for seg in head["segments"]:
            key = seg[0] if seg[0] in ("program", "exchange") else f"data@{seg[2]}"
            if key in arrays and seg[0] != "kernel":
                seg[3], seg[4] = len(arrays[key]), canonical.digest(arrays[key])
    if op == "header":
        head = mutate_json(rnd, head)
        deep = deep_level(rnd) if program else 0
    elif op == "table":
        picks = [rnd.randrange(100) for _ in range(rnd.randint(1, 2))]

        def tweak(table):
            for p in picks:
                parent, key = _paths(table)[p % len(_paths(table))]
                if parent is not None:
                    v = parent[key]
                    parent[key] = v + 1 if type(v) is int else "<f4" if v == "|u1" else [] if isinstance(v, list) else 0
    blob = image_bytes(head, arrays, deep, tweak)
    if op == "bytes":
        blob = bytearray(blob)
        blob[rnd.randrange(len(blob))] ^= rnd.randint(1, 255)
        blob = bytes(blob[:rnd.randint(1, len(blob))])
    replace_member(manifest, members, name, blob, "image")


def mutate_host(rnd, manifest, members, deep=True):
    program = mutate_json(rnd, canonical.loads(members["host/program.json"]))
    replace_member(manifest, members, "host/program.json", encode(program, deep_level(rnd) if deep else 0), "host")


def mutate_kernel(rnd, manifest, members):
    name = sorted(n for n in members if n.startswith("kernels/"))[0]
    blob = members[name] + b"\0" if rnd.random() < 0.5 else members[name][:-1]
    replace_member(manifest, members, name, blob, "kernel")
    if rnd.random() < 0.5:                                   # the images still name the old object
        return
    for image_name in [n for n in members if n.startswith("images/")]:
        head, arrays = codegen.read_image(members[image_name])
        for seg in head["segments"]:
            if seg[0] == "kernel" and seg[1] == name[len("kernels/"):-len(".so")]:
                seg[4] = canonical.digest(blob)
        replace_member(manifest, members, image_name, image_bytes(head, arrays), "image")


def table_tweak(rnd):
    """A deterministic edit of the member table, chosen now and applied at signing."""
    op = rnd.choice(["name", "offset", "size", "digest", "duplicate", "drop", "arity"])
    i, delta, path = rnd.randrange(100), rnd.choice(DELTAS + [-2 ** 70, 2 ** 64]), rnd.choice(BAD_PATHS)

    def tweak(table):
        e = table[i % len(table)]
        if op == "name":
            e[0] = path
        elif op in ("offset", "size"):
            e[1 if op == "offset" else 2] += delta
        elif op == "digest":
            e[3] = table[(i + 1) % len(table)][3]
        elif op == "duplicate":
            table.append(list(e))
        elif op == "drop":
            table.remove(e)
        else:
            e.append(0)
    return tweak


def mutate_bindings(rnd, manifest, members):
    """Mutate the inputs and outputs in the manifest and the host program alike."""
    both = mutate_json(rnd, {"inputs": manifest["inputs"], "outputs": manifest["outputs"]})
    program = canonical.loads(members["host/program.json"])
    for side in ("inputs", "outputs"):
        manifest[side] = program[side] = both.get(side, "missing") if isinstance(both, dict) else both
    replace_member(manifest, members, "host/program.json", canonical.dumps(program), "host")


def mutate_phases(rnd, manifest, members):
    """Change the number of run phases in the manifest and the host program alike."""
    n = rnd.choice([0, 1, 2, 3, 40])
    program = canonical.loads(members["host/program.json"])
    program["run"] = manifest["host"]["run"] = {"phases": n}
    program["steps"], program["paired"] = [f"s{i}" for i in range(n)], [i % 2 == 1 for i in range(n)]
    program["horizons"] = [i for i in range(n)]
    replace_member(manifest, members, "host/program.json", canonical.dumps(program), "host")


MEMBER_EDITS = {"image": mutate_image, "host": mutate_host, "kernel": mutate_kernel,
                "bindings": mutate_bindings, "phases": mutate_phases}
WHERE = ["manifest"] * 3 + ["image"] * 3 + ["host", "bindings", "phases", "kernel", "table", "style"]
SEED = st.integers(0, 2 ** 64 - 1)


def mutated(rnd, bases) -> bytes:
    """A base package after one to three mutations, signed."""
    raw_manifest, members = rnd.choice(bases)
    manifest, members = canonical.loads(raw_manifest), dict(members)
    tweak, deep, style = None, 0, "canonical"
    for _ in range(rnd.choice([1, 1, 2, 3])):
        where = rnd.choice(WHERE)
        if where == "manifest":
            manifest = mutate_json(rnd, manifest)
            deep = max(deep, deep_level(rnd))
        elif where in MEMBER_EDITS:
            if not isinstance(manifest, dict) or not all(
                    isinstance(manifest.get(k), t) for k, t in (("tile_images", list), ("idle_image", str),
                                                                  ("host", dict), ("kernels", dict))):
                continue                                    # member edits need the references intact
            try:
                MEMBER_EDITS[where](rnd, manifest, members)
            except (ValueError, KeyError, IndexError, TypeError, AttributeError, struct.error, RecursionError):
                continue                                    # an earlier edit left nothing to decode
        elif where == "table":
            tweak = table_tweak(rnd)
        else:
            style = rnd.choice(["pretty", "nan", "duplicate_key", "trailing", "latin1"])
    return sign(manifest, members, tweak, deep, style)


# the fuzz tests --------------------------------------------------------------------------------
FUZZ = settings(deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                                       HealthCheck.filter_too_much])
STRUCTURAL = 8000


def test_fuzz_structural_mutations(bases):
    seen = collections.Counter()

    @settings(FUZZ, max_examples=STRUCTURAL)
    @given(SEED)
    def run(seed):
        seen[judge(mutated(random.Random(seed), bases))] += 1
    run()
    assert sum(seen.values()) >= STRUCTURAL
    # the mutations get past the checksums to the schema and the consistency checks
    assert seen["accepted"] >= STRUCTURAL // 50, seen
    for reason in ["manifest is not valid: tile_images", "manifest is not valid: machine.", "manifest nests deeper than",
                   "manifest is not in canonical form", "host program is not valid: ", "host program: ",
                   "tile image # is not valid: segments", "the program of tile image #", "entry #",
                   "bad checksum of data segment", "manifest is not valid: members", "tile image # array table"]:
        assert any(k.startswith(reason) for k in seen), (reason, sorted(seen))
    assert len(seen) >= 80, sorted(seen)


def raw_edits(rnd, valid: bytes) -> bytes:
    """Byte flips in the header, the manifest (often with its checksum recomputed) or anywhere;
    header fields set to edge values; truncation and extension."""
    data = bytearray(valid)
    moff, msize = struct.unpack_from("<QQ", valid, 32)
    for _ in range(rnd.choice([0, 1, 1, 2, 4])):
        lo, hi = rnd.choice([(0, HEADER.size), (moff, moff + msize), (0, len(data))])
        data[rnd.randrange(lo, hi)] ^= rnd.randint(1, 255)
    if rnd.random() < 0.5:
        data[48:80] = hashlib.sha256(data[moff:moff + msize]).digest()
    if rnd.random() < 0.3:
        offset, fmt = rnd.choice([(8, "<I"), (12, "<I"), (32, "<Q"), (40, "<Q"), (80, "<Q")])
        value = rnd.choice([0, 1, 95, 96, 97, len(valid), len(valid) + 16, 2 ** 32 - 1, 2 ** 63])
        if value < 2 ** (8 * struct.calcsize(fmt)):
            struct.pack_into(fmt, data, offset, value)
    cut = rnd.choice([None, None, None, 0, 1, HEADER.size - 1, HEADER.size, len(data) // 2, len(data) - 1])
    if cut is not None:
        data = data[:cut]
    if rnd.random() < 0.2:
        data += rnd.randbytes(rnd.randint(1, 64))
    return bytes(data)


RAW = 2500


def test_fuzz_raw_bytes(bases):
    valid = [sign(canonical.loads(m), members) for m, members in bases]
    seen = collections.Counter()

    @settings(FUZZ, max_examples=RAW)
    @given(SEED)
    def run(seed):
        rnd = random.Random(seed)
        seen[judge(raw_edits(rnd, rnd.choice(valid)))] += 1
    run()
    assert sum(seen.values()) >= RAW and seen["manifest is not valid JSON"] and len(seen) >= 8, seen


# the four failures of the outside attack, and what the simulator makes of accepted packages ------
def _signed(manifest_edit=None, members_edit=None, deep=0):
    manifest, members = make()
    if manifest_edit:
        manifest_edit(manifest)
    if members_edit:
        members_edit(manifest, members)
    return sign(manifest, members, deep=deep)


def _reject(data: bytes, pattern: str):
    with pytest.raises(PackageError) as info:
        Package(data, "pkg.ipuexe")
    assert "\n" not in str(info.value) and re.search(pattern, info.value.message), str(info.value)


@pytest.mark.parametrize("depth", [MAX_DEPTH + 1, 10_000, 1_000_000])
def test_deeply_nested_manifest_is_refused_before_parsing(depth):
    _reject(_signed(lambda m: m.update(target=DEEP), deep=depth),
            rf"^manifest nests deeper than {MAX_DEPTH} levels$")
    _reject(_signed(lambda m: m["machine"].update(extra=DEEP), deep=depth),     # inside a free-form field
            rf"^manifest nests deeper than {MAX_DEPTH} levels$")


def test_deeply_nested_host_program_and_tile_image():
    def host(manifest, members):
        replace_member(manifest, members, "host/program.json", encode({"steps": DEEP}, 100_000), "host")
    _reject(_signed(members_edit=host), rf"^host program nests deeper than {MAX_DEPTH} levels$")

    def image(manifest, members):
        name = f"images/{manifest['tile_images'][0]}.img"
        replace_member(manifest, members, name, image_bytes({"segments": DEEP}, {}, 100_000), "image")
    _reject(_signed(members_edit=image), rf"^tile image [0-9a-f]{{16}} nests deeper than {MAX_DEPTH} levels$")


def test_manifest_without_idle_image():
    _reject(_signed(lambda m: m.pop("idle_image")), r"^manifest is not valid: idle_image is missing$")


def test_host_that_is_a_number():
    _reject(_signed(lambda m: m.update(host=5)), r"^manifest is not valid: host is 5, expected an object$")


def test_data_segment_of_negative_size():
    def negative(manifest, members):
        name = f"images/{manifest['tile_images'][0]}.img"
        head, arrays = codegen.read_image(members[name])
        seg = next(s for s in head["segments"] if s[0] == "data")
        seg[3] = -16
        replace_member(manifest, members, name, image_bytes(head, arrays), "image")
    _reject(_signed(members_edit=negative),
            r"^tile image [0-9a-f]{16} is not valid: segments\[3\]\[3\] is -16, expected an integer in \[0, \d+\]$")


def test_segment_size_that_is_not_its_bytes():
    def grow(manifest, members):
        name = f"images/{manifest['tile_images'][0]}.img"
        head, arrays = codegen.read_image(members[name])
        next(s for s in head["segments"] if s[0] == "data")[3] += 16
        replace_member(manifest, members, name, image_bytes(head, arrays), "image")
    _reject(_signed(members_edit=grow), r"^data segment weights of tile image [0-9a-f]{16} holds 128 bytes, not 144$")


def test_non_canonical_manifest():
    manifest, members = make()
    for style in ("pretty", "duplicate_key", "trailing"):
        _reject(sign(manifest, members, style=style), r"^manifest is not in canonical form$")
    _reject(sign(manifest, members, style="nan"), r"^manifest is not (valid|in canonical form)")
    _reject(sign(manifest, members, style="latin1"), r"^manifest is not valid JSON$")


def test_host_program_must_agree_with_the_manifest():
    _reject(sign(*make(host={"steps": []})), r"^host program: 0 steps for 1 run phases$")
    _reject(sign(*make(host={"run": {"phases": 2}})), r"^host program: run differs from the manifest's$")
    _reject(sign(*make(host={"paired": [1]})), r"^host program is not valid: paired\[0\] is 1, expected true or false$")


def _run(data: bytes, inputs: dict, tmp: Path):
    with tempfile.TemporaryDirectory(dir=tmp) as work:
        return Simulator().run(data, inputs, Path(work))


@pytest.fixture(scope="module")
def device_locks(tmp_path_factory):
    mp = pytest.MonkeyPatch()
    path = tmp_path_factory.mktemp("locks")
    mp.setenv("IPUBUILD_DEVICE_LOCK_DIR", str(path))
    yield path
    mp.undo()


def test_simulator_runs_the_copy_package(copy_kernel, device_locks):
    x = np.arange(16, dtype=np.float32)
    run = _run(sign(*copy_package(copy_kernel)), {"in": x}, device_locks)
    assert run.outputs["out"].tolist() == x.reshape(4, 4).tolist()
    assert [s["name"] for s in run.profile["steps"]] == ["copy", "send"] and run.profile["ok"]


def test_simulator_refuses_wrong_inputs_and_unknown_kernels(copy_kernel, device_locks):
    data = sign(*copy_package(copy_kernel))
    with pytest.raises(UserError, match=r"^package: it binds an input in the target does not have$"):
        _run(data, {}, device_locks)
    with pytest.raises(UserError, match=r"^package: input in has 8 elements, the package expects shape \[16\]$"):
        _run(data, {"in": np.zeros(8, np.float32)}, device_locks)
    manifest, members = copy_package(copy_kernel)           # the copy kernel under a name no plugin declares
    for name in [n for n in members if n.startswith("images/")]:
        head, arrays = codegen.read_image(members[name])
        for seg in head["segments"]:
            if seg[0] == "kernel":
                seg[1] = "nope"
        if "program" in arrays:
            names, steps = codegen.decode_program(arrays["program"])
            arrays["program"] = codegen.encode_program(["nope" if n == "copy" else n for n in names], steps)
            next(s for s in head["segments"] if s[0] == "program")[4] = canonical.digest(arrays["program"])
        replace_member(manifest, members, name, image_bytes(head, arrays), "image")
    manifest["kernels"] = {"nope": manifest["kernels"]["copy"]}
    with pytest.raises(UserError, match=r"^kernel nope: no installed plugin declares this kernel variant"):
        _run(sign(manifest, members), {"in": np.zeros(16, np.float32)}, device_locks)


def test_simulator_on_mutated_packages(copy_kernel, device_locks):
    """Every mutated package the reader accepts runs on the simulator, or is refused with a
    one-line UserError. Tile programs are left alone: their vertex arguments are pointers the
    native kernel follows, which no reader can judge (a package is a program: run packages you
    trust); everything else the simulator reads is mutated."""
    manifest, members = copy_package(copy_kernel)
    raw_manifest = canonical.dumps(manifest)
    x = np.arange(16, dtype=np.float32)
    seen = collections.Counter()

    @settings(FUZZ, max_examples=400)
    @given(st.sampled_from(["manifest", "host", "image", "bindings", "phases"]), SEED)
    def run(where, seed):
        rnd = random.Random(seed)
        manifest, mutable = canonical.loads(raw_manifest), dict(members)
        if where == "manifest":
            manifest = mutate_json(rnd, manifest)
        elif where == "host":
            mutate_host(rnd, manifest, mutable, deep=False)
        elif where == "image":
            mutate_image(rnd, manifest, mutable, program=False)
        else:
            MEMBER_EDITS[where](rnd, manifest, mutable)
        package = sign(manifest, mutable)
        try:
            Package(package)
        except PackageError:
            seen["rejected"] += 1
            return
        try:
            result = _run(package, {"in": x}, device_locks)
        except UserError as exc:
            assert "\n" not in str(exc)
            seen["refused by the simulator"] += 1
            return
        assert set(result.outputs) == {b["name"] for b in manifest["outputs"]}
        seen["ran"] += 1
    run()
    assert seen["ran"] >= 40 and seen["rejected"] >= 100 and seen["refused by the simulator"] >= 1, seen
