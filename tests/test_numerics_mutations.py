"""The numerical test catches kernel bugs and says where (ipubuild/compare.py, the checked kernels).

Through the kernel developer's loop — an edit of a C source in the tree's copy of ipubuild/,
then ``doit build`` — each deliberate bug of ``tests/mutations.py`` fails the build and the
verdict names the operation that went wrong first, its kernel variant and tile; the error
limit, alone, fails a bug that the cosine gate lets through; and a lowering that hands a kernel
the wrong size makes ``deviceTest=FAIL``, naming the tile and vertex. The trees share one cache,
as in test_console.py, so each build re-does only what its edit touches.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from buildtree import SMALL, assert_passed, copy_ipubuild, doit, env, make_tree, package
from mutations import MUTATIONS

TEXT = SMALL.replace("rounds = 3", "rounds = 1")


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("shared") / "cache"


@pytest.fixture(scope="module")
def built(tmp_path_factory, cache) -> tuple[Path, bytes]:
    """A tree with its own copy of ipubuild/, built once (clean: every operation compared), and
    its package."""
    tree = make_tree(tmp_path_factory.mktemp("tree"), {"small": TEXT})
    copy_ipubuild(tree)
    run = build(tree, cache)
    assert_passed(run, "small")
    assert "deviceTest=PASS" in run.stdout, run.tail()
    return tree, package(tree, "small")


@pytest.fixture(scope="module")
def tree(built) -> Path:
    return built[0]


def build(tree: Path, cache: Path):
    return doit(tree, "build:small", environ=env(tree, IPUBUILD_CACHE_DIR=str(cache)))


def verdict(tree: Path) -> dict:
    return json.loads((tree / "artifacts" / "small" / "small.verdict.json").read_text())


def error_line(run) -> str:
    lines = [ln for ln in run.output.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1, run.tail()
    return lines[0]


def test_a_clean_build_compares_every_operation(tree):
    v = verdict(tree)
    ops = v["operations"]
    assert v["pass"] and v["device_ok"] and v["failed_gates"] == []
    assert ops["mode"] == "operations" and ops["diverged"] == [] and ops["first"] is None
    names = [e["op"] for e in ops["each"]]
    assert names[0] == "patchify" and names[-1] == "head" and len(names) == 19, names
    assert all(e["failed"] == 0 for e in ops["each"])


@pytest.mark.parametrize("mutation", MUTATIONS, ids=[m.name for m in MUTATIONS])
def test_a_kernel_bug_fails_the_build_naming_its_operation(tree, cache, mutation):
    before = mutation.apply(tree)
    try:
        run = build(tree, cache)
    finally:
        mutation.revert(tree, before)
    assert run.returncode == 1, run.tail()
    assert "numericalTest=FAIL" in run.stdout and "deviceTest=PASS" in run.stdout, run.tail()
    assert "Traceback" not in run.output, run.tail()
    first = verdict(tree)["operations"]["first"]
    assert (first["type"] if mutation.by_type else first["op"]) == mutation.op, first
    w = first["worst"]
    assert w["kernel"].startswith(mutation.kernel) and w["kernel"] in w["kernels"], first
    line = error_line(run)
    assert line.startswith(f"error: targets/small.toml: numerics: operation {first['op']} ({first['type']}) "
                           f"diverges first: {first['value']}["), line
    assert f"computed by kernel {w['kernel']} (vertex" in line and f"on tile {w['tile']}, step {w['step']})" in line, line
    assert f"expected {w['expected']} got {w['got']}" in line, line


def test_the_error_limit_alone_fails_a_bug_the_cosine_lets_through(tree, cache):
    """Graph outputs only (no per-operation comparison), a lax cosine gate and an error limit of
    0.1: dropping a matmul's bias moves the outputs by about 0.2 while their direction stays
    close. (The suite fails if the error half of the gate goes.)"""
    target = tree / "targets" / "small.toml"
    mutation = next(m for m in MUTATIONS if m.name == "matmul_bias_dropped")
    target.write_text(TEXT + '[numerics]\ncompare = "outputs"\nmin_cosine = 0.5\nmax_abs_error = 0.1\n')
    before = mutation.apply(tree)
    try:
        run = build(tree, cache)
    finally:
        mutation.revert(tree, before)
        target.write_text(TEXT)
    v = verdict(tree)
    assert run.returncode == 1 and "numericalTest=FAIL" in run.stdout, run.tail()
    assert v["failed_gates"] == ["max_abs_error"] and v["operations"] == {
        "mode": "outputs", "why": 'numerics.compare = "outputs"'}, v
    assert float(v["min_cosine"]) >= 0.5 and float(v["max_abs_error"]) > v["thresholds"]["max_abs_error"], v
    line = error_line(run)
    assert line == (f"error: targets/small.toml: numerics: numerical test failed (max abs error "
                    f"{v['max_abs_error']} vs {v['thresholds']['max_abs_error']})"), line


def test_a_kernel_given_the_wrong_size_traps_and_the_device_test_fails(tree, cache):
    """A lowering bug (the GELU told of 1024 times its elements): the checked kernel refuses
    its buffers instead of writing over the tile, and deviceTest=FAIL names tile and vertex."""
    operators = tree / "ipubuild" / "builtin" / "operators.py"
    text = operators.read_text()
    wrong = text.replace('[("r", 0, 0), ("w", 0, 0), (r1 - r0) * (c1 - c0), *_epilogue(op)]',
                         '[("r", 0, 0), ("w", 0, 0), (r1 - r0) * (c1 - c0) * 1024, *_epilogue(op)]')
    assert wrong != text
    operators.write_text(wrong)
    try:
        run = build(tree, cache)
    finally:
        operators.write_text(text)
    assert run.returncode == 1 and "Traceback" not in run.output, run.tail()
    assert re.search(r"^package=\S+ tiles=1472 device=ipumodel deviceTest=FAIL$", run.stdout, re.M), run.tail()
    v = verdict(tree)
    f = v["device_failures"][0]
    assert (f["kind"], f["kernel"], f["code"], f["name"]) == ("vertex", "gelu_f32_fp8", 3, "block0.gelu"), f
    line = error_line(run)
    assert line.startswith(f"error: device ipumodel: tile {f['tile']}, step {f['step']} (block0.gelu), "
                           f"vertex {f['vertex']} (gelu_f32_fp8): y[n] lies outside the tile's data memory"), line
    # the numbers it could not compute are named too
    assert v["operations"]["first"]["op"] == "block0.gelu"


def test_after_the_bugs_the_tree_builds_clean_again(built, cache):
    tree, clean_package = built
    run = build(tree, cache)
    assert_passed(run, "small")
    assert "deviceTest=PASS" in run.stdout
    assert package(tree, "small") == clean_package
