"""Code fingerprints: the digest of a module's code and of every module of its own package it
imports, transitively. Editing code a phase runs changes its fingerprint (and so its action
keys); editing a module it never imports does not.

Code is fingerprinted on its syntax tree, without comments and docstrings: a comment or a reworded
docstring cannot change what a phase computes, so it re-runs nothing. Each file's tree digest and
import list are remembered by its stat key (``files.StatMemo``, in the cache directory), so only
edited files are parsed again.
"""
from __future__ import annotations

import ast
import functools
import hashlib
import importlib.util
import threading
from pathlib import Path

from .files import StatMemo

_memo = StatMemo(None)


def use_memo(path: Path | None) -> None:
    """Remember per-file facts in ``path`` (the workspace's cache directory sets it)."""
    global _memo
    if _memo.path != (Path(path) if path else None):
        _memo.save()
        _memo = StatMemo(path)
        clear()


def save_memo() -> None:
    _memo.save()


@functools.lru_cache(maxsize=None)
def source_file(modname: str) -> str | None:
    """The ``.py`` file a module is loaded from (None for built-ins, extensions, unknown names)."""
    try:
        spec = importlib.util.find_spec(modname)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.origin or not spec.origin.endswith(".py"):
        return None
    return spec.origin


def strip_docstrings(tree: ast.AST) -> ast.AST:
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
                    and isinstance(body[0].value.value, str):
                node.body = body[1:] or [ast.Pass()]
    return tree


#: one ``ast.parse`` at a time: CPython 3.11's parser counts its recursion depth per interpreter,
#: and two threads parsing at once fail with "AST constructor recursion depth mismatch" (phases
#: run on threads: ``executors.run_phases``)
_parsing = threading.Lock()


def _analyse(path: str) -> list:
    """``[digest of the comment- and docstring-free syntax tree, [(level, module, names)]]``."""
    source = Path(path).read_bytes()
    with _parsing:
        tree = ast.parse(source, filename=path)
    imports = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imports.extend([0, a.name, []] for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            imports.append([node.level, node.module or "", [a.name for a in node.names]])
    dump = ast.dump(strip_docstrings(tree), annotate_fields=False, include_attributes=False)
    return [hashlib.sha256(dump.encode()).hexdigest(), imports]


def _facts(modname: str) -> list | None:
    path = source_file(modname)
    return None if path is None else _memo.get(path, _analyse, kind="ast1")


@functools.lru_cache(maxsize=None)
def _imports(modname: str) -> tuple[str, ...]:
    """Modules of the same top-level package that ``modname`` imports."""
    facts = _facts(modname)
    if facts is None:
        return ()
    is_pkg = source_file(modname).endswith("__init__.py")
    package = modname if is_pkg else modname.rpartition(".")[0]
    top = modname.split(".")[0]
    names = set()
    for level, module, members in facts[1]:
        if level:
            base = package.split(".")
            base = ".".join(base[: len(base) - level + 1] + ([module] if module else []))
        else:
            base = module
        names.add(base)
        names.update(f"{base}.{m}" for m in members)
    return tuple(sorted(n for n in names if n.split(".")[0] == top and source_file(n) is not None))


def closure(modname: str) -> list[str]:
    """``modname`` and every same-package module it imports, transitively, sorted."""
    seen, todo = set(), [modname]
    while todo:
        m = todo.pop()
        if m in seen or source_file(m) is None:
            continue
        seen.add(m)
        todo.extend(_imports(m))
    return sorted(seen)


@functools.lru_cache(maxsize=None)
def code_fingerprint(modname: str) -> str:
    """sha256 over the syntax-tree digests of ``closure(modname)``."""
    h = hashlib.sha256()
    for m in closure(modname):
        h.update(m.encode() + b"\0" + _facts(m)[0].encode())
    return h.hexdigest()


def module_digest(modname: str) -> str | None:
    """The digest of one module's comment- and docstring-free syntax tree (None without a source)."""
    facts = _facts(modname)
    return None if facts is None else facts[0]


def files_of(modname: str) -> list[str]:
    """The source files behind ``code_fingerprint(modname)``."""
    return [source_file(m) for m in closure(modname)]


def clear() -> None:
    """Forget fingerprints computed in this process (tests that edit code in place call this)."""
    source_file.cache_clear()
    _imports.cache_clear()
    code_fingerprint.cache_clear()
