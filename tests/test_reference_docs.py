"""docs/reference.md against the code: every hook with its arguments, every field and public
method of the types a plugin author uses, the dtypes, the machine description's and a target
file's keys, the search's reasons and counts, and every ipubuild name the example plugin (and
its tests) import. A change to one of those that the page does not describe fails here."""
from __future__ import annotations

import ast
import dataclasses
import inspect
import re
import tomllib
from pathlib import Path

import pytest

from ipubuild import device, estimator, frontend, hookspecs, ir, log, operators, passes, search, targets, testing

ROOT = Path(__file__).resolve().parent.parent
TEXT = (ROOT / "docs" / "reference.md").read_text()
PLUGIN = ROOT / "plugins" / "ipubuild-rmsnorm"


def section(title: str) -> str:
    """The text under the heading ``title`` (any level) up to the next heading of its level or above."""
    m = re.search(rf"^(#+) {re.escape(title)}\s*$", TEXT, re.M)
    assert m, f"docs/reference.md has no heading {title!r}"
    level = len(m[1])
    rest = TEXT[m.end():]
    end = re.search(rf"^#{{1,{level}}} ", rest, re.M)
    return rest[:end.start()] if end else rest


def mentioned(name: str, text: str) -> bool:
    return re.search(rf"`[^`]*\b{re.escape(name)}\b[^`]*`", text) is not None


def public(cls) -> list[str]:
    """The public methods, properties and class attributes a class defines itself."""
    return sorted(n for n, v in vars(cls).items() if not n.startswith("_")
                  and (callable(v) or isinstance(v, (property, staticmethod, classmethod, str, dict, tuple))))


DOCUMENTED = {   # heading -> (class, what must be named under it)
    "`Value`": (ir.Value, "fields+public"),
    "`Op`": (ir.Op, "fields"),
    "`Graph`": (ir.Graph, "public"),
    "`CastStoragePolicy`": (ir.CastStoragePolicy, "fields+public"),
    "`Operator`": (operators.Operator, "public"),
    "`Lowering`": (operators.Lowering, "fields"),
    "`TileWork`": (operators.TileWork, "fields"),
    "`KernelVariant`": (operators.KernelVariant, "fields"),
    "`GraphPass`": (passes.GraphPass, "fields+public"),
    "`Model`": (frontend.Model, "fields"),
    "`Heuristic`": (search.Heuristic, "fields"),
    "`Changes`": (search.Changes, "fields+public"),
    "`SearchContext`": (search.SearchContext, "attributes"),
    "`Estimator`": (estimator.Estimator, "public"),
    "`DeviceRun`": (device.DeviceRun, "fields"),
    "Logging": (log.PluginLogger, "public"),
}


@pytest.mark.parametrize("title", sorted(DOCUMENTED))
def test_every_field_and_method_is_described(title):
    cls, what = DOCUMENTED[title]
    names = []
    if "fields" in what:
        names += [f.name for f in dataclasses.fields(cls)]
    if "public" in what:
        names += public(cls)
    if what == "attributes":     # what __init__ assigns to self
        names += sorted(set(re.findall(r"self\.(\w+)", inspect.getsource(cls.__init__))))
    text = section(title)
    missing = [n for n in names if not mentioned(n, text)]
    assert not missing, f"docs/reference.md, section {title}: describe {missing} of {cls.__name__}"


def test_the_estimators_term_is_described_and_the_search_still_exports_the_estimator():
    text = section("`Estimator`")
    missing = [n for n in (*estimator.Term._fields, "constants") if not mentioned(n, text)]
    assert not missing, f"docs/reference.md, section `Estimator`: describe Term's {missing}"
    assert search.Estimator is estimator.Estimator   # the page promises the old import keeps working


def test_every_hook_is_described_with_its_arguments():
    table = section("Hooks")
    for name, fn in inspect.getmembers(hookspecs, inspect.isfunction):
        if not name.startswith("ipubuild_"):
            continue
        call = f"`{name}({', '.join(inspect.signature(fn).parameters)})`"
        assert call in table, f"docs/reference.md, Hooks: no row for {call}"


def test_dtypes_table_matches_the_ir():
    rows = dict(re.findall(r"^\| `(\w+)` \| (\d+) \|", section("Dtypes"), re.M))
    assert {k: int(v) for k, v in rows.items()} == ir.DTYPES
    for dtype, code in testing.TYPE_CODES.items():
        assert re.search(rf"^\| `{dtype}` .*= {code} \|$", section("Dtypes"), re.M), dtype
    assert set(testing.STORAGE) == set(ir.DTYPES)


def test_machine_keys_are_described():
    machine = tomllib.loads((ROOT / "ipubuild" / "machines" / "ipu21.toml").read_text())
    text = section("The machine description")
    keys = [k for k, v in machine.items() if not isinstance(v, dict)]
    keys += [k for v in machine.values() if isinstance(v, dict) for k in v]
    missing = [k for k in keys if not mentioned(k, text)]
    assert not missing, f"docs/reference.md, The machine description: describe {missing}"


def test_target_keys_are_described():
    text = section("Targets")
    for table, fields in targets.CORE_SCHEMA.items():
        assert f"`[{table}]`" in text, table
        for key, field in fields.items():
            assert mentioned(key, text), f"{table}.{key}"
            for sub in (field.schema or {}):
                assert mentioned(sub, text), f"{table}.{key}.{sub}"


def test_search_reasons_counts_and_unexpressed_fields_are_described():
    text = section("The search")
    for name in (*search.INVALID_REASONS, *search.HEURISTIC_COUNTS, *search.Changes.UNEXPRESSED):
        assert mentioned(name, text), name
    for stage in passes.STAGES:
        assert f'`"{stage}"`' in section("`GraphPass`"), stage


def test_the_search_log_lines_shown_are_the_ones_written():
    shown = re.findall(r"^    ([a-z][a-z ]+?) (?:\w+=)", section("Screening, ids and counts"), re.M)
    source = (ROOT / "ipubuild" / "compiler" / "search.py").read_text()
    assert shown and all(f'"{line}"' in source for line in shown), shown


def _imported_names(path: Path) -> set[tuple[str, str]]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "ipubuild":
            out.update((node.module, a.name) for a in node.names)
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "testing":
            out.add(("ipubuild.testing", node.attr))
    return out


def test_every_name_the_example_plugin_uses_is_described():
    files = sorted(p for p in PLUGIN.rglob("*.py") if "build" not in p.relative_to(PLUGIN).parts)
    names = set().union(*(_imported_names(p) for p in files))
    assert ("ipubuild.testing", "load_variant") in names and ("ipubuild.passes", "GraphPass") in names
    missing = [f"{m}.{n}" for m, n in sorted(names) if not mentioned(n, TEXT)]
    assert not missing, f"docs/reference.md does not describe {missing}"


def test_the_testing_module_is_described():
    text = section("Testing (`ipubuild.testing`)")
    names = [n for n, v in vars(testing).items() if not n.startswith("_") and getattr(v, "__module__", "") ==
             "ipubuild.testing"]
    missing = [n for n in names if not mentioned(n, text)]
    assert not missing, f"docs/reference.md, Testing: describe {missing}"
    for cls in (testing.Kernel, testing.TileMemory, testing.Built, testing.VertexRun):
        missing = [n for n in public(cls) if not mentioned(n, text)]
        assert not missing, f"docs/reference.md, Testing: describe {cls.__name__}'s {missing}"
