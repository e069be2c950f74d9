"""A program's buffers as one int32 table, a row per buffer: what the ``program`` artifact holds
under ``"buffers"`` (``{"tile_count", "values", "table"}``), read through ``ProgramBuffers``.

A row is ``COLUMNS``: its tile, its name as ``artifacts.buffer_code``, its size in bytes, the
first and last program step it lives in, the value it holds (an index into ``values``) and the
block of that value (rows ``r0:r1``, columns ``c0:c1``). Rows are sorted by tile, then by name.
ViT-B/16's initial program has 470 K buffers: as JSON records they were 65 % of its decoded
skeleton (466 MB of heap; 177 MB with the table); as a table they are 40 bytes each, and the
passes that read them all (storage placement, head room) read rows.
"""
from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from .artifacts import BUFFER_KINDS, buffer_codes, buffer_codes_of, buffer_kinds, buffer_names

COLUMNS = ("tile", "code", "size", "start", "end", "value", "r0", "r1", "c0", "c1")
TILE, CODE, SIZE, START, END, VALUE = range(6)

#: the fields of a buffer as ``table_of_rows`` takes them (the value as a number, the kind as an
#: index into ``BUFFER_KINDS``), before it has a name and a last step
ROW_FIELDS = len(("tile", "kind", "size", "start", "value", "r0", "r1", "c0", "c1"))


def buffer_table(columns: list[list], ends: list[int], tile_count: int) -> dict:
    """The ``program["buffers"]`` entry of buffers numbered 1, 2, … : ``columns[n - 1]`` is
    buffer n's ``[tile, kind letter, size, first step, value, r0, r1, c0, c1]`` (its block of
    the value), ``ends[n - 1]`` its last step: tables made by hand (tests); ``build_program``
    makes its table with ``table_of_rows``."""
    values = sorted({c[4] for c in columns})
    index = {v: i for i, v in enumerate(values)}
    rows = np.array([[c[0], BUFFER_KINDS.index(c[1]), c[2], c[3], index[c[4]], *c[5:]] for c in columns],
                    dtype=np.int64).reshape(-1, ROW_FIELDS)
    return table_of_rows(rows, np.asarray(ends, dtype=np.int64), values, tile_count)


def table_of_rows(rows: np.ndarray, ends: np.ndarray, value_keys: list[str], tile_count: int) -> dict:
    """The ``program["buffers"]`` entry of buffers numbered 1, 2, … : ``rows[n - 1]`` is
    buffer n's ``[tile, kind, size, first step, value, r0, r1, c0, c1]`` (``kind`` an index
    into ``BUFFER_KINDS``, ``value`` into ``value_keys``), ``ends[n - 1]`` its last step.
    The table's values are those its rows name, sorted."""
    rows = np.asarray(rows, dtype=np.int64).reshape(-1, ROW_FIELDS)
    ends = np.asarray(ends, dtype=np.int64)
    if len(rows) and (max(rows.max(), ends.max()) > np.iinfo(np.int32).max or min(rows.min(), ends.min()) < 0):
        raise ValueError("a buffer's size, steps or block do not fit the program's int32 buffer table")
    used = np.unique(rows[:, 4])
    names = [value_keys[i] for i in used.tolist()]
    order = sorted(range(len(names)), key=names.__getitem__)
    rank = np.zeros(len(value_keys) if len(used) else 0, np.int64)
    rank[used[order]] = np.arange(len(order))
    codes = buffer_codes_of(rows[:, 1], np.arange(1, len(rows) + 1))
    by = np.argsort(rows[:, 0] << 32 | codes)        # by tile, then code (codes are distinct)
    rows, ends, codes = rows[by], ends[by], codes[by]
    table = np.empty((len(rows), len(COLUMNS)), np.int32)   # int32 throughout: the rows fit, checked above
    table[:, TILE], table[:, CODE] = rows[:, 0], codes
    table[:, SIZE], table[:, START], table[:, END] = rows[:, 2], rows[:, 3], ends
    table[:, VALUE] = rank[rows[:, 4]]
    table[:, VALUE + 1:] = rows[:, 5:]
    return {"tile_count": tile_count, "values": [names[i] for i in order], "table": table}


class ProgramBuffers(Mapping):
    """``program["buffers"]`` read as ``{tile: {buffer name: record}}`` (tiles as ``"0"``, ``"1"``,
    …, every tile of the target), each tile's dict made when it is asked for; and by rows
    (``rows``, ``names``) for passes over many buffers."""

    def __init__(self, entry: dict):
        self.table = np.asarray(entry["table"]).reshape(-1, len(COLUMNS))
        self.value_keys = entry["values"]
        self.tile_count = entry["tile_count"]
        self._bounds = np.searchsorted(self.table[:, TILE], np.arange(self.tile_count + 1)).tolist()
        self._keys = None

    def __len__(self) -> int:
        return self.tile_count

    def __iter__(self):
        return (str(t) for t in range(self.tile_count))

    def __contains__(self, tile) -> bool:
        return str(tile).isdigit() and int(tile) < self.tile_count

    def rows(self, tile) -> np.ndarray:
        """The table's rows of one tile, by name."""
        lo, hi = self.span(tile)
        return self.table[lo:hi]

    def span(self, tile) -> tuple[int, int]:
        """Where one tile's rows are in the table: ``table[lo:hi]``."""
        t = int(tile)
        if not 0 <= t < self.tile_count:
            raise KeyError(tile)
        return int(self._bounds[t]), int(self._bounds[t + 1])

    def names(self, tile) -> list[str]:
        """The names of one tile's buffers, in order."""
        return buffer_names(self.rows(tile)[:, CODE])

    def __getitem__(self, tile) -> dict[str, dict]:
        if tile not in self:
            raise KeyError(tile)
        rows = self.rows(tile)
        return dict(zip(buffer_names(rows[:, CODE]), map(self._record, rows.tolist())))

    def record(self, tile, bid: str) -> dict:
        """One buffer's record, found by binary search (KeyError if the tile has no such buffer)."""
        rows, code = self.rows(tile), int(buffer_codes([bid])[0])
        i = int(np.searchsorted(rows[:, CODE], code))
        if i == len(rows) or rows[i, CODE] != code:
            raise KeyError(bid)
        return self._record(rows[i].tolist())

    def values_of(self, tiles: np.ndarray, codes: np.ndarray) -> list[str]:
        """The value (its key, ``"v12"``) each buffer ``(tiles[i], codes[i])`` holds, by one
        binary search over the table (KeyError if a tile has no such buffer)."""
        if self._keys is None:                  # rows are sorted by tile, then code
            self._keys = self.table[:, TILE].astype(np.int64) << 40 | self.table[:, CODE]
        want = np.asarray(tiles, np.int64) << 40 | np.asarray(codes, np.int64)
        at = np.minimum(np.searchsorted(self._keys, want), max(len(self._keys) - 1, 0))
        if len(want) and (not len(self._keys) or (self._keys[at] != want).any()):
            raise KeyError("a buffer the program does not have")
        return [self.value_keys[v] for v in self.table[at, VALUE].tolist()]

    def _record(self, row: list) -> dict:
        _, code, size, start, end, value, r0, r1, c0, c1 = row
        vk, rec = self.value_keys[value], {"size": size, "start": start, "end": end}
        kind = BUFFER_KINDS[buffer_kinds(code)]
        if kind == "c":
            rec.update(init=[vk, r0, r1, c0, c1], value=vk)
        elif kind == "i":
            rec.update(input=[vk, r0, r1, c0, c1], value=vk)
        elif kind == "o":
            rec.update(value=vk, block=[r0, r1, c0, c1])
        else:
            rec["value"] = vk
        return rec


def buffers_of(program: dict) -> ProgramBuffers:
    """A program's buffers (``program["buffers"]``), as ``ProgramBuffers``."""
    return ProgramBuffers(program["buffers"])
