"""`doit kernel:<variant>`: one kernel variant compiled as a build compiles it, run on the shapes a
target gives it against its operator's reference — and a wrong kernel fails it."""
from __future__ import annotations

import os
import re
import signal

import pytest
from buildtree import SMALL, copy_ipubuild, doit, env, make_tree

from ipubuild.build.suggest import did_you_mean, unknown_task_message


def test_did_you_mean_prefers_the_same_group():
    known = ["build:vit_fp8", "build:vit_b16_fp8", "profile:vit_fp8", "kernel:gelu_f32_fp8"]
    assert did_you_mean("build:vit_f8", known)[0] == "build:vit_fp8"
    assert did_you_mean("biuld:vit_fp8", known)[0] == "build:vit_fp8"
    assert did_you_mean("zzz", known) == []
    assert unknown_task_message("zzz", known) == 'no task or target "zzz" (`doit list --all` shows them)'


@pytest.fixture(scope="module")
def tree(tmp_path_factory):
    t = make_tree(tmp_path_factory.mktemp("kernel"), {"small": SMALL})
    copy_ipubuild(t)
    return t


def _run(tree, *args, **extra):
    e = env(tree, IPUBUILD_CACHE_DIR=str(tree / "cache"), **extra)
    for k in ("IPUBUILD_CONSOLE", "IPUBUILD_LOG"):
        e.pop(k)
    return doit(tree, *args, environ=e)


def test_a_kernel_variant_runs_against_its_reference_timed_and_counted(tree):
    run = _run(tree, "kernel:gelu_f32_fp8", "--target", "small", "--repeat", "3", "--seed", "1")
    assert run.returncode == 0, run.tail()
    out = run.stdout
    assert re.search(r"^kernel gelu_f32_fp8 \(gelu\.c -DFP8_OUT=1, checked build\): operation \S+ \(gelu\) "
                     r"of target small, plan \{.*\}, tile \d+$", out, re.M), out
    assert re.search(r"^  \S+\[0:\d+, 0:\d+\] f143: \d+ elements, \d+ differ from the reference, 0 outside "
                     r"\(within its tolerance\): PASS$", out, re.M), out
    assert re.search(r"^  host time: median [\d.]+ us of 3 calls", out, re.M), out
    assert re.search(r"^  basic blocks: [\d,]+ per call$", out, re.M), out
    assert out.rstrip().endswith("kernelTest=PASS"), out


def test_a_wrong_kernel_fails_with_the_element_that_is_off(tree):
    gelu = tree / "ipubuild" / "kernels" / "ipu_kernel.h"          # ipu_gelu, which gelu.c calls
    text = gelu.read_text()
    try:
        gelu.write_text(text.replace("return 0.5f * v *", "return 0.45f * v *", 1))
        run = _run(tree, "kernel:gelu_f32_fp8", "--target", "small", "--repeat", "1")
    finally:
        gelu.write_text(text)
    assert run.returncode == 1, run.tail()
    assert "kernelTest=FAIL" in run.stdout, run.tail()
    (line,) = [ln for ln in run.stdout.splitlines() if ln.startswith("error:")]
    assert re.match(r"error: kernel gelu_f32_fp8: \S+\[0:\d+, 0:\d+\] f143: .* [1-9]\d* outside .*: FAIL "
                    r"\(worst: \[\d+, \d+\] expected \S+ got \S+\)$", line), line


def test_unknown_variants_targets_and_unused_variants_are_one_line_errors(tree):
    typo = _run(tree, "kernel:gelu_f32_fp9")
    assert typo.returncode != 0 and "did you mean kernel:gelu_f32_fp8" in typo.output, typo.tail()
    bad = _run(tree, "kernel:gelu_f32_fp8", "--target", "smal")
    assert bad.returncode == 1 and "error: --target smal: no such target; did you mean small?" in bad.stdout, bad.tail()
    unused = _run(tree, "kernel:gelu_f32", "--target", "small")      # small folds its gelu's cast
    assert unused.returncode == 1 and "no operation of target small calls it" in unused.stdout, unused.tail()
    assert "Traceback" not in typo.output + bad.output + unused.output


def test_an_onnx_target_gives_shapes_and_one_that_cannot_build_is_passed_over(tmp_path):
    """The ONNX family reads its model file: the kernel CLI hands it over as a build does; a
    target that cannot build here (a missing model file) is passed over when no target is named."""
    import shutil
    pytest.importorskip("onnx")
    from buildtree import ROOT
    t = make_tree(tmp_path / "tree", {"small": SMALL})
    shutil.copy(ROOT / "targets" / "vit_onnx.toml", t / "targets")
    shutil.copytree(ROOT / "targets" / "models", t / "targets" / "models")
    broken = (ROOT / "targets" / "vit_onnx.toml").read_text().replace("vit_onnx.onnx", "missing.onnx")
    (t / "targets" / "a_broken.toml").write_text(broken)
    run = _run(t, "kernel:softmax_f32_fp8", "--target", "vit_onnx", "--repeat", "1")
    assert run.returncode == 0 and "of target vit_onnx" in run.stdout, run.tail()
    assert run.stdout.rstrip().endswith("kernelTest=PASS"), run.tail()
    default = _run(t, "kernel:softmax_f32_fp8", "--repeat", "1")
    assert default.returncode == 0 and "kernelTest=PASS" in default.stdout, default.tail()


def test_watch_builds_again_when_a_kernel_source_is_saved(tree, tmp_path):
    import subprocess
    import sys
    import time
    e = env(tree, IPUBUILD_CACHE_DIR=str(tree / "cache"), IPUBUILD_WATCH_INTERVAL="0.1")
    for k in ("IPUBUILD_CONSOLE", "IPUBUILD_LOG"):
        e.pop(k)
    log = tmp_path / "watch.log"
    gelu = tree / "ipubuild" / "kernels" / "gelu.c"
    text = gelu.read_text()
    with open(log, "w") as f:
        p = subprocess.Popen([sys.executable, "-m", "ipubuild.build.watch", "build:small"], cwd=tree, env=e,
                             stdout=f, stderr=subprocess.STDOUT, start_new_session=True)

    def wait_for(pattern, count=1, timeout=300):
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            if len(re.findall(pattern, log.read_text(), re.M)) >= count:
                return
            assert p.poll() is None, log.read_text()
            time.sleep(0.2)
        raise AssertionError(f"no {pattern!r} in:\n{log.read_text()}")
    try:
        wait_for(r"^watching \d+ files for doit build:small")
        gelu.write_text(text + "/* saved */\n")
        wait_for(r"^changed: ipubuild/kernels/gelu\.c; building again$")
        wait_for(r"^watching \d+ files", count=2)
        out = log.read_text()
        assert out.count("deviceTest=PASS") == 2, out
        # early cutoff: the compiles only (the variants, their counted builds)
        assert re.search(r"^small built: \d+ tasks: 2 ran", out, re.M), out
    finally:
        # stopped before the source is restored: the restore is a save it would build again
        os.killpg(p.pid, signal.SIGINT)
        try:
            p.wait(timeout=30)
        finally:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
            gelu.write_text(text)
    assert "watch stopped" in log.read_text(), log.read_text()[-2000:]


def test_a_plugin_kernel_that_is_not_a_checked_build_is_said_in_the_closing_line(tmp_path):
    from buildtree import ROOT
    tree = make_tree(tmp_path / "tree", {})
    e = env(None, IPUBUILD_PLUGINS="ipubuild_throwaway", IPUBUILD_CACHE_DIR=str(tmp_path / "cache"),
            PYTHONPATH=os.pathsep.join([str(ROOT / "tests" / "throwaway")] +
                                       ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else [])))
    for k in ("IPUBUILD_CONSOLE", "IPUBUILD_LOG"):
        e.pop(k)
    run = doit(tree, "build:throwaway_small", environ=e)
    assert run.returncode == 0, run.tail()
    closing = run.stdout.strip().splitlines()[-1]
    assert closing.endswith("deviceTest=PASS (1 kernel variant unchecked: throwaway_square_f32)"), closing
    assert "kernel variants are not checked builds" in run.output and "throwaway_square_f32" in run.output


def test_the_closing_word_and_return_codes_say_what_they_mean():
    from ipubuild.builtin.simulator import return_reason
    from ipubuild.device.verdict import device_word
    assert device_word({"device_ok": True}) == "PASS"
    assert device_word({"device_ok": True, "unchecked": ["a", "b"]}) == "PASS (2 kernel variants unchecked: a, b)"
    # an unchecked kernel's code is its own: only the number is said; a checked one says why
    assert return_reason(2, None) == "returned 2 (not a checked build: the code is the kernel's own)"
    assert return_reason(3, lambda: b"y[n] lies outside the tile's data memory") == \
        "y[n] lies outside the tile's data memory"
    assert return_reason(2, lambda: None) == "no scratch memory"
