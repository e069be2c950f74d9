"""A bundle of named arrays as one canonical blob: a JSON header, then raw little-endian data."""
from __future__ import annotations

import struct

import numpy as np

from ..engine import canonical


def pack(arrays: dict[str, np.ndarray]) -> bytes:
    header, chunks, offset = [], [], 0
    for name in sorted(arrays):
        a = np.ascontiguousarray(arrays[name])
        a = a.astype(a.dtype.newbyteorder("<"), copy=False)
        raw = a.tobytes()
        header.append([name, a.dtype.str, list(a.shape), offset, len(raw)])
        chunks.append(raw)
        offset += len(raw)
    head = canonical.dumps(header)
    return struct.pack("<I", len(head)) + head + b"".join(chunks)


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
