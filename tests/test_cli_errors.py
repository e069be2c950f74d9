"""Malformed targets through the command line: ``doit build:<bad>`` exits non-zero with ONE line
``error: <file>: <key>: <what to do>`` and no traceback, and leaves the cache of a good target in
the same tree intact (its next build executes nothing but ``build:<good>`` and its package bytes
do not change). Bad target files sitting beside a good one do not stop it building.

All bad targets live in one tree (``targets/bad_<case>.toml``) beside the small target, built
once; each case only touches its own tasks. The unknown-machine case gets fresh trees of its own.
"""
from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
from buildtree import SMALL, assert_passed, doit, make_tree, package, snapshot

GOOD = "small"


def _sub(old: str, new: str, text: str = SMALL) -> str:
    assert old in text, old
    return text.replace(old, new, 1)


@dataclasses.dataclass
class Case:
    id: str
    text: str | bytes
    says: tuple[str, ...]          # what the error line must name besides the file
    names_file: bool = True


CASES = [
    Case("syntax_error", "[target\ntile_count = 16\n", ("not valid TOML", "line 1")),
    Case("empty_file", "", ("no [target] table",)),
    Case("not_utf8", b"[target]\ntile_count = 16 # \xff\xfe\n[model]\nfamily = \"vit\"\n", ("UTF-8",)),
    Case("unknown_key", _sub("tile_count = 16", "tile_count = 16\ntiles = 4"), ("target.tiles", "unknown key")),
    Case("unknown_section", SMALL + "[optimizer]\nlr = 0.1\n", ("optimizer", "unknown section")),
    Case("missing_model_table", "[target]\ntile_count = 16\n", ("model", "missing required table")),
    Case("section_not_a_table", "model = 3\n[target]\ntile_count = 16\n", ("model", "expected a table")),
    Case("wrong_type", _sub("tile_count = 16", 'tile_count = "16"'), ("target.tile_count", "integer")),
    Case("bool_for_int", _sub("tile_count = 16", "tile_count = true"), ("target.tile_count", "got true")),
    Case("negative_size", _sub("image_size = 64", "image_size = -64"), ("model.image_size", "-64")),
    Case("zero_tile_count", _sub("tile_count = 16", "tile_count = 0"), ("target.tile_count", "got 0")),
    Case("more_tiles_than_machine", _sub("tile_count = 16", "tile_count = 2000"), ("target.tile_count", "1472")),
    Case("unknown_model_family", _sub('family = "vit"', 'family = "resnet"'), ("model.family", "'resnet'", "vit")),
    Case("unknown_cast_policy", SMALL + '[casts]\npolicy = "f999"\n', ("casts.policy", "'f999'", "f143")),
    Case("unknown_cast_scaling", SMALL + '[casts]\nscaling = "amax"\n', ("casts.scaling", "amax_pow2")),
    Case("unknown_storage_mode", SMALL + '[casts.storage]\ndefault = "shared"\n',
         ("casts.storage.default", "separate")),
    Case("unknown_device", _sub("tile_count = 16", 'tile_count = 16\ndevice = "ipu-hw"'),
         ("target.device", "'ipu-hw'", "ipumodel")),
    Case("heads_not_dividing_width", _sub("heads = 2", "heads = 3"), ("model.heads", "divide")),
    Case("patch_not_dividing_image", _sub("patch = 16", "patch = 24"), ("model.patch", "divide")),
    Case("image_too_big_for_one_tile",
         _sub("image_size = 64", "image_size = 512", _sub("tile_count = 16", "tile_count = 1")),
         ("target.tile_count", "the model needs at least", "it needs at least", "tiles, or a smaller model")),
    Case("zero_search_workers", _sub("workers = 2", "workers = 0"), ("search.workers", "got 0")),
    Case("min_cosine_above_one", SMALL + "[numerics]\nmin_cosine = 2\n", ("numerics.min_cosine", "at most 1")),
    Case("max_abs_error_nan", SMALL + "[numerics]\nmax_abs_error = nan\n", ("numerics.max_abs_error", "nan")),
]


def _write(path: Path, content: str | bytes) -> None:
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content)


class Tree:
    def __init__(self, root: Path, environ: dict, first):
        self.root, self.environ, self.first = root, environ, first
        self.package = package(root, GOOD)


@pytest.fixture(scope="module")
def environ(tmp_path_factory) -> dict:
    """Builds import a snapshot of ipubuild/ (fixed code while the working copy is edited)."""
    return snapshot(tmp_path_factory.mktemp("code"))


@pytest.fixture(scope="module")
def tree(tmp_path_factory, environ) -> Tree:
    """One tree with the good small target (built, with every bad target already present)."""
    root = make_tree(tmp_path_factory.mktemp("cli"))
    for case in CASES:
        _write(root / "targets" / f"bad_{case.id}.toml", case.text)
    first = doit(root, f"build:{GOOD}", environ=environ)
    assert_passed(first, GOOD)
    return Tree(root, environ, first)


def assert_one_error_line(run, *, names: tuple[str, ...], file: str | None):
    """Exit non-zero, no traceback, exactly one ``error:`` line naming ``file`` and ``names``."""
    assert run.returncode != 0, run.tail()
    assert "Traceback" not in run.output, run.tail()
    assert len(run.error_lines) == 1, run.tail()
    line = run.error_lines[0]
    if file is not None:
        assert line.startswith(f"error: {file}: "), line
    for word in names:
        assert word in line, f"{word!r} not in {line!r}"
    assert "internal error" not in line, line
    return line


def assert_good_cache_intact(tree: Tree):
    run = doit(tree.root, f"build:{GOOD}", environ=tree.environ)
    assert_passed(run, GOOD)
    assert run.executed == [], run.tail()          # a no-op: even build: is up to date
    assert package(tree.root, GOOD) == tree.package


def test_good_target_builds_with_bad_targets_present(tree):
    """Every bad target file was already there when the good target was built (fixture)."""
    assert tree.first.error_lines == [], tree.first.tail()
    assert all(not t.startswith("build:bad_") for t in tree.first.executed), tree.first.executed
    listed = doit(tree.root, "list", "--all", environ=tree.environ)
    assert listed.returncode == 0 and "Traceback" not in listed.output, listed.tail()
    for case in CASES:
        assert re.search(rf"^build:bad_{case.id}\b", listed.stdout, re.MULTILINE), f"build:bad_{case.id} not listed"
    assert_good_cache_intact(tree)


@pytest.mark.parametrize("case", [pytest.param(c, id=c.id) for c in CASES])
def test_bad_target_is_one_error_line_and_keeps_the_cache(tree, case):
    name = f"bad_{case.id}"
    run = doit(tree.root, f"build:{name}", environ=tree.environ)
    assert_one_error_line(run, names=case.says, file=f"targets/{name}.toml" if case.names_file else None)
    assert not (tree.root / "artifacts" / name / f"{name}.ipuexe").exists()
    assert_good_cache_intact(tree)


# --- an unknown machine: fresh trees ------------------------------------------------------------

UNKNOWN_MACHINE = _sub("tile_count = 16", 'tile_count = 16\nmachine = "ipu99"')


def test_unknown_machine_is_one_error_line_naming_the_file(tmp_path, environ):
    # the good target sorts first, so the kernel tasks are bound to its machine (see below)
    root = make_tree(tmp_path / "tree", {"a_small": SMALL})
    assert_passed(doit(root, "build:a_small", environ=environ), "a_small")
    good = package(root, "a_small")
    (root / "targets" / "bad.toml").write_text(UNKNOWN_MACHINE)
    run = doit(root, "build:bad", environ=environ)
    assert_one_error_line(run, names=("target.machine", "ipu99", "ipu21"), file="targets/bad.toml")
    again = doit(root, "build:a_small", environ=environ)
    assert_passed(again, "a_small")
    assert again.executed == [], again.tail()
    assert package(root, "a_small") == good


def test_target_with_unknown_machine_does_not_break_a_good_target(tmp_path, environ):
    root = make_tree(tmp_path / "tree", {GOOD: SMALL, "a_bad": UNKNOWN_MACHINE})
    run = doit(root, f"build:{GOOD}", environ=environ)
    assert_passed(run, GOOD)
    assert not any(t.startswith("machine:ipu99") for t in run.executed), run.executed
