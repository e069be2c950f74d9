"""Decoding the artifacts phases share: the machine description, the graph, its parameters."""
from __future__ import annotations

import collections
import functools
import threading
import tomllib

import numpy as np

from ..engine import canonical
from . import tensors
from .ir import Graph


@functools.lru_cache(maxsize=8)
def _machine(data: bytes) -> dict:
    return tomllib.loads(data.decode())


def machine_of(ctx) -> dict:
    """The ``machine`` input of a phase, parsed (memoised by content)."""
    return _machine(ctx.bytes("machine"))


def machine_from(data: bytes) -> dict:
    """A ``machine`` artifact's bytes, parsed (memoised by content)."""
    return _machine(data)


def graph_of(ctx) -> Graph:
    return Graph.from_json(ctx.json("graph"))


def params_of(ctx, graph: Graph):
    """(constants, inputs) by value id from the ``params`` input."""
    arrays = tensors.unpack(ctx.bytes("params"))
    return ({v: arrays[f"v{v}"] for v in graph.constants}, {v: arrays[f"v{v}"] for v in graph.inputs})


def to_plan_json(value) -> bytes:
    """A large planning artifact (program, exchange schedules and tables, placements, storage,
    code sizes, tile programs) as JSON: ``to_json``'s form (sorted keys, no whitespace) written by
    orjson, several times faster on these lists of integers. It differs from ``to_json`` only in
    writing non-ASCII text as UTF-8 rather than escapes (and floats in orjson's shortest form);
    deterministic, and read by any JSON reader. Package members keep ``to_json``."""
    import orjson
    out = canonical.Json(orjson.dumps(value, option=orjson.OPT_SORT_KEYS))
    out.value = value
    return out


BUFFER_KINDS = "cgio"       # constant, gathered, input, output: in the order of their letters
_DIGITS = 8                 # a program's buffers are numbered below 10**8


def buffer_code(bid: str) -> int:
    """A buffer's name (``o12``) as an int that orders as the name does: its kind, then its
    number's digits left-aligned in base 11 (1 + the digit, 0 past the last). A transfer array
    holds its buffers so, and sorting transfers sorts them as their names would."""
    digits = bid[1:]
    if len(digits) > _DIGITS:
        raise ValueError(f"buffer {bid}: a program numbers at most 10**{_DIGITS} buffers")
    code = BUFFER_KINDS.index(bid[0])
    for p in range(_DIGITS):
        code = code * 11 + (int(digits[p]) + 1 if p < len(digits) else 0)
    return code


def buffer_name(code: int) -> str:
    """The buffer name a ``buffer_code`` stands for."""
    code, digits = int(code), []
    for _ in range(_DIGITS):
        code, d = divmod(code, 11)
        if d:
            digits.append(str(d - 1))
    return BUFFER_KINDS[code] + "".join(reversed(digits))


def buffer_names(codes: np.ndarray) -> list[str]:
    """``buffer_name`` of each of an array of codes."""
    codes = np.asarray(codes, dtype=np.int64)
    kind, rest = np.divmod(codes, 11 ** _DIGITS)
    digits = rest[:, None] // 11 ** np.arange(_DIGITS - 1, -1, -1, dtype=np.int64) % 11
    chars = np.concatenate([np.frombuffer(BUFFER_KINDS.encode(), np.uint8)[kind][:, None],
                            np.where(digits > 0, digits + ord("0") - 1, 0).astype(np.uint8)], axis=1)
    return np.ascontiguousarray(chars).view(f"S{_DIGITS + 1}").ravel().astype(str).tolist()


def buffer_codes(names: list[str]) -> np.ndarray:
    """``buffer_code`` of each of a list of buffer names."""
    if not names:
        return np.zeros(0, np.int64)
    raw = np.array(names, dtype=f"S{_DIGITS + 2}").view(np.uint8).reshape(len(names), _DIGITS + 2)
    if raw[:, -1].any():
        raise ValueError(f"buffer names of more than {_DIGITS} digits: a program numbers at most 10**{_DIGITS}")
    kind = np.searchsorted(np.frombuffer(BUFFER_KINDS.encode(), np.uint8), raw[:, 0])
    if not (np.frombuffer(BUFFER_KINDS.encode(), np.uint8)[np.minimum(kind, len(BUFFER_KINDS) - 1)] == raw[:, 0]).all():
        raise ValueError("a buffer name does not begin with one of " + BUFFER_KINDS)
    digits = raw[:, 1:1 + _DIGITS].astype(np.int64)
    digits = np.where(digits > 0, digits - ord("0") + 1, 0)
    code = kind.astype(np.int64)
    for p in range(_DIGITS):
        code = code * 11 + digits[:, p]
    return code


def buffer_codes_of(kinds: np.ndarray, numbers: np.ndarray) -> np.ndarray:
    """``buffer_code`` of the buffers named by a kind (an index into ``BUFFER_KINDS``) and a
    number each, without making their names: by table, a number's first digits (all of them
    up to 4) and, past 4 digits, its last 4 moved to where its length puts them."""
    numbers = np.asarray(numbers, dtype=np.int64)
    if len(numbers) and (numbers.min() < 0 or numbers.max() >= 10 ** _DIGITS):
        raise ValueError(f"a program numbers at most 10**{_DIGITS} buffers")
    length = 1 + np.searchsorted(_POWERS, numbers, side="right")
    long = length > _HALF
    code = _FIRST[np.where(long, numbers // 10 ** _HALF, numbers)]
    code += np.where(long, _LAST[numbers % 10 ** _HALF] * 11 ** (_DIGITS - length), 0)
    return code + np.asarray(kinds, dtype=np.int64) * 11 ** _DIGITS


def _codes_slowly(numbers: np.ndarray) -> np.ndarray:
    """``buffer_codes_of`` kind 0, digit by digit (for the tables)."""
    length = 1 + sum((numbers >= 10 ** k).astype(np.int64) for k in range(1, _DIGITS))
    code = np.zeros(len(numbers), np.int64)
    for p in range(_DIGITS):
        digit = numbers // 10 ** np.maximum(length - 1 - p, 0) % 10
        code += np.where(p < length, digit + 1, 0) * 11 ** (_DIGITS - 1 - p)
    return code


_HALF = _DIGITS // 2
_POWERS = 10 ** np.arange(1, _DIGITS, dtype=np.int64)
_FIRST = _codes_slowly(np.arange(10 ** _HALF, dtype=np.int64))    # n < 10**4: n's code
# the code of exactly 4 digits (leading zeros too) as if in the first 4 of 4 places
_LAST = sum((np.arange(10 ** _HALF, dtype=np.int64) // 10 ** (_HALF - 1 - q) % 10 + 1) * 11 ** (_HALF - 1 - q)
            for q in range(_HALF))


def buffer_kinds(codes):
    """The kind (an index into ``BUFFER_KINDS``) of each buffer given by its ``buffer_code``
    (an array, or one int)."""
    return codes // 11 ** _DIGITS


def buffer_numbers(codes: np.ndarray) -> np.ndarray:
    """The number of each buffer given by its ``buffer_code`` (``o12`` -> 12), without names:
    the code's 8 base-11 digits read as two halves of 4 by table (a half's number and how many
    digits it has), a few passes over the codes rather than a few per digit."""
    codes = np.asarray(codes)
    if codes.dtype != np.int32:          # codes fit int32 (BUFFER_KINDS · 11**8 < 2**31)
        codes = codes.astype(np.int64)
    high, low = np.divmod(codes % 11 ** _DIGITS, 11 ** (_DIGITS // 2))
    return _HALF_NUMBER[high] * _HALF_SCALE[low] + _HALF_NUMBER[low]


def code_ranks(codes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``np.unique(codes, return_inverse=True)`` for buffer codes (``buffer_code``'s): the
    distinct codes, sorted, and where each code is among them. Only the distinct codes are
    sorted: each code marks its buffer (kind, number) in a table as long as the buffers the
    codes span. On a ViT-B/16 program's transfers (13.4 M references) 0.42 s instead of 0.74 s.
    Codes that are not buffers' (negative, or past the last kind), or whose buffers lie too far
    apart for such a table (``_RANK_TABLE_MAX``), go to ``np.unique``."""
    codes = np.asarray(codes)
    if not len(codes) or codes.min() < 0 or codes.max() >= len(BUFFER_KINDS) * 11 ** _DIGITS:
        return np.unique(codes, return_inverse=True)
    numbers = buffer_numbers(codes)
    span = int(numbers.max()) + 1
    dense = buffer_kinds(codes) * span + numbers             # a buffer's kind and number
    low = int(dense.min())
    dense -= low
    top = int(dense.max())
    if top >= _RANK_TABLE_MAX:                  # buffers too far apart for a table of them
        return np.unique(codes, return_inverse=True)
    seen = np.zeros(top + 1, bool)
    seen[dense] = True
    present = np.flatnonzero(seen)
    found = buffer_codes_of((present + low) // span, (present + low) % span)
    order = np.argsort(found)
    rank = np.empty(len(seen), np.int64)
    rank[present[order]] = np.arange(len(present))
    return found[order].astype(codes.dtype), rank[dense]


def _halves(digits: int) -> tuple[np.ndarray, np.ndarray]:
    """For every ``digits`` base-11 digits (1 + a decimal digit, 0 past the last), left-aligned:
    the decimal number they spell and how many they are."""
    number, length = np.zeros(1, np.int64), np.zeros(1, np.int64)
    for p in range(digits):             # one digit more on the right each time
        d = np.arange(11)
        number = np.where(d > 0, number[:, None] * 10 + d - 1, number[:, None]).ravel()
        length = (length[:, None] + (d > 0)).ravel()
    return number, length


#: the longest table ``code_ranks`` makes (a flag and a rank a buffer, 9 bytes each): ViT-B/16's
#: 2.5 M buffers fit many times over; codes of a program numbering ten times more go to np.unique
_RANK_TABLE_MAX = 1 << 26

_HALF_NUMBER, _HALF_LENGTH = _halves(_DIGITS // 2)
_HALF_SCALE = 10 ** _HALF_LENGTH


# plan blobs made in this process whose values the engine has not taken yet (``take_value``):
# by the blob's id, the blob kept alive with it; a few, should a maker never hand one over
_MADE: "collections.OrderedDict[int, tuple[bytes, object]]" = collections.OrderedDict()
_MADE_KEPT = 4
_made_lock = threading.Lock()


def take_value(data: bytes) -> tuple[bool, object]:
    """``(True, value)`` if ``data`` is a blob ``to_plan_blob`` made of ``value`` in this process
    (once: the engine takes it to hand readers the value without decoding the bytes), else
    ``(False, None)``. A ``bytes`` subclass carrying the value (as ``canonical.Json`` does)
    would cost a copy of the blob, and another where the store streams it to disk."""
    with _made_lock:
        found = _MADE.pop(id(data), None)
    if found is None or found[0] is not data:
        return False, None
    return True, found[1]


def to_plan_blob(value, arrays: tuple[tuple, ...]) -> bytes:
    """A planning artifact that holds numpy arrays (a program's transfers: millions of rows) as
    ``canonical.PLAN_MAGIC``, then a ``tensors.pack`` of its JSON skeleton and its arrays as raw
    little-endian data: hashed as bytes, read without a Python object per row, deterministic.

    ``arrays`` names where the value holds arrays, each a path of keys and list indices, ``"*"``
    standing for every item of a list; the path ``()`` is the value itself. Every array a path
    reaches is stored in one array (concatenated along its first axis, with its ``starts``), and
    ``None`` in its place in the skeleton. ``engine.decoded`` reads it back (``from_plan_blob``)."""
    import orjson
    members, where, skeleton = {}, [], value
    for n, path in enumerate(arrays):
        found = []
        skeleton = _take(skeleton, list(path), found)
        if found:
            members[f"a{n}"] = found                   # concatenated as it is written
            members[f"a{n}.starts"] = np.cumsum([0] + [len(a) for a in found], dtype=np.int64)
        where.append(list(path))
    head = orjson.dumps({"value": skeleton, "arrays": where}, option=orjson.OPT_SORT_KEYS)
    members["skeleton"] = np.frombuffer(head, np.uint8)
    out = tensors.pack(members, prefix=canonical.PLAN_MAGIC)
    with _made_lock:
        _MADE[id(out)] = (out, value)
        while len(_MADE) > _MADE_KEPT:
            _MADE.popitem(last=False)
    return out


def _take(value, path: list, found: list):
    """``value`` with the arrays on ``path`` replaced by None (containers on it copied), the
    arrays appended to ``found`` in order."""
    if not path:
        found.append(np.asarray(value))
        return None
    key, rest = path[0], path[1:]
    if key == "*":
        return [_take(item, rest, found) for item in value]
    copy = dict(value) if isinstance(value, dict) else list(value)
    copy[key] = _take(value[key], rest, found)
    return copy


def from_plan_blob(data: bytes):
    """The value of a ``to_plan_blob`` blob, its arrays views of ``data`` (read-only)."""
    import orjson
    members = tensors.unpack(memoryview(data)[len(canonical.PLAN_MAGIC):])
    head = orjson.loads(members["skeleton"].tobytes())
    value = head["value"]
    for n, path in enumerate(head["arrays"]):
        if f"a{n}" not in members:
            continue
        whole, starts = members[f"a{n}"], members[f"a{n}.starts"].tolist()
        parts = iter(whole[a:b] for a, b in zip(starts, starts[1:]))
        value = _put(value, path, parts)
    return value


_VIEW_BYTES = 112       # sys.getsizeof of a numpy view


def plan_blob_memory(data: bytes) -> int:
    """About how much memory ``from_plan_blob``'s value holds, read from the blob's header: the
    blob itself (its arrays are views of it), the JSON skeleton as Python objects (8 bytes a byte,
    as ``canonical.heap_estimate``) and a view object per array it hands out."""
    _, members = tensors.read_header(memoryview(data)[len(canonical.PLAN_MAGIC):])
    skeleton = next(size for name, _, _, _, size in members if name == "skeleton")
    views = sum(shape[0] - 1 for name, _, shape, _, _ in members if name.endswith(".starts"))
    return len(data) + 8 * skeleton + _VIEW_BYTES * views


def _put(value, path: list, parts):
    if not path:
        return next(parts)
    key, rest = path[0], path[1:]
    if key == "*":
        return [_put(item, rest, parts) for item in value]
    value[key] = _put(value[key], rest, parts)
    return value


def to_json(value) -> bytes:
    """A phase's JSON output (the value must be JSON-normal: see ``canonical.Json``)."""
    return canonical.encode(value)
