"""The house in layers (docs/architecture.md, "Layers"): no import circle between ipubuild's
modules, none between its folders, arrows only downward in the order the architecture page
lists, and the old flat paths served by the one alias table. Read from the syntax trees of
ipubuild/ (imports inside functions count, and so do ``importlib.import_module("ipubuild...")``
calls; ``if TYPE_CHECKING:`` blocks do not); nothing is imported to draw the graph."""
from __future__ import annotations

import ast
import importlib
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

import ipubuild

PKG = Path(ipubuild.__file__).resolve().parent
ROOT = PKG.parent


def modules() -> dict[str, Path]:
    out = {}
    for path in sorted(PKG.rglob("*.py")):
        if "__pycache__" in path.parts:
            continue
        parts = ["ipubuild", *path.relative_to(PKG).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


MODULES = modules()


def _known(name: str) -> str:
    """The longest module of ipubuild that ``name`` names (``ipubuild.engine.store.Store`` -> the store)."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name


def imports(name: str, path: Path) -> set[str]:
    """The ipubuild modules ``name`` imports (its own parent packages left out)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    skip = {id(x) for n in ast.walk(tree) if isinstance(n, ast.If) and "TYPE_CHECKING" in ast.unparse(n.test)
            for b in n.body for x in ast.walk(b)}
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for n in ast.walk(tree):
        if id(n) in skip:
            continue
        if isinstance(n, ast.Import):
            names = [a.name for a in n.names]
        elif isinstance(n, ast.ImportFrom):
            base = n.module or ""
            if n.level:
                up = package.split(".")[:len(package.split(".")) - n.level + 1]
                base = ".".join(up + ([n.module] if n.module else []))
            names = [base, *(f"{base}.{a.name}" for a in n.names)]
        elif isinstance(n, ast.Call) and n.args and isinstance(n.args[0], ast.Constant) \
                and isinstance(n.args[0].value, str) and ast.unparse(n.func).split(".")[-1] in ("import_module", "__import__"):
            names = [n.args[0].value]
        else:
            continue
        for x in names:
            t = _known(x)
            if t and t != name and not name.startswith(t + "."):
                found.add(t)
    return found


GRAPH = {m: imports(m, p) for m, p in MODULES.items()}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan, iterative)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph.get(start, ()))))]
        index[start] = low[start] = counter[0]; counter[0] += 1; stack.append(start); on.add(start)
        while work:
            node, children = work[-1]
            for child in children:
                if child not in index:
                    index[child] = low[child] = counter[0]; counter[0] += 1; stack.append(child); on.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                    break
                if child in on:
                    low[node] = min(low[node], index[child])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    comp = []
                    while True:
                        x = stack.pop(); on.discard(x); comp.append(x)
                        if x == node:
                            break
                    if len(comp) > 1:
                        out.append(sorted(comp))
    return out


def folder(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "ipubuild"


def folder_graph() -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for a, bs in GRAPH.items():
        for b in bs:
            if folder(a) != folder(b) and "ipubuild" not in (folder(a), folder(b)):
                out.setdefault(folder(a), set()).add(folder(b))
    return out


def documented_order() -> list[str]:
    """The entries of ipubuild/ as docs/architecture.md's "Layers" section lists them, bottom first."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    section = re.search(r"^## Layers\n(.*?)(?=^## )", text, re.M | re.S)
    assert section, "docs/architecture.md has no '## Layers' section"
    return re.findall(r"^\d+\. `ipubuild/([a-z_]+)(?:/|\.py)`", section[1], re.M)


def test_the_circle_finder_finds_a_circle_and_an_import_inside_a_function():
    # the finder itself: a circle through a function-level import and one by name are circles
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []
    src = "def f():\n    from .x import y\n    importlib.import_module('ipubuild.z')\n"
    tree = ast.parse(src)
    calls = [n for n in ast.walk(tree) if isinstance(n, (ast.ImportFrom, ast.Call))]
    assert len(calls) == 2


def test_no_import_circle_between_modules():
    found = circles(GRAPH)
    assert not found, f"import circle(s): {[' -> '.join(c) for c in found]}"


def test_no_import_circle_between_folders():
    found = circles(folder_graph())
    assert not found, f"folder circle(s): {[' <-> '.join(c) for c in found]}"


def test_arrows_point_down_the_documented_order():
    order = documented_order()
    entries = sorted(p.name.removesuffix(".py") for p in PKG.iterdir()
                     if p.name != "__pycache__" and p.name != "__init__.py" and not p.name.startswith("."))
    assert sorted(order) == entries, f"docs/architecture.md's layers {order} are not the folders {entries}"
    assert len(entries) + 1 <= 14, "at most 14 entries directly under ipubuild/"
    rank = {name: i for i, name in enumerate(order)}
    up = sorted(f"{a} -> {b}" for a, bs in folder_graph().items() for b in bs if rank[b] > rank[a])
    assert not up, f"imports up the layers (docs/architecture.md lists them bottom first): {up}"


def test_the_engine_imports_nothing_about_tiles_graphs_or_doit():
    allowed = {"engine", "hookspecs"}
    bad = sorted(f"{a} -> {b}" for a, bs in GRAPH.items() if folder(a) == "engine"
                 for b in bs if folder(b) not in allowed | {"ipubuild"})
    assert not bad, bad
    third = set()
    for m, p in MODULES.items():
        if folder(m) == "engine":
            for n in ast.walk(ast.parse(p.read_text())):
                if isinstance(n, (ast.Import, ast.ImportFrom)) and not getattr(n, "level", 0):
                    third |= {(a.name if isinstance(n, ast.Import) else n.module).split(".")[0] for a in n.names}
    assert not third & {"doit", "numpy", "rich"}, third & {"doit", "numpy", "rich"}


def test_an_old_path_is_the_new_module_and_warns_unless_documented():
    for old, new in ipubuild.MOVED.items():
        if old in ipubuild.FOLDER_OF_MODULE:
            continue
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            sys.modules.pop(old, None)
            got = importlib.import_module(old)
        assert got is importlib.import_module(new), old
        warned = [w for w in seen if issubclass(w.category, DeprecationWarning) and old in str(w.message)]
        assert bool(warned) == (old not in ipubuild.PUBLIC), (old, [str(w.message) for w in seen])
    # a folder that took a module's name gives that module's names
    from ipubuild.device import DeviceRun
    from ipubuild.device.device import DeviceRun as Real
    assert DeviceRun is Real
    with pytest.warns(DeprecationWarning, match="ipubuild.engine moved"):
        from ipubuild.engine import Engine
    from ipubuild.engine.engine import Engine as RealEngine
    assert Engine is RealEngine


def test_an_old_path_fingerprints_the_same_file():
    from ipubuild.engine import fingerprint
    assert fingerprint.source_file("ipubuild.store") == fingerprint.source_file("ipubuild.engine.store")
    assert fingerprint.source_file("ipubuild.planning.cost") == str(PKG / "compiler" / "planning" / "cost.py")


def test_importing_a_folder_stays_light():
    code = ("import sys, ipubuild.engine, ipubuild.graph, ipubuild.compiler, ipubuild.device, ipubuild.build, "
            "ipubuild.ui, ipubuild.kernels\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('numpy', 'pluggy', 'doit', 'rich')"
            " or m.count('.') > 1 and m.startswith('ipubuild.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", out
