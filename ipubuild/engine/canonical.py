"""Canonical serialisation: one byte string per value, so that equal values have equal digests.

JSON with sorted keys, no whitespace and ASCII escapes. Floats are written by Python's shortest
round-trip repr (deterministic for IEEE doubles); NaN and infinities are refused. Bulk numbers
(weights, tensors) are stored as raw little-endian arrays, never as JSON.
"""
import hashlib
import json


def dumps(value) -> bytes:
    """The canonical bytes of a JSON-able value (dicts with str keys, lists, str, int, float, bool, None)."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=True,
                      allow_nan=False).encode()


def loads(data: bytes):
    return json.loads(data)


def digest(data: bytes) -> str:
    """The sha256 hex digest that addresses a blob."""
    return hashlib.sha256(data).hexdigest()


def digest_of(value) -> str:
    return digest(dumps(value))


class Json(bytes):
    """Canonical JSON bytes that remember the value they encode, so that the engine can hand that
    value to readers in this process without decoding the bytes again. Only for *JSON-normal*
    values — dicts with str keys, lists (not tuples), str, int, float, bool, None — which decode to
    an equal value (tests check every planning artifact)."""

    value: object


PLAN_MAGIC = b"\x00ipubuild-plan\x00"
"""How a planning artifact that carries arrays begins (JSON never does): see
``graph.artifacts.to_plan_blob``, which writes and reads them."""


def heap_estimate(data: bytes) -> int:
    """About how much memory the decoded value of a JSON blob takes: 8 bytes a byte (measured
    6.2-7.4 on planning artifacts). A plan blob's codec estimates its own (the engine asks it)."""
    return 8 * len(data)


def is_plan_blob(data: bytes) -> bool:
    """Whether a blob is a planning artifact with arrays (read by ``registry.PLAN_CODEC``)."""
    return data[:len(PLAN_MAGIC)] == PLAN_MAGIC


def encode(value) -> Json:
    """``dumps(value)``, remembering ``value`` (which must be JSON-normal)."""
    out = Json(dumps(value))
    out.value = value
    return out


def is_normal(value) -> bool:
    """Whether ``loads(dumps(value)) == value`` holds structurally (no tuples, only str keys)."""
    if isinstance(value, dict):
        return all(isinstance(k, str) and is_normal(v) for k, v in value.items())
    if isinstance(value, list):
        return all(is_normal(v) for v in value)
    return value is None or isinstance(value, (str, int, float, bool))
