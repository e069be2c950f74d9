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
