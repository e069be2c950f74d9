"""Code fingerprints: the digest of a module's source and of every module of its own package it
imports, transitively. Editing code a phase runs changes its fingerprint (and so its action
keys); editing a module it never imports does not.
"""
from __future__ import annotations

import ast
import functools
import hashlib
import importlib.util
from pathlib import Path


@functools.lru_cache(maxsize=None)
def _source(modname: str) -> tuple[str, bytes] | None:
    try:
        spec = importlib.util.find_spec(modname)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.origin or not spec.origin.endswith(".py"):
        return None
    return spec.origin, Path(spec.origin).read_bytes()


@functools.lru_cache(maxsize=None)
def _imports(modname: str) -> tuple[str, ...]:
    """Modules of the same top-level package that ``modname`` imports."""
    found = _source(modname)
    if found is None:
        return ()
    origin, text = found
    is_pkg = origin.endswith("__init__.py")
    package = modname if is_pkg else modname.rpartition(".")[0]
    top = modname.split(".")[0]
    names = set()
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                base = ".".join(base + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            names.add(base)
            names.update(f"{base}.{a.name}" for a in node.names)
    return tuple(sorted(n for n in names if n.split(".")[0] == top and _source(n) is not None))


def closure(modname: str) -> list[str]:
    """``modname`` and every same-package module it imports, transitively, sorted."""
    seen, todo = set(), [modname]
    while todo:
        m = todo.pop()
        if m in seen or _source(m) is None:
            continue
        seen.add(m)
        todo.extend(_imports(m))
    return sorted(seen)


@functools.lru_cache(maxsize=None)
def code_fingerprint(modname: str) -> str:
    """sha256 over the sources of ``closure(modname)``."""
    h = hashlib.sha256()
    for m in closure(modname):
        h.update(m.encode() + b"\0" + hashlib.sha256(_source(m)[1]).digest())
    return h.hexdigest()


def clear() -> None:
    """Forget cached sources (tests that edit code in place call this)."""
    _source.cache_clear()
    _imports.cache_clear()
    code_fingerprint.cache_clear()
