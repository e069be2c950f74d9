"""A bundle of named arrays as one canonical blob: a JSON header, then raw little-endian data."""
from __future__ import annotations

import struct

import numpy as np

from ..engine import canonical


def pack(arrays: dict[str, np.ndarray | list[np.ndarray]], prefix: bytes = b"") -> bytes:
    """``prefix``, then the arrays by name. A member given as a list of arrays is stored as their
    concatenation along the first axis (``np.concatenate``'s), written from the parts: a plan
    blob's hundreds of megabytes are copied once, into the blob."""
    header, chunks, offset = [], [], 0
    for name in sorted(arrays):
        parts = arrays[name]
        if isinstance(parts, list):
            dtype = np.result_type(*parts)
            shape = [sum(len(a) for a in parts), *np.shape(parts[0])[1:]]
        else:
            parts = [np.ascontiguousarray(parts)]          # at least one dimension, as stored
            dtype, shape = parts[0].dtype, list(parts[0].shape)
        dtype = dtype.newbyteorder("<")
        size = 0
        for a in parts:
            a = np.ascontiguousarray(a, dtype=dtype)
            chunks.append(memoryview(a.reshape(-1).view(np.uint8)) if a.size else b"")
            size += a.nbytes
        header.append([name, dtype.str, shape, offset, size])
        offset += size
    head = canonical.dumps(header)
    return b"".join([prefix, struct.pack("<I", len(head)), head, *chunks])


def read_header(data: bytes) -> tuple[int, list]:
    """Where a ``pack``'s arrays begin, and its header: ``[name, dtype, shape, offset, size]`` an
    array, without reading them."""
    (n,) = struct.unpack_from("<I", data)
    return 4 + n, canonical.loads(bytes(data[4:4 + n]))


def unpack(data: bytes) -> dict[str, np.ndarray]:
    base, members = read_header(data)
    return {name: np.frombuffer(data, dtype=np.dtype(dt), count=int(np.prod(shape, dtype=np.int64)),
                                offset=base + off).reshape(shape)
            for name, dt, shape, off, size in members}
