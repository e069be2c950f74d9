"""Targets a plugin ships (``ipubuild_targets``): ``doit build:<name>`` finds them after the
tree's own ``targets/``, builds them into the tree's ``artifacts/``, re-derives the task graph
when the shipped file changes; bare ``doit`` leaves them alone; a name given twice is an error
naming both sources."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from buildtree import SMALL, doit, env, make_tree

PLUGIN = '''\
from pathlib import Path

from ipubuild import hookimpl

HERE = Path(__file__).resolve().parent


@hookimpl
def ipubuild_targets():
    return sorted((HERE / "{folder}").glob("*.toml"))
'''

SHIPPED = SMALL.replace("rounds = 3", "rounds = 1")


def plugin(tmp_path: Path, module: str, targets: dict[str, str], folder: str | None = None) -> Path:
    """A plugin module ``module`` in ``tmp_path/plugins`` shipping ``{name: toml text}``."""
    folder = folder or f"{module}_targets"
    root = tmp_path / "plugins"
    (root / folder).mkdir(parents=True, exist_ok=True)
    (root / f"{module}.py").write_text(PLUGIN.format(folder=folder))
    for name, text in targets.items():
        (root / folder / f"{name}.toml").write_text(text)
    return root


def environ(tree: Path, plugins_root: Path, modules: str, cache: Path) -> dict:
    e = env(tree, IPUBUILD_PLUGINS=modules, IPUBUILD_CACHE_DIR=str(cache), IPUBUILD_DISABLE_PLUGIN_AUTOLOAD="1")
    e["PYTHONPATH"] = f"{plugins_root}:{e['PYTHONPATH']}"
    return e


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("shared") / "cache"


def test_a_shipped_target_builds_by_name_and_its_edits_re_derive_the_graph(tmp_path, cache):
    tree = make_tree(tmp_path / "tree", {"small": SHIPPED})
    root = plugin(tmp_path, "ships_one", {"shipped_small": SHIPPED})
    e = environ(tree, root, "ships_one", cache)
    listed = doit(tree, "list", environ=e)
    assert re.search(r"^build .*: small, shipped_small \(from plugin ships_one\)$", listed.stdout, re.M), listed.tail()
    run = doit(tree, "build:shipped_small", environ=e)
    assert run.returncode == 0 and "numericalTest=PASS" in run.stdout, run.tail()
    assert (tree / "artifacts" / "shipped_small" / "shipped_small.ipuexe").is_file()
    # named by its path inside the plugin's folder, wherever that is installed
    resolved = (tree / "artifacts" / "shipped_small" / "shipped_small.resolved.toml").read_text()
    assert "rounds = 1" in resolved
    again = doit(tree, "build:shipped_small", environ=e)
    assert again.returncode == 0 and not again.executed, again.tail()
    shipped = root / "ships_one_targets" / "shipped_small.toml"
    shipped.write_text(SHIPPED.replace("rounds = 1", "rounds = 0"))
    edited = doit(tree, "build:shipped_small", environ=e)
    assert edited.returncode == 0 and "plan_package:shipped_small" in edited.executed, edited.tail()
    assert "rounds = 0" in (tree / "artifacts" / "shipped_small" / "shipped_small.resolved.toml").read_text()


def test_bare_doit_builds_the_default_targets_shipped_ones_too(tmp_path, cache):
    tree = make_tree(tmp_path / "tree", {"small": SHIPPED})
    big = SHIPPED.replace("[target]\n", "[target]\ndefault = false\n", 1)       # built only when named
    root = plugin(tmp_path, "ships_two", {"shipped_small": SHIPPED, "shipped_big": big})
    run = doit(tree, environ=environ(tree, root, "ships_two", cache))
    assert run.returncode == 0 and "numericalTest=PASS" in run.stdout, run.tail()
    assert any(t.endswith(":small") for t in run.executed) or "-- build:small" in run.stdout, run.tail()
    assert (tree / "artifacts" / "shipped_small" / "shipped_small.ipuexe").is_file(), run.tail()
    assert not [t for t in run.executed if t.endswith(":shipped_big")], run.executed
    assert not (tree / "artifacts" / "shipped_big").exists()
    assert "skipped 1 target marked [target] default = false: shipped_big" in run.stdout, run.tail()


def test_a_name_both_the_tree_and_a_plugin_give_is_an_error_naming_both(tmp_path, cache):
    tree = make_tree(tmp_path / "tree", {"small": SHIPPED, "twice": SHIPPED})
    root = plugin(tmp_path, "ships_three", {"twice": SHIPPED})
    e = environ(tree, root, "ships_three", cache)
    run = doit(tree, "build:twice", environ=e)
    assert run.returncode != 0 and "Traceback" not in run.output, run.tail()
    (line,) = run.error_lines
    assert "targets/twice.toml" in line and "ships_three_targets/twice.toml" in line and "ships_three" in line, line
    assert doit(tree, "build:small", environ=e).returncode == 0


def test_two_plugins_shipping_one_name_and_a_bad_path_are_one_line_errors(tmp_path, cache):
    tree = make_tree(tmp_path / "tree", {"small": SHIPPED})
    root = plugin(tmp_path, "ships_a", {"same": SHIPPED})
    plugin(tmp_path, "ships_b", {"same": SHIPPED})
    run = doit(tree, "build:small", environ=environ(tree, root, "ships_a,ships_b", cache))
    assert run.returncode != 0 and "Traceback" not in run.output, run.tail()
    (line,) = run.error_lines
    assert "ships_b" in line and "ships_a" in line and "'same'" in line, line
    (root / "ships_bad.py").write_text("from ipubuild import hookimpl\n\n\n@hookimpl\ndef ipubuild_targets():\n"
                                       "    return ['/nowhere/x.toml']\n")
    run = doit(tree, "build:small", environ=environ(tree, root, "ships_bad", cache))
    (line,) = run.error_lines
    assert "plugin ships_bad" in line and "/nowhere/x.toml is not a target file" in line, line
