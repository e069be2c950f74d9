"""Figures measured on the compiled kernels (``ipubuild.build.kernel_profile``): a kernel code edit
changes its measured figures — and only its own — after a rebuild that runs no planning phase;
the count is the same on every run; a compiler without basic-block counting leaves the figures
out with a note, and the build passes."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from ipubuild.build.pipeline import Workspace

from buildtree import PLANNING_TASKS, assert_passed, copy_ipubuild, doit, env, make_tree

NAME = "small"
TEXT_ROUNDS = ("rounds = 3", "rounds = 1")
# an extra loop in gelu.c that the optimiser must keep (its counter is volatile): more basic
# blocks executed per call, the same results, the code still inside its reservation
GELU_EDIT = ("    return 0;\n}", "    for (volatile uint32_t j = 0; j < 8u; j++) {}\n    return 0;\n}")


def _kernels(tree: Path) -> dict:
    return json.loads((tree / "artifacts" / NAME / f"{NAME}.kernels.json").read_bytes())


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """A small tree with its own copy of ipubuild/ (so a test can edit its kernels), built."""
    base = tmp_path_factory.mktemp("kprofile")
    from buildtree import SMALL
    tree = make_tree(base / "tree", {NAME: SMALL.replace(*TEXT_ROUNDS)})
    copy_ipubuild(tree)
    environ = env(tree)
    assert_passed(doit(tree, f"build:{NAME}", environ=environ), NAME)
    return tree, environ


def _copy(built, tmp_path: Path) -> Path:
    tree = tmp_path / "tree"
    shutil.copytree(built[0], tree, symlinks=True)
    return tree


def test_a_kernel_code_edit_changes_its_measured_figures_and_plans_nothing(built, tmp_path):
    tree = _copy(built, tmp_path)
    environ = env(tree)
    before = _kernels(tree)
    profile = (tree / "artifacts" / NAME / f"{NAME}.profile.json").read_bytes()
    gelu = [k for k in before["kernels"] if k.startswith("gelu_")]
    assert gelu and len(before["kernels"]) > len(gelu), before
    src = tree / "ipubuild" / "kernels" / "gelu.c"
    text = src.read_text()
    assert GELU_EDIT[0] in text
    src.write_text(text.replace(*GELU_EDIT, 1))

    run = doit(tree, f"build:{NAME}", environ=environ)
    assert_passed(run, NAME)
    ran = {t.split(":")[0] for t in run.executed}
    assert {"compile_kernels", "measure_kernels", "report_profile"} <= ran, run.executed
    assert not ran & set(PLANNING_TASKS), run.executed
    after = _kernels(tree)
    for name, k in before["kernels"].items():
        changed = {f for f in k if k[f] != after["kernels"][name][f]}
        if name in gelu:     # 8 more iterations of a loop a call: more blocks, the same calls and estimate
            assert changed == {"blocks", "blocks_per_call"}, (name, k, after["kernels"][name])
            assert after["kernels"][name]["blocks"] >= k["blocks"] + 8 * k["calls"]
        else:
            assert not changed, (name, k, after["kernels"][name])
    # the estimators do not read the code: the device profile's cycles are as they were
    assert (tree / "artifacts" / NAME / f"{NAME}.profile.json").read_bytes() == profile
    page = (tree / "artifacts" / NAME / f"{NAME}.profile.html").read_text(encoding="utf-8")
    assert f"<td class=num>{after['kernels'][gelu[0]]['blocks']:,}</td>" in page


def test_the_counts_are_the_same_on_every_run(built, monkeypatch):
    """With the vertices called from the C loop on two lanes (threads) and on one, and through
    ctypes one at a time."""
    from ipubuild.build.build import all_steps
    from ipubuild.builtin import vertex_runner
    from ipubuild.targets import load_target
    tree, _ = built
    monkeypatch.chdir(tree)
    ws = Workspace.at(tree)
    step = next(s for s in all_steps(load_target(f"targets/{NAME}.toml", root=tree), tree)
                if s.task == "measure_kernels")
    inputs = {s: ws.read_ref(a) for s, a in step.inputs.items()}
    assert vertex_runner.library() is not None, "the vertex loop does not compile here"
    again = set()
    for switch, lanes in (("1", "2"), ("1", "1"), ("0", "1")):
        monkeypatch.setenv("IPUBUILD_NATIVE_SIM_VERTICES", switch)
        monkeypatch.setenv("IPUBUILD_SIMULATOR_THREADS", lanes)
        again.add(ws.engine.run(step.phase, inputs, step.config, force=True).outputs["kernel_profile"])
    assert again == {ws.read_ref(f"{NAME}/kernel_profile")}


def test_a_compiler_without_block_counting_leaves_the_figures_out_with_a_note(built, tmp_path):
    tree = _copy(built, tmp_path)
    cc = tmp_path / "cc"
    cc.write_text('#!/bin/sh\ncase "$*" in *-fsanitize-coverage*)\n'
                  "  echo \"cc: error: unrecognized command-line option '-fsanitize-coverage=trace-pc'\" >&2; exit 1;;\n"
                  'esac\nexec gcc "$@"\n')
    cc.chmod(0o755)
    run = doit(tree, f"build:{NAME}", environ=env(tree, IPUBUILD_CC=str(cc)))
    assert_passed(run, NAME)
    k = _kernels(tree)
    assert k["kernels"] and all(v["blocks"] is None and v["blocks_per_call"] is None and v["calls"] > 0
                                for v in k["kernels"].values()), k
    assert len(k["notes"]) == 1 and "unrecognized command-line option '-fsanitize-coverage=trace-pc'" in k["notes"][0]
    assert all(name in k["notes"][0] for name in k["kernels"])
    page = (tree / "artifacts" / NAME / f"{NAME}.profile.html").read_text(encoding="utf-8")
    assert "Note: no basic-block counts for" in page
    profile = doit(tree, f"profile:{NAME}", environ=env(tree))
    assert profile.returncode == 0 and "note: no basic-block counts for" in profile.stdout, profile.tail()


def test_a_target_that_does_not_count_its_kernels_compiles_and_runs_them_once(built, tmp_path):
    """``[profile] kernel_counts = "off"`` (what ``auto`` means above 256 tiles): no counted
    compile, no second run of the program, a note that says how to switch it on."""
    tree = _copy(built, tmp_path)
    target = tree / "targets" / f"{NAME}.toml"
    target.write_text(target.read_text() + '\n[profile]\nkernel_counts = "off"\n')
    run = doit(tree, f"build:{NAME}", environ=env(tree))
    assert_passed(run, NAME)
    assert json.loads(Workspace.at(tree).engine.fetch(Workspace.at(tree).read_ref(f"{NAME}/kernel_counted_objects"))) \
        == {"notes": {}, "objects": {}}
    k = _kernels(tree)
    assert k["kernels"] == {} and len(k["notes"]) == 1, k
    assert "kernel_counts = 'off'" in k["notes"][0] and 'set it to "on"' in k["notes"][0]
    page = (tree / "artifacts" / NAME / f"{NAME}.profile.html").read_text(encoding="utf-8")
    assert "kernel_counts = &#x27;off&#x27;" in page, "the page says how to switch the counts on"


# --- the estimators beside the kernels --------------------------------------------------------

def test_each_builtin_kernel_has_its_estimators_beside_it_in_the_planning_fingerprint():
    """Every built-in variant's estimator comes from the ``<kernel>_cycles.py`` beside its C source;
    those files are in the code fingerprint of the operators plugin (which the planning phases
    include), the C sources and the compile machinery (``ipubuild.kernels`` itself) are not."""
    from ipubuild.engine.fingerprint import closure, files_of
    from ipubuild.operators import registry
    builtin = {name: kv for name, kv in registry().kernels.items()
               if Path(kv.source).parent == Path(__file__).resolve().parent.parent / "ipubuild" / "kernels"}
    assert len(builtin) > 20
    for name, kv in builtin.items():
        here = Path(kv.source).with_name(Path(kv.source).stem + "_cycles.py")
        assert here.is_file(), name
        assert kv.cycles.__module__ == f"ipubuild.kernels.{here.stem}", (name, kv.cycles.__module__)
    modules = closure("ipubuild.builtin.operators")
    files = {Path(f).name for f in files_of("ipubuild.builtin.operators")}
    assert {f"{Path(kv.source).stem}_cycles.py" for kv in builtin.values()} | {"cycles.py"} <= files
    assert "ipubuild.compiler.kernels" not in modules and "ipubuild.build.kernel_profile" not in modules
    assert not any(f.endswith((".c", ".h")) for f in files)
