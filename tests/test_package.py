"""The application package (ipubuild/package.py): round trip, determinism, and rejection of corrupt
or hostile packages with one-line PackageErrors."""
from __future__ import annotations

import copy
import hashlib
import os
import struct
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ipubuild import __version__
from ipubuild.engine import canonical
from ipubuild.errors import PackageError, UserError
from ipubuild.compiler.machine import load_machine
from ipubuild.package import FORMAT_VERSION, HEADER, MAGIC, Package, read_package, write_package
from ipubuild.compiler.planning import codegen
from ipubuild.compiler.planning.storage import tile_ranges

MACHINE = load_machine("ipu21")
MEM = MACHINE["memory"]
CODE = tile_ranges(MACHINE, 0)["code_address"]      # first code address
DATA = 393216                                         # a data address in the available ranges
KERNEL = b"\x7fELF-fake-kernel-object" * 5


def _image(kernel_addr=CODE, kernel_size=4096, program_addr=None, exchange_addr=None, data=None,
           kernel_digest=None, exchange=None):
    prog = codegen.encode_program(["x"], [[0, [[0, [DATA, 3, 7]]]]])
    xch = codegen.encode_exchange(exchange or [[0, 0, DATA, 16, 0, DATA + 4096, 16, 1, 16]])
    program_addr = kernel_addr + kernel_size if program_addr is None else program_addr
    exchange_addr = program_addr + len(prog) if exchange_addr is None else exchange_addr
    code = {"program": prog, "exchange": xch,
            "addresses": {"program": program_addr, "exchange": exchange_addr}}
    if data is None:
        data = {f"weights@{DATA}": np.arange(32, dtype=np.float32),
                f"bias@{DATA + 4096}": np.ones(4, np.float32)}
    kd = canonical.digest(KERNEL) if kernel_digest is None else kernel_digest
    return codegen.build_image(code, data, [["x", kernel_addr, kernel_size, kd]])


def make(image0=None, *, tiles=2, extra_members=None, host=None, **over):
    """(manifest, members) of a small valid package: tile 0 runs kernel x, tile 1 is idle.
    ``over`` replaces manifest fields (the host program follows its inputs and outputs);
    ``host`` replaces host program fields."""
    img0 = _image() if image0 is None else image0
    idle = codegen.build_image({}, {}, [])
    d0, d1 = canonical.digest(img0), canonical.digest(idle)
    manifest = {
        "format": FORMAT_VERSION, "compiler": __version__, "target": "synthetic", "tiles": tiles,
        "used_tiles": 1, "idle_image": d1, "tile_images": ([d0] + [d1] * (tiles - 1)),
        "machine": {**MACHINE, "tiles": tiles, "sram_base": MEM["sram_base"], "sram_end": MEM["sram_end"],
                    "executable_end": MEM["executable_end"], "loader_limit": MEM["loader_limit"]},
        "kernels": {"x": canonical.digest(KERNEL)},
        "host": {"initialize": {"phases": 1}, "run": {"phases": 1}},
        "inputs": [{"name": "in", "dtype": "f32", "shape": [16], "scale_exp": 0,
                    "ranges": [[0, 64, 0, DATA + 8192]]}],
        "outputs": [{"name": "out", "dtype": "f32", "shape": [4], "scale_exp": 0,
                     "ranges": [[0, 16, 0, DATA + 8192 + 64]]}],
    }
    manifest.update(over)
    program = canonical.dumps({"initialize": {"phases": 1}, "run": {"phases": 1}, "steps": ["step0"],
                               "paired": [False], "horizons": [0], "inputs": manifest["inputs"], "outputs": manifest["outputs"],
                               **(host or {})})
    if isinstance(manifest.get("host"), dict):
        manifest["host"] = {**manifest["host"], "program": canonical.digest(program)}
    members = {f"images/{d0}.img": img0, f"images/{d1}.img": idle, "kernels/x.so": KERNEL,
               "host/program.json": program}
    members.update(extra_members or {})
    return manifest, members


@pytest.fixture(scope="module")
def valid():
    manifest, members = make()
    return manifest, members, write_package(manifest, members)


def header(raw_manifest: bytes, total: int, *, magic=MAGIC, version=FORMAT_VERSION, moff=HEADER.size):
    return HEADER.pack(magic, version, 0, __version__.encode().ljust(16, b"\0"), moff, len(raw_manifest),
                       hashlib.sha256(raw_manifest).digest(), total, b"\0" * 8)


def forge(manifest: dict, members: dict[str, bytes], tweak=None) -> bytes:
    """A package laid out like write_package but with any member names, and ``tweak(table)``
    applied to the member table ``[[name, off, size, digest]]``; the manifest checksum and the
    header's sizes are recomputed, so only the targeted check can fire."""
    names = sorted(members)
    probe = canonical.dumps(dict(manifest, members=[[n, 10 ** 9, len(members[n]), "0" * 64] for n in names]))
    base = -(-(HEADER.size + len(probe) + 1024) // 16) * 16
    table, rel = [], 0
    for n in names:
        table.append([n, base + rel, len(members[n]), canonical.digest(members[n])])
        rel = -(-(rel + len(members[n])) // 16) * 16
    if tweak:
        tweak(table)
    raw = canonical.dumps(dict(manifest, members=table))
    assert HEADER.size + len(raw) <= base
    body = bytearray(raw) + b"\0" * (base - HEADER.size - len(raw))
    for n in names:
        off = base + sum(-(-len(members[m]) // 16) * 16 for m in names[:names.index(n)])
        body += b"\0" * (off - HEADER.size - len(body)) + members[n]
    return header(raw, HEADER.size + len(body)) + bytes(body)


def reject(data: bytes, pattern: str) -> str:
    with pytest.raises(PackageError) as info:
        Package(data, where="pkg.ipuexe")
    msg = str(info.value)
    assert "\n" not in msg and msg.startswith("pkg.ipuexe: "), msg
    assert isinstance(info.value, UserError)
    import re
    assert re.search(pattern, info.value.message), msg
    return msg


def parts(data: bytes):
    magic, version, flags, compiler, moff, msize, mhash, total, _ = HEADER.unpack_from(data)
    return moff, msize, canonical.loads(data[moff:moff + msize])


# round trip and determinism ------------------------------------------------------------------
def test_round_trip(valid, tmp_path):
    manifest, members, data = valid
    assert data[:8] == MAGIC
    pkg = Package(data)
    m = dict(pkg.manifest)
    table = m.pop("members")
    assert m == manifest
    assert sorted(e[0] for e in table) == sorted(members)
    for name, off, size, digest in table:
        assert off % 16 == 0 and digest == canonical.digest(members[name])
        assert pkg.member(name) == members[name]
    assert pkg.compiler == __version__
    assert pkg.kernel_object("x") == KERNEL
    head, blobs = pkg.tile_image(0)
    assert [s[0] for s in head["segments"]] == ["kernel", "program", "exchange", "data", "data"]
    assert codegen.decode_program(blobs["program"]) == (["x"], [(0, [(0, [DATA, 3, 7])])])
    assert codegen.decode_exchange(blobs["exchange"]) == [[0, 0, DATA, 16, 0, DATA + 4096, 16, 1, 16]]
    assert np.frombuffer(blobs[f"data@{DATA}"], np.float32).tolist() == list(range(32))
    assert pkg.tile_image(1)[0]["segments"] == []
    f = tmp_path / "app.ipuexe"
    f.write_bytes(data)
    assert read_package(f).manifest == pkg.manifest
    with pytest.raises(PackageError, match="cannot read"):
        read_package(tmp_path / "missing.ipuexe")


def test_deterministic_bytes(valid):
    manifest, members, data = valid
    m2, mem2 = make()
    assert write_package(m2, mem2) == data
    reordered = dict(reversed(list(mem2.items())))
    assert write_package(copy.deepcopy(m2), reordered) == data
    m3, mem3 = make(target="other")
    assert write_package(m3, mem3) != data


def test_write_package_refuses_unsafe_names(valid):
    manifest, members, _ = valid
    for bad in ["../x", "/etc/passwd", "a/../../b", "a//b", ".hidden", ""]:
        with pytest.raises(ValueError):
            write_package(manifest, {**members, bad: b"x"})


def test_forge_helper_builds_a_valid_package(valid):
    manifest, members, _ = valid
    Package(forge(manifest, members))


# corrupt packages ----------------------------------------------------------------------------
@pytest.mark.parametrize("cut", [0, 1, 8, 50, 95])
def test_truncated_inside_header(valid, cut):
    reject(valid[2][:cut], rf"truncated: {cut} bytes is shorter than the 96-byte header")


@pytest.mark.parametrize("frac", [0.0, 0.1, 0.5, 0.9, 0.999])
def test_truncated_after_header(valid, frac):
    data = valid[2]
    cut = HEADER.size + int((len(data) - HEADER.size - 1) * frac)
    reject(data[:cut], rf"truncated or padded: header says {len(data)} bytes, file has {cut}")


def test_padded(valid):
    reject(valid[2] + b"\0" * 16, "truncated or padded")


def test_wrong_magic(valid):
    data = bytearray(valid[2])
    data[0:8] = b"IPUEXE\n\n"
    reject(bytes(data), r"wrong magic")


@pytest.mark.parametrize("version", [0, 1, 2, 4, 0xFFFFFFFF])
def test_unknown_version(valid, version):
    data = bytearray(valid[2])
    struct.pack_into("<I", data, 8, version)
    reject(bytes(data), rf"unknown format version {version}; this reader knows 3")


def test_manifest_outside_file(valid):
    data = bytearray(valid[2])
    struct.pack_into("<Q", data, 40, len(data))
    reject(bytes(data), "manifest lies outside the file")
    data = bytearray(valid[2])
    struct.pack_into("<Q", data, 32, 112)
    reject(bytes(data), "manifest lies outside the file")


def test_bad_manifest_checksum(valid):
    data = bytearray(valid[2])
    moff, msize, _ = parts(valid[2])
    data[moff + msize // 2] ^= 0x01
    reject(bytes(data), "^bad checksum of the manifest$")
    data = bytearray(valid[2])
    data[60] ^= 0x80                                   # inside the stored sha256
    reject(bytes(data), "^bad checksum of the manifest$")


def test_manifest_not_json(valid):
    raw = b"{not json"
    data = header(raw, HEADER.size + 16) + raw + b"\0" * (16 - len(raw))
    reject(data, "manifest is not valid")
    raw = canonical.dumps({"no": "members"})
    data = header(raw, HEADER.size + len(raw)) + raw
    reject(data, "manifest is not valid")


@pytest.mark.parametrize("member", ["kernels/x.so", "host/program.json", "images"])
def test_bad_member_checksum(valid, member):
    manifest, members, data = valid
    _, _, m = parts(data)
    name, off, size, _ = next(e for e in m["members"] if e[0].startswith(member))
    bad = bytearray(data)
    bad[off + size - 1] ^= 0x40
    reject(bytes(bad), rf"^bad checksum of member {name}$")


def test_bytes_verified_by_their_content_address_are_not_hashed_again(valid):
    """A build's device run reads the package from the store, which verified its sha256: the
    members' checksums are not hashed again (ViT-B/16's 426 MB of members and data segments,
    twice). Only hashing is skipped: a structural fault is still refused."""
    manifest, members, data = valid
    from ipubuild.device.package import validated
    _, _, m = parts(data)
    name, off, size, _ = next(e for e in m["members"] if e[0].startswith("kernels/x.so"))
    flipped = bytearray(data)
    flipped[off + size - 1] ^= 0x40          # bytes no store would hand out under this digest
    pkg = validated(bytes(flipped), "verified", canonical.digest(bytes(flipped)))
    assert pkg.member(name) != KERNEL
    with pytest.raises(PackageError, match="bad checksum of member"):
        validated(bytes(flipped), "unverified")
    with pytest.raises(PackageError, match="truncated"):
        validated(data[:-1], "verified", canonical.digest(data[:-1]))


def test_overlapping_members(valid):
    manifest, members, _ = valid

    def tweak(table):
        k = next(e for e in table if e[0] == "kernels/x.so")
        h = next(e for e in table if e[0] == "host/program.json")
        k[1] = h[1] + 8
    reject(forge(manifest, members, tweak), r"^members .* and .* overlap$")


@pytest.mark.parametrize("where", ["past_end", "inside_manifest", "negative"])
def test_member_outside_file(valid, where):
    manifest, members, _ = valid

    def tweak(table):
        e = next(e for e in table if e[0] == "kernels/x.so")
        if where == "past_end":
            e[1] += 10 ** 6
        elif where == "inside_manifest":
            e[1] = HEADER.size + 4
        else:
            e[2] = -1
    if where == "negative":
        reject(forge(manifest, members, tweak), r"^manifest is not valid: members\[\d\]\[2\] is -1, expected an integer")
    else:
        reject(forge(manifest, members, tweak), r"^member kernels/x\.so lies outside the file$")


@pytest.mark.parametrize("name", ["../evil.so", "kernels/../../evil.so", "/tmp/evil.so", "/etc/passwd",
                                  "..", "a\\..\\b", "kernels/x.so\0"])
def test_hostile_member_paths(valid, name):
    manifest, members, _ = valid
    hostile = {**members, name: b"evil"}
    reject(forge(manifest, hostile), r"^manifest is not valid: members\[\d\]\[0\] is .*, expected a member path "
                                     r"that cannot escape the extraction folder$")


def test_malformed_member_entry(valid):
    manifest, members, _ = valid

    def tweak(table):
        table[0] = table[0][:3]
    reject(forge(manifest, members, tweak), r"^manifest is not valid: members\[0\] is a list of 3 items, "
                                            r"expected a list of 4 items$")


def test_tile_image_count(valid):
    manifest, members, _ = valid
    m = dict(manifest, tile_images=manifest["tile_images"][:1])
    reject(write_package(m, members), r"^1 tile images for 2 tiles$")


def test_tile_image_not_in_package(valid):
    manifest, members, _ = valid
    m = dict(manifest, tile_images=["ab" * 32, manifest["tile_images"][1]])
    reject(write_package(m, members), r"^tile image abababababababab is not in the package$")


def test_machine_missing(valid):
    manifest, members, _ = valid
    m = {k: v for k, v in manifest.items() if k != "machine"}
    reject(write_package(m, members), "^manifest is not valid: machine is missing$")


def test_malformed_tile_image(valid):
    manifest, members, _ = valid
    img = b"\x05\x00\x00\x00nope!"
    d = canonical.digest(img)
    m, mem = make(tile_images=[d, manifest["tile_images"][1]], extra_members={f"images/{d}.img": img})
    reject(write_package(m, mem), rf"^tile image {d[:16]} array table is not valid JSON$")


@pytest.mark.parametrize("addr", [MEM["sram_base"] - 16, MEM["loader_limit"] - 8, MEM["sram_end"] + 64])
def test_segment_outside_sram(addr):
    img = _image(data={f"w@{addr}": np.zeros(4, np.float32)})
    m, mem = make(img)
    reject(write_package(m, mem), rf"^segment w of tile image [0-9a-f]{{16}} at {addr} \(\+16\) is outside "
                                  rf"tile memory \[{MEM['sram_base']}, {MEM['loader_limit']}\)$")


def test_overlapping_segments():
    img = _image(data={f"a@{DATA}": np.zeros(16, np.float32), f"b@{DATA + 32}": np.zeros(4, np.float32)})
    m, mem = make(img)
    reject(write_package(m, mem), r"^segments a and b of tile image [0-9a-f]{16} overlap$")
    # a data segment over the program
    img = _image(data={f"c@{CODE + 4096 + 4}": np.zeros(1, np.float32)})
    m, mem = make(img)
    reject(write_package(m, mem), r"^segments program and c of tile image [0-9a-f]{16} overlap$")


def test_code_segment_above_executable_end():
    img = _image(program_addr=MEM["executable_end"] - 8)
    m, mem = make(img)
    reject(write_package(m, mem), r"^code segment program at \d+ is outside the executable region$")
    img = _image(kernel_addr=MEM["executable_end"] - 4096 + 16)
    m, mem = make(img)
    reject(write_package(m, mem), r"^code segment x at \d+ is outside the executable region$")


def test_kernel_not_in_package():
    img = _image(kernel_digest="cd" * 32)
    m, mem = make(img)
    reject(write_package(m, mem), r"uses kernel x not in the package$")
    m, mem = make(kernels={})
    reject(write_package(m, mem), r"uses kernel x not in the package$")


def _bind(valid, side, binding):
    m = copy.deepcopy(valid[0])
    m[side][0]["ranges"].append(binding)
    return write_package(*make(inputs=m["inputs"], outputs=m["outputs"]))


@pytest.mark.parametrize("binding", [[0, 16, 2, DATA], [0, 16, 0, MEM["sram_base"] - 4],
                                     [0, 16, 0, MEM["loader_limit"] - 8]])
@pytest.mark.parametrize("side", ["inputs", "outputs"])
def test_binding_out_of_range(valid, binding, side):
    name = valid[0][side][0]["name"]
    reject(_bind(valid, side, binding), rf"^binding of {name} to tile {binding[2]} address {binding[3]} is out of range$")


@pytest.mark.parametrize("side", ["inputs", "outputs"])
def test_binding_to_an_idle_tile_or_past_its_tensor(valid, side):
    name = valid[0][side][0]["name"]
    reject(_bind(valid, side, [0, 16, 1, DATA]), rf"^binding of {name} to tile 1: that tile runs the idle image$")
    reject(_bind(valid, side, [8, 16, 0, DATA]) if side == "outputs" else _bind(valid, side, [56, 16, 0, DATA]),
           rf"^binding of {name}: bytes \[\d+, \d+\) are past its \d+ bytes$")
    reject(_bind(valid, side, [0, 16, -1, DATA]), rf"^manifest is not valid: {side}\[0\]\.ranges\[1\]\[2\] is -1, "
                                                  r"expected an integer in \[0, \d+\]$")


# hostile packages that escape as other exceptions ------------------------------------------
def test_tiny_tile_image_is_a_package_error(valid):
    manifest, _, _ = valid
    img = b"\x01"
    d = canonical.digest(img)
    m, mem = make(tile_images=[d, manifest["tile_images"][1]], extra_members={f"images/{d}.img": img})
    reject(write_package(m, mem), rf"^tile image {d[:16]} is malformed: truncated$")


def test_segment_of_wrong_arity_is_a_package_error(valid):
    manifest, _, _ = valid
    head = canonical.dumps({"tile_image": 1, "segments": [["data", "w", DATA, 4]]})
    from ipubuild.graph import tensors
    img = tensors.pack({"header": np.frombuffer(head, np.uint8)})
    d = canonical.digest(img)
    m, mem = make(tile_images=[d, manifest["tile_images"][1]], extra_members={f"images/{d}.img": img})
    reject(write_package(m, mem), rf"^tile image {d[:16]} is not valid: segments\[0\] is a list of 4 items, "
                                  r"expected a list of 5 items$")


def test_manifest_without_kernels_table_is_a_package_error(valid):
    manifest, members, _ = valid
    m = {k: v for k, v in manifest.items() if k != "kernels"}
    reject(write_package(m, members), "kernel")


def test_member_that_is_also_a_folder(valid, tmp_path):
    manifest, members, _ = valid
    data = write_package(manifest, {**members, "kernels": b"file", "kernels/y.so": b"obj"})
    with pytest.raises(PackageError, match="also the folder"):
        Package(data)
    assert not (tmp_path / "out").exists()


# extraction ----------------------------------------------------------------------------------
def _all_files(root: Path) -> set[Path]:
    return {p for p in root.rglob("*")}


def test_extract_writes_only_under_dest(valid, tmp_path):
    manifest, members, data = valid
    dest = tmp_path / "dest"
    before = _all_files(tmp_path)
    written = Package(data).extract(dest)
    assert sorted(written) == sorted((dest / n).resolve() for n in members)
    for n, b in members.items():
        assert (dest / n).read_bytes() == b
    new = _all_files(tmp_path) - before
    assert all(dest.resolve() in p.resolve().parents or p.resolve() == dest.resolve() for p in new)
    assert not [p for p in new if p.name.endswith(".tmp")]


def test_extract_refuses_symlinked_folder(valid, tmp_path):
    manifest, members, data = valid
    outside = tmp_path / "outside"
    outside.mkdir()
    dest = tmp_path / "dest"
    dest.mkdir()
    os.symlink(outside, dest / "kernels")
    with pytest.raises(PackageError, match=r"member path 'kernels/x\.so' escapes the extraction folder"):
        Package(data).extract(dest)
    assert list(outside.iterdir()) == []


# fuzz ----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def valid_bytes():
    m, mem = make()
    return write_package(m, mem)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(st.floats(0, 1, exclude_max=True), st.integers(1, 255)), max_size=4),
       st.one_of(st.none(), st.floats(0, 1)), st.booleans())
def test_fuzz_flips_and_truncations(valid_bytes, flips, cut, header_only):
    data = bytearray(valid_bytes)
    span = 96 if header_only else len(data)
    for pos, xor in flips:
        data[int(pos * span)] ^= xor
    if cut is not None:
        data = data[:int(cut * len(data))]
    try:
        pkg = Package(bytes(data))
    except PackageError as exc:
        assert "\n" not in str(exc)
        return
    # it loaded: every member it serves is the bytes its manifest names
    for name, (off, size, digest) in pkg.by_name.items():
        assert canonical.digest(pkg.member(name)) == digest
    assert pkg.member("kernels/x.so") == KERNEL


# doit inspect:<target> -------------------------------------------------------------------------
def test_inspect_through_doit(valid, tmp_path):
    """``doit inspect`` describes a valid package, and refuses a hostile one (here: no idle
    image, which once was a KeyError in summarize) with one error line and no traceback."""
    from buildtree import doit, make_tree
    tree = make_tree(tmp_path / "tree")
    path = tree / "artifacts" / "small" / "small.ipuexe"
    path.parent.mkdir(parents=True)
    path.write_bytes(valid[2])
    run = doit(tree, "inspect:small")
    assert run.returncode == 0, run.stdout + run.stderr
    assert "tiles=2 tiles_used=1 distinct_images=2" in run.stdout + run.stderr
    hostile = {k: v for k, v in valid[0].items() if k != "idle_image"}
    path.write_bytes(write_package(hostile, valid[1]))
    run = doit(tree, "inspect:small")
    out = run.stdout + run.stderr
    assert run.returncode != 0 and "Traceback" not in out, out
    errors = [line for line in out.splitlines() if "idle_image" in line]
    assert len(errors) == 1 and errors[0].startswith("error: ") and errors[0].endswith(
        "small.ipuexe: manifest is not valid: idle_image is missing"), out


@pytest.mark.parametrize("used_tiles", [2, 3])
def test_a_used_tile_count_the_tile_table_disagrees_with_is_refused(used_tiles, tmp_path):
    """``used_tiles`` past the loaded tiles (the rest idle, every checksum recomputed) is refused by
    the reader and by ``doit inspect``, with the same one line."""
    from buildtree import doit, make_tree
    manifest, members = make(tiles=3)
    data = write_package(dict(manifest, used_tiles=used_tiles), members)
    says = f"used_tiles is {used_tiles} but the tile table loads 1 tiles: the counts disagree"
    reject(data, "^" + says + "$")
    tree = make_tree(tmp_path / "tree")
    path = tree / "artifacts" / "small" / "small.ipuexe"
    path.parent.mkdir(parents=True)
    path.write_bytes(data)
    run = doit(tree, "inspect:small")
    assert run.returncode != 0 and "Traceback" not in run.output, run.tail()
    errors = [ln for ln in run.output.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and errors[0].endswith(f"small.ipuexe: {says}"), run.tail()


# exchange tables -----------------------------------------------------------------------------------
@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 40), st.lists(st.integers(0, 2 ** 32 - 1), min_size=8, max_size=8),
                          st.lists(st.lists(st.integers(0, 2 ** 32 - 1), min_size=3, max_size=3), max_size=4)),
                max_size=20))
def test_exchange_tables_round_trip_with_broadcasts(raw):
    entries = [[step, *head, *[x for d in more for x in d]] for step, head, more in raw]
    data = codegen.encode_exchange(entries)
    assert codegen.decode_exchange(data) == entries
    n_dest = sum(1 + len(more) for _, _, more in raw)
    assert len(data) == codegen.exchange_bytes(len(entries), n_dest)


@pytest.mark.parametrize("cut,message", [(4, "truncated"), (-4, "truncated"), (None, "version 1")])
def test_a_malformed_exchange_table_is_refused(cut, message):
    good = codegen.encode_exchange([[0, 0, DATA, 16, 1, DATA + 4096, 16, 1, 16, 2, DATA, 16]])
    with pytest.raises(ValueError, match=message):
        if cut is None:
            codegen.decode_exchange(good[:4] + struct.pack("<I", 1) + good[8:])
        else:
            codegen.decode_exchange(good[:cut] if cut < 0 else good[:8] + struct.pack("<I", 2) + good[12:])


def test_the_reader_refuses_a_package_whose_exchange_table_is_malformed():
    prog = codegen.encode_program(["x"], [[0, [[0, [DATA, 3, 7]]]]])
    bad = codegen.encode_exchange([[0, 0, DATA, 16, 1, DATA + 4096, 16, 1, 16]])[:-4]
    code = {"program": prog, "exchange": bad,
            "addresses": {"program": CODE + 4096, "exchange": CODE + 4096 + len(prog)}}
    image = codegen.build_image(code, {}, [["x", CODE, 4096, canonical.digest(KERNEL)]])
    manifest, members = make(image)
    with pytest.raises(PackageError, match="the exchange table of .* does not decode"):
        Package(write_package(manifest, members))


def test_tile_images_swapped_between_slots_are_refused():
    """Each tile's image sends from that tile: two images swapped in the tile table (every
    checksum recomputed) are refused, naming the slot."""
    a = _image(exchange=[[0, 0, DATA, 16, 1, DATA + 4096, 16, 1, 16]])
    b = _image(exchange=[[0, 1, DATA, 16, 0, DATA + 4096, 16, 1, 16]])
    da, db = canonical.digest(a), canonical.digest(b)
    m, mem = make(a, tiles=3, used_tiles=2)
    idle = m["idle_image"]
    mem[f"images/{db}.img"] = b
    Package(write_package(dict(m, tile_images=[da, db, idle]), mem))
    reject(write_package(dict(m, tile_images=[db, da, idle]), mem),
           rf"^tile 0 holds tile image {db[:16]}, whose exchange table sends from tile 1: the tile table "
           "does not put each image in its tile's slot$")


def test_a_member_given_as_parts_packs_as_their_concatenation():
    from ipubuild.graph import tensors
    rng = np.random.default_rng(3)
    parts = [np.zeros((0, 10), np.int32), rng.integers(-9, 9, (5, 10)).astype(np.int32),
             rng.integers(0, 9, (2, 10)).astype(np.int64)]
    whole = {"a": np.concatenate(parts), "b": np.float32(2.5), "c": rng.random((3, 4))[:, ::2]}
    packed = tensors.pack({**whole, "a": parts}, prefix=b"MAGIC")
    assert packed == b"MAGIC" + tensors.pack(whole)
    got = tensors.unpack(packed[5:])
    assert got["a"].dtype == np.int64 and (got["a"] == whole["a"]).all() and (got["c"] == whole["c"]).all()


def _read_both(read, data, monkeypatch):
    """``read(data)`` with the C readers and with the Python forms: each result, or the error it
    raised."""
    out = []
    for switch in ("1", "0"):
        monkeypatch.setenv("IPUBUILD_NATIVE", switch)
        try:
            out.append(("ok", [a.tolist() if hasattr(a, "tolist") else a for a in read(data)]))
        except ValueError as exc:
            out.append(("error", str(exc)))
    return out


def test_the_c_range_check_of_exchange_rows_finds_what_numpy_finds(monkeypatch):
    """Random exchange rows, and rows whose last row's end is past 2**64 bytes: the C check
    and the numpy form flag the same rows as leaving the loaded tiles or their memory."""
    from ipubuild.compiler.planning import codegen_native
    if codegen_native.library() is None:
        pytest.fail("the table readers do not compile here")
    rng = np.random.default_rng(5)
    mc = {"sram_base": 1000, "loader_limit": 600_000, "tiles": 50}
    loaded = np.zeros(51, bool)
    loaded[rng.choice(50, 30, replace=False)] = True
    tile = int(np.flatnonzero(loaded)[0])
    rows = rng.integers(0, 2 ** 32, size=(4000, 8))
    rows[:2000, [2, 5, 7]] = rng.integers(0, 50_000, (2000, 3))
    rows[:2000, [1, 4]] = rng.integers(0, 700_000, (2000, 2))
    rows[:2000, 6] = rng.integers(0, 4, 2000)
    rows[:, [0, 3]] = rng.integers(0, 60, (4000, 2))
    huge = [tile, 2000, 2 ** 32 - 1, tile, 2000, 2 ** 32 - 1, 2 ** 32 - 1, 2 ** 32 - 1]
    rows = np.vstack([rows, [huge]]).astype(np.int64)
    found = {}
    for switch in ("1", "0"):
        monkeypatch.setenv("IPUBUILD_NATIVE", switch)
        found[switch] = Package._outside(mc, rows, loaded)
    assert found["1"].tolist() == found["0"].tolist()
    assert found["1"][-1] and 0 < found["1"][:2000].sum() < 2000


def test_the_c_readers_read_what_the_python_forms_read(monkeypatch):
    """Random tile programs and exchange tables, whole, cut short, padded or with a byte
    changed: the C readers give the same arrays as the Python forms, or refuse them with the same
    error."""
    from ipubuild.compiler.planning import codegen_native
    if codegen_native.library() is None:
        pytest.fail("the table readers do not compile here")
    rng = np.random.default_rng(11)
    kinds = set()
    for trial in range(300):
        names = [f"k{j}" for j in range(int(rng.integers(0, 4)))]
        steps = [[int(s), [[int(rng.integers(0, max(len(names), 1))), rng.integers(0, 2 ** 32, int(rng.integers(0, 6))).tolist()]
                           for _ in range(int(rng.integers(0, 4)))]] for s in sorted(rng.choice(50, int(rng.integers(0, 5)), replace=False))]
        program = codegen.encode_program(names, steps)
        entries = [[int(rng.integers(0, 9)), *rng.integers(0, 2 ** 32, 8).tolist(),
                    *rng.integers(0, 2 ** 32, 3 * int(rng.integers(0, 3))).tolist()] for _ in range(int(rng.integers(0, 6)))]
        table = codegen.encode_exchange(entries)
        for data, read in ((program, codegen.decode_program_arrays), (table, codegen.decode_exchange_rows)):
            damage = trial % 4
            if damage == 1 and len(data) > 16:
                data = data[:int(rng.integers(4, len(data)))]
            elif damage == 2:
                data = data + b"\0" * 4
            elif damage == 3 and len(data) > 8:
                at = int(rng.integers(4, len(data)))
                data = data[:at] + bytes([int(rng.integers(0, 256))]) + data[at + 1:]
            c, python = _read_both(read, data, monkeypatch)
            assert c == python, (trial, data)
            kinds.add(c[0])
    assert kinds == {"ok", "error"}
