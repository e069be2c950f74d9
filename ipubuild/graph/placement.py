"""Where a storage placement put each buffer: the ``storage`` and ``provisional_storage``
artifacts, read by the compiler, the device's comparison and the report.

The artifact is ``{"tiles": {tile: {"code_bytes", "ranges"}}, "addresses": [...]}``: each
tile's code size and memory map, and one int32 array of every buffer's address by its number
(a program numbers its buffers 1, 2, … across all tiles; -1 where there is none), so that a
transfer's buffers become addresses by one gather (``Placement.of``). As ``{tile: {buffer name:
address}}`` ViT-B/16's 1.4 M buffers were JSON written and read by every search candidate, and
names turned back into codes to look them up.
"""
from __future__ import annotations

import numpy as np

from .artifacts import buffer_numbers, to_plan_blob


class Placement:
    """A ``storage`` artifact's value: ``tiles`` (``{tile: {"code_bytes", "ranges"}}``) and each
    buffer's address by name (``address``) or by ``buffer_code`` (``of``)."""

    def __init__(self, value: dict):
        self.tiles, self.addresses = value["tiles"], np.asarray(value["addresses"])

    def address(self, bid: str) -> int:
        """The address of the buffer named ``bid`` (``o12``)."""
        return int(self.addresses[int(bid[1:])])

    def of(self, codes: np.ndarray) -> np.ndarray:
        """The addresses of buffers given by ``buffer_code`` (KeyError for one not placed)."""
        numbers = buffer_numbers(codes)
        if len(numbers) and (numbers.max() >= len(self.addresses) or (self.addresses[numbers] < 0).any()):
            raise KeyError("a transfer names a buffer the storage did not place")
        return self.addresses[numbers].astype(np.int64)


def placement_blob(tiles: dict, addresses: np.ndarray) -> bytes:
    """The ``storage`` artifact of ``tiles`` and ``addresses`` (by buffer number)."""
    return to_plan_blob({"tiles": tiles, "addresses": np.asarray(addresses, dtype=np.int32)}, (("addresses",),))


def placement_of(value) -> Placement:
    """A ``storage`` artifact's value (``engine.decoded``) read as a ``Placement``."""
    return value if isinstance(value, Placement) else Placement(value)
