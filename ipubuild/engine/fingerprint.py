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
import concurrent.futures
import functools
import hashlib
import importlib.util
import multiprocessing
import os
import threading
from pathlib import Path

from .files import StatMemo

_memo = StatMemo(None)
AST_KIND = "ast1"       # the memo's kind for a module's facts (tree digest, imports)


def use_memo(path: Path | None) -> None:
    """Remember per-file facts in ``path`` (the workspace's cache directory sets it)."""
    global _memo
    if _memo.path != (Path(path) if path else None):
        finish_prefetch()
        _memo.save()
        _memo = StatMemo(path)
        clear()


def save_memo() -> None:
    finish_prefetch()
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


_SCOPES = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)


def _statements(tree: ast.AST):
    """Every statement of ``tree``, nested ones too (imports and docstrings are statements: an
    expression holds none, so walking the statement lists alone visits a tenth of the nodes
    ``ast.walk`` does)."""
    todo = [tree]
    while todo:
        node = todo.pop()
        yield node
        for field in ("body", "orelse", "finalbody", "handlers", "cases"):
            block = getattr(node, field, None)
            if isinstance(block, list):
                todo.extend(reversed(block))


def _strip_docstring(node: ast.AST) -> None:
    """Drop the docstring of a module, class or function ``node``."""
    if isinstance(node, _SCOPES):
        body = node.body
        if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
                and isinstance(body[0].value.value, str):
            node.body = body[1:] or [ast.Pass()]


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
    for node in _statements(tree):
        if isinstance(node, ast.Import):
            imports.extend([0, a.name, []] for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            imports.append([node.level, node.module or "", [a.name for a in node.names]])
        else:
            _strip_docstring(node)
    dump = ast.dump(tree, annotate_fields=False, include_attributes=False)
    return [hashlib.sha256(dump.encode()).hexdigest(), imports]


#: the fewest unanalysed files worth a process per core: a fresh clone has ~100 (0.6 s on one core);
#: an edit leaves one or two, which ``_facts`` parses when asked
PARALLEL_FROM = 16
#: a prefetch under way: ``(the process that started it, pool, [(path, stat key, read at)], future
#: of their facts)``
_pending: list = []
_pending_lock = threading.Lock()


def prefetch(paths) -> None:
    """Start analysing the Python files among ``paths`` that the memo holds nothing for, on
    every core, when there are many of them (a fresh clone), and return: the caller goes on
    (loading plugins, importing the compiler) while they are parsed, and the first fingerprint
    asked for, the memo's next save or switch, or ``finish_prefetch`` takes their facts. Only
    from a process with one thread (``_single_threaded``)."""
    finish_prefetch()
    missing = _memo.missing([p for p in paths if str(p).endswith(".py")], kind=AST_KIND)
    workers = min(os.cpu_count() or 1, len(missing) // (PARALLEL_FROM // 2))
    if len(missing) < PARALLEL_FROM or workers < 2 or not _single_threaded() \
            or "fork" not in multiprocessing.get_all_start_methods():
        return
    pool = concurrent.futures.ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork"))
    chunk = max(1, len(missing) // (4 * workers))
    with _pending_lock:
        _pending.append((os.getpid(), pool, missing, pool.map(_analysed, [m[0] for m in missing], chunksize=chunk)))


def _single_threaded() -> bool:
    """Whether this process runs one thread, native ones counted: the only state it may fork in.
    A thread pool that is not Python's counts too: an analysis in a build whose numpy had
    already started OpenBLAS's pool forked beside it, and OpenBLAS in the parent then spun
    forever on its next product (``check_numerics``'s). Where ``/proc`` cannot tell, no."""
    try:
        return len(os.listdir("/proc/self/task")) == 1
    except OSError:
        return False


def finish_prefetch() -> None:
    """Take the facts of a prefetch under way (waiting for it), and stop its processes. A process
    forked since then drops it: the processes are its parent's."""
    if not _pending:        # nearly always: no lock taken (a process forked while one was held)
        return
    with _pending_lock:
        while _pending:
            pid, pool, missing, facts = _pending.pop()
            if pid != os.getpid():
                continue
            try:
                for (path, key, read_at), value in zip(missing, facts):
                    _memo.remember(path, key, read_at, value, kind=AST_KIND)
            except concurrent.futures.process.BrokenProcessPool:
                pass                        # a worker killed: ``_facts`` parses what is left
            finally:
                pool.shutdown()


def _analysed(path: str) -> list | None:
    """``_analyse``, or None for a file it fails on: ``_facts`` parses it again when asked, and
    its error is raised there, for the module that needs it."""
    try:
        return _analyse(path)
    except Exception:   # noqa: BLE001 - any failure is the importer's to report, not the prefetch's
        return None


def _facts(modname: str) -> list | None:
    finish_prefetch()
    path = source_file(modname)
    return None if path is None else _memo.get(path, _analyse, kind=AST_KIND)


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
