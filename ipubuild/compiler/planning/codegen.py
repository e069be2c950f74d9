"""Tile programs, their binary encoding, tile images and the host program.

A tile program lists, per step, the vertices the tile runs (kernel index and resolved u32
arguments); its exchange table lists the transfers the tile sends, per step. Both are encoded
little-endian as below and placed in the tile's executable region after its kernels.
"""
from __future__ import annotations

import struct

import numpy as np

from ...engine import canonical
from ...graph import tensors

PROGRAM_MAGIC = b"TPRG"
EXCHANGE_MAGIC = b"TXCH"


def encode_program(kernels: list[str], steps: list) -> bytes:
    """``steps`` = ``[[step, [[kernel_index, [u32 args]], ...]], ...]``."""
    out = [PROGRAM_MAGIC, struct.pack("<III", 1, len(kernels), len(steps))]
    for name in kernels:
        raw = name.encode()
        out.append(struct.pack("<H", len(raw)) + raw)
    for step, verts in steps:
        out.append(struct.pack("<II", step, len(verts)))
        for k, args in verts:
            out.append(struct.pack(f"<HH{len(args)}I", k, len(args), *[a & 0xFFFFFFFF for a in args]))
    return b"".join(out)


def decode_program(data: bytes) -> tuple[list[str], list]:
    """A tile program's ``(kernels, steps)`` as ``encode_program`` takes them; ValueError unless
    the bytes are exactly one."""
    names, steps, kernels, starts, args = decode_program_arrays(data)
    args, starts = args.tolist(), starts.tolist()
    verts = [(k, args[a:b]) for k, a, b in zip(kernels.tolist(), starts, starts[1:])]
    return names, [(step, verts[v0:v1]) for step, v0, v1 in steps.tolist()]


def decode_program_arrays(data: bytes):
    """A tile program as arrays: ``(kernel names, steps, vertex kernels, argument starts,
    arguments)`` (``codegen_native.program_arrays``), read in C where a compiler works;
    ValueError unless the bytes are exactly a program (of version 1, nothing left over), so
    that a program that decodes is its bytes."""
    from . import codegen_native
    if data[:4] != PROGRAM_MAGIC:
        raise ValueError("not a tile program")
    try:
        found = codegen_native.program_arrays(data)
        return found if found is not None else _program_arrays_python(data)
    except UnicodeDecodeError:                   # a kernel name that is not UTF-8
        raise ValueError("not a tile program") from None


def _program_arrays_python(data: bytes):
    try:
        version, nk, ns = struct.unpack_from("<III", data, 4)
        pos, names = 16, []
        for _ in range(nk):
            (n,) = struct.unpack_from("<H", data, pos)
            if pos + 2 + n > len(data):
                raise ValueError("not a tile program")
            names.append(data[pos + 2:pos + 2 + n].decode())
            pos += 2 + n
        steps, kernels, starts, args = [], [], [0], []
        for _ in range(ns):
            step, nv = struct.unpack_from("<II", data, pos)
            pos += 8
            steps.append([step, len(kernels), len(kernels) + nv])
            for _ in range(nv):
                k, na = struct.unpack_from("<HH", data, pos)
                args.extend(struct.unpack_from(f"<{na}I", data, pos + 4))
                kernels.append(k)
                starts.append(len(args))
                pos += 4 + 4 * na
    except struct.error:
        raise ValueError("not a tile program") from None
    if version != 1 or pos != len(data):
        raise ValueError("not a tile program")
    return (names, np.array(steps, np.int64).reshape(-1, 3), np.array(kernels, np.int64),
            np.array(starts, np.int64), np.array(args, np.uint32))


EXCHANGE_VERSION = 2


def encode_exchange(entries: list) -> bytes:
    """``entries`` = ``[[step, src_tile, src_addr, src_stride, dst_tile, dst_addr, dst_stride,
    rows, row_bytes, (dst_tile, dst_addr, dst_stride)...], ...]``: a broadcast carries its
    further destinations at the end. Encoded (version 2) as u32 ``magic, version, count``, then
    per entry ``step, src_tile, src_addr, src_stride, rows, row_bytes, destinations`` and
    ``dst_tile, dst_addr, dst_stride`` per destination."""
    words = [EXCHANGE_VERSION, len(entries)]
    for e in entries:
        dests = [e[4:7], *(e[i:i + 3] for i in range(9, len(e), 3))]
        words.extend([e[0], e[1], e[2], e[3], e[7], e[8], len(dests)])
        for d in dests:
            words.extend(d)
    return EXCHANGE_MAGIC + np.asarray(words, dtype="<u4").tobytes()


def decode_exchange(data: bytes) -> list[list[int]]:
    """The entries of an exchange table, as ``encode_exchange`` takes them; ValueError if the
    table is not one, is of another version or is truncated."""
    steps, entries = decode_exchange_arrays(data)
    return [[s, *e] for s, e in zip(steps.tolist(), entries.entry_lists())]


def decode_exchange_arrays(data: bytes):
    """``(steps, entries)``: an exchange table's entries as placed ``exchange.Groups`` and each
    one's step, read without a Python list per entry; ValueError as ``decode_exchange``."""
    from .exchange import Groups
    words, at = _exchange_entries(data)
    more = words[at + 6] - 1
    heads = np.stack([words[at + 1], words[at + 2], words[at + 3], words[at + 7], words[at + 8], words[at + 9],
                      words[at + 4], words[at + 5]], axis=1).reshape(-1, 8)
    owner = np.repeat(np.arange(len(at)), more)
    first = np.cumsum(more) - more
    where = at[owner] + 10 + 3 * (np.arange(len(owner)) - first[owner])
    extra = np.stack([words[where], words[where + 1], words[where + 2]], axis=1).reshape(-1, 3)
    return words[at], Groups(heads, extra, np.concatenate([[0], np.cumsum(more)]).astype(np.int64))


def decode_exchange_rows(data: bytes):
    """``(steps, rows, entry)``: an exchange table's entries' steps, and their destinations as
    ``exchange.unicast`` rows (``[n, 8]``: ``src_tile, src_addr, src_stride, dst_tile, dst_addr,
    dst_stride, rows, row_bytes``), each with its entry's index; read in C where a compiler
    works. ValueError as ``decode_exchange``."""
    from . import codegen_native
    from .exchange import unicast
    words, at = _exchange_entries(data)
    found = codegen_native.exchange_rows(words, at, int(words[at + 6].sum()))
    if found is None:
        steps, groups = decode_exchange_arrays(data)
        return steps, unicast(groups), np.repeat(np.arange(len(groups)), groups.destinations())
    return (words[at], *found)


def _exchange_entries(data: bytes) -> tuple[np.ndarray, np.ndarray]:
    """An exchange table's words after its magic (int64) and where each entry begins in them;
    ValueError if the table is not one, is of another version, is truncated or has words left
    over."""
    from . import codegen_native
    if data[:4] != EXCHANGE_MAGIC or len(data) % 4:
        raise ValueError("not an exchange table")
    raw = np.frombuffer(data, dtype="<u4", offset=4)
    words = raw.astype(np.int64)
    if len(words) < 2 or words[0] != EXCHANGE_VERSION:
        raise ValueError(f"exchange table of version {int(words[0]) if len(words) else '?'}; this reader knows "
                         f"{EXCHANGE_VERSION}")
    count, total = int(words[1]), len(words)
    if count > total:
        raise ValueError("truncated exchange table")
    at = codegen_native.exchange_starts(raw, count)
    if at is None:
        at = np.empty(count, np.int64)
        listed, pos = words.tolist(), 2
        for k in range(count):                 # each entry begins after the last one's destinations
            if pos + 7 > total or listed[pos + 6] < 1 or pos + 7 + 3 * listed[pos + 6] > total:
                raise ValueError("truncated exchange table")
            at[k] = pos
            pos += 7 + 3 * listed[pos + 6]
        if pos != total:
            raise ValueError("exchange table has trailing bytes")
    return words, at


def program_bytes(kernels: list[str], steps: list) -> int:
    """The encoded size (``len(encode_program(kernels, steps))``), which does not depend on
    argument values."""
    return (4 + 12 + sum(2 + len(name.encode()) for name in kernels)
            + sum(8 + sum(4 + 4 * len(args) for _, args in verts) for _, verts in steps))


def exchange_bytes(n_entries: int, n_destinations: int) -> int:
    """The encoded size of a table of ``n_entries`` entries with ``n_destinations`` in all."""
    return 12 + 28 * n_entries + 12 * n_destinations


def build_image(code: dict, data: dict, kernels: list) -> bytes:
    """A tile image: segments (kernel code reservations, program, exchange table, initial data)
    with addresses, as one canonical blob."""
    segments, blobs = [], {}
    for name, addr, size, obj in kernels:
        segments.append(["kernel", name, addr, size, obj])
    for kind in ("program", "exchange"):
        if kind in code:
            raw = code[kind]
            addr = int(code["addresses"][kind])
            segments.append([kind, kind, addr, len(raw), canonical.digest(raw)])
            blobs[kind] = raw
    for name in sorted(data, key=lambda n: int(n.split("@")[1])):
        raw = data[name].tobytes()
        addr = int(name.split("@")[1])
        segments.append(["data", name.split("@")[0], addr, len(raw), canonical.digest(raw)])
        blobs[f"data@{addr}"] = raw
    header = canonical.dumps({"tile_image": 1, "segments": segments})
    arrays = {"header": np.frombuffer(header, dtype=np.uint8)}
    arrays.update({k: np.frombuffer(v, dtype=np.uint8) for k, v in blobs.items()})
    return tensors.pack(arrays)


def read_image(blob: bytes) -> tuple[dict, dict[str, bytes]]:
    arrays = tensors.unpack(blob)
    header = canonical.loads(arrays.pop("header").tobytes())
    return header, {k: v.tobytes() for k, v in arrays.items()}


def bindings(value, ranges: list, placed) -> list:
    """``[[tensor_byte_offset, size, tile, address], ...]`` for blocks ``[tile, buf, r0, r1, c0,
    c1]`` placed by ``placed`` (a ``graph.placement.Placement``)."""
    isz, cols = value.itemsize, value.cols
    out = []
    for tile, bid, r0, r1, c0, c1 in ranges:
        base = placed.address(bid)
        width = (c1 - c0) * isz
        if c0 == 0 and c1 == cols:
            out.append([r0 * cols * isz, (r1 - r0) * width, tile, base])
        else:
            out.extend([(r * cols + c0) * isz, width, tile, base + (r - r0) * width] for r in range(r0, r1))
    return sorted(out)
