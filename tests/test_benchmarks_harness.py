"""Fast tests of benchmarks/run.py's log parsing and statistics, on canned log text (no builds)."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parent.parent / "benchmarks" / "run.py"
_spec = importlib.util.spec_from_file_location("ipubuild_bench_run", _PATH)
bench = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = bench
_spec.loader.exec_module(bench)

B = 'ipubuild.build{target="vit_fp8" tile_count=64}'
T = "2026-11-30T15:32:19.299081Z  INFO "

LOG = f"""\
.  machine:ipu21
{T}ipubuild.phase{{phase="read_machine"}}: package build phase finished phase="read_machine" elapsed_ms=0 success=true
.  compile_kernels:matmul_f143_f143
{T}{B}:ipubuild.phase{{phase="compile_kernels"}}: compiled kernel variant variant=matmul_f143_f143 elapsed_ms=57
{T}ipubuild.phase{{phase="compile_kernels"}}: package build phase finished phase="compile_kernels" elapsed_ms=59 success=true
.  compile_kernels:matmul_f32_f32
{T}ipubuild.phase{{phase="compile_kernels"}}: package build phase finished phase="compile_kernels" elapsed_ms=41 success=true cached=true
-- compile_kernels:copy
.  evaluate_reference:vit_fp8
{T}{B}:ipubuild.phase{{phase="evaluate_reference"}}: evaluated host reference elapsed_ms=27
{T}{B}:ipubuild.phase{{phase="evaluate_reference"}}: package build phase finished phase="evaluate_reference" elapsed_ms=33 success=true
referencePrecision=device
.  plan_package:vit_fp8
{T}{B}:ipubuild.phase{{phase="plan_package"}}:ipubuild.phase{{phase="run_device"}}: package build phase finished phase="run_device" elapsed_ms=999 success=true
{T}{B}:ipubuild.phase{{phase="plan_package"}}: validated search incumbent cycles=115837 resuming=false
{T}{B}:ipubuild.phase{{phase="plan_package"}}: evaluated local candidate attempt=1 proposal=3 cycles=110000 elapsed_ms=140
{T}{B}:ipubuild.phase{{phase="plan_package"}}: evaluated local candidate attempt=2 proposal=9 cycles=invalid elapsed_ms=90
{T}{B}:ipubuild.phase{{phase="plan_package"}}:ipubuild.phase{{phase="place_storage"}}: package build phase finished phase="place_storage" elapsed_ms=12 success=true cached=true
{T}{B}:ipubuild.phase{{phase="plan_package"}}: screened local search round round=1 proposed=544 invalid=8 visited=0 not_cheaper=517 deduplicated=7 truncated=9 shortlisted=3
{T}{B}:ipubuild.phase{{phase="plan_package"}}: measured local search round round=1 proposals_per_s=368 evaluations_per_s=4.05 cache_hit_rate=0.65
{T}{B}:ipubuild.phase{{phase="plan_package"}}: accepted local layout improvement attempt=3 before=115837 after=107941 delta=Changes {{ plans: {{OperationId(18)}} }}
{T}{B}:ipubuild.phase{{phase="plan_package"}}: screened local search round round=2 proposed=544 invalid=8 visited=1 not_cheaper=520 deduplicated=7 truncated=5 shortlisted=3
{T}{B}:ipubuild.phase{{phase="plan_package"}}: measured local search round round=2 proposals_per_s=12040 evaluations_per_s=3.77 cache_hit_rate=0.55
{T}{B}:ipubuild.phase{{phase="plan_package"}}: accepted local layout improvement attempt=7 before=107941 after=97871 delta=Changes {{ plans: {{OperationId(7)}} }}
{T}{B}:ipubuild.phase{{phase="plan_package"}}: screened local search round round=3 proposed=544 invalid=8 visited=3 not_cheaper=522 deduplicated=7 truncated=1 shortlisted=3
{T}{B}:ipubuild.phase{{phase="plan_package"}}: measured local search round round=3 proposals_per_s=12104 evaluations_per_s=4.17 cache_hit_rate=0.37
{T}{B}:ipubuild.phase{{phase="plan_package"}}: retained incumbent layout: no candidate improved round=3
{T}{B}:ipubuild.phase{{phase="plan_package"}}: package build phase finished phase="plan_package" elapsed_ms=5477 success=true
.  build_tile_images:vit_fp8/tile31
-- build_tile_images:vit_fp8/tile7
.  run_device:vit_fp8
{T}{B}:ipubuild.phase{{phase="run_device"}}: invoking host exchange call call="run" phases=27
{T}{B}:ipubuild.phase{{phase="run_device"}}: package build phase finished phase="run_device" elapsed_ms=590 success=true
.  build:vit_fp8
final_cycles=97871 final_exchange=44151 lower_bound=50897
profile=artifacts/vit_fp8/vit_fp8.profile.json tiles=1472 samples=1508
referenceMinimumCosineSimilarity=0.999834709
referenceMaximumAbsoluteError=0.058591 numericalTest=PASS
package=artifacts/vit_fp8/vit_fp8.ipuexe tiles=1472 device=ipumodel deviceTest=PASS
"""


def test_executed_and_up_to_date_tasks():
    tasks = bench.parse_tasks(LOG)
    assert tasks["executed"] == ["machine:ipu21", "compile_kernels:matmul_f143_f143", "compile_kernels:matmul_f32_f32",
                                 "evaluate_reference:vit_fp8", "plan_package:vit_fp8",
                                 "build_tile_images:vit_fp8/tile31", "run_device:vit_fp8", "build:vit_fp8"]
    assert tasks["up_to_date"] == ["compile_kernels:copy", "build_tile_images:vit_fp8/tile7"]


def test_phase_finished_lines():
    phases = bench.parse_phases(LOG)
    assert phases[0] == {"phase": "read_machine", "elapsed_ms": 0, "success": True, "cached": False,
                         "task": "machine:ipu21", "own": True}
    assert phases[2]["cached"] and phases[2]["elapsed_ms"] == 41 and phases[2]["task"] == "compile_kernels:matmul_f32_f32"
    assert bench.phase_ms(phases, "compile_kernels") == [59, 41]
    assert bench.phase_ms(phases, "evaluate_reference") == [33]
    # the phases the search runs inside plan_package (here a run_device line) are not the build's own
    assert bench.phase_ms(phases, "run_device") == [590]
    assert bench.phase_ms(phases, "plan_package") == [5477]
    inner = [p for p in phases if not p["own"]]
    assert [(p["phase"], p["task"]) for p in inner] == [("run_device", "plan_package:vit_fp8"),
                                                         ("place_storage", "plan_package:vit_fp8")]
    assert inner[1]["cached"]


def test_later_steps_nest_under_plan_package_span_but_are_their_own():
    # steps after plan_package carry its span in their log context; they are still the task's phase
    log = (".  size_tile_code:vit_fp8\n"
           f'{T}{B}:ipubuild.phase{{phase="plan_package"}}:ipubuild.phase{{phase="size_tile_code"}}: '
           'package build phase finished phase="size_tile_code" elapsed_ms=4 success=true cached=true\n')
    [p] = bench.parse_phases(log)
    assert p["own"] and p["cached"] and p["task"] == "size_tile_code:vit_fp8"
    assert bench.phase_ms([p], "size_tile_code") == [4]


def test_phase_line_without_task_lines():
    line = 'package build phase finished phase="x" elapsed_ms=7 success=false cached=true'
    assert bench.parse_phases(line) == [{"phase": "x", "elapsed_ms": 7, "success": False, "cached": True,
                                         "task": None, "own": True}]


def test_search_rounds_and_cycles():
    s = bench.parse_search(LOG)
    assert s["rounds"] == 3
    assert [r["proposals_per_s"] for r in s["measured"]] == [368, 12040, 12104]
    assert [r["evaluations_per_s"] for r in s["measured"]] == [4.05, 3.77, 4.17]
    assert [r["cache_hit_rate"] for r in s["measured"]] == [0.65, 0.55, 0.37]
    assert s["screened"][0] == {"round": 1, "proposed": 544, "invalid": 8, "visited": 0, "not_cheaper": 517,
                                "deduplicated": 7, "truncated": 9, "shortlisted": 3}
    assert s["initial_cycles"] == 115837 and s["resuming"] is False
    assert [a["after"] for a in s["accepted"]] == [107941, 97871]
    assert s["final_cycles"] == 97871
    assert s["gain_pct"] == pytest.approx(100 * (115837 - 97871) / 115837, abs=1e-3)


def test_search_without_rounds_or_improvement():
    s = bench.parse_search('... validated search incumbent cycles=500 resuming=true\n')
    assert s == {"screened": [], "measured": [], "rounds": 0, "initial_cycles": 500, "resuming": True,
                 "accepted": [], "final_cycles": 500, "gain_pct": 0.0}
    assert bench.parse_search("")["initial_cycles"] is None
    assert bench.parse_search("")["gain_pct"] is None


def test_build_result_lines():
    r = bench.parse_result(LOG)
    assert r == {"final_cycles": 97871, "min_cosine": 0.999834709, "max_abs_error": 0.058591,
                 "numerical_test": "PASS", "device_test": "PASS"}
    failed = bench.parse_result("referenceMaximumAbsoluteError=0.9 numericalTest=FAIL\n")
    assert failed["numerical_test"] == "FAIL"
    assert bench.parse_result("error: something broke\n")["numerical_test"] is None


def test_median_and_ratios():
    assert bench.median([3.0, 1.0, 2.0]) == 2.0
    assert bench.median([4, 1, None, 2, 3]) == 2.5
    assert bench.median([]) is None and bench.median([None]) is None
    assert bench.ratio(1, 4) == 0.25
    assert bench.ratio(1, 0) is None and bench.ratio(None, 2) is None
    # per-repeat ratios, then their median; and the ratio of the medians
    r = bench.ratio_entry([0.5, 0.6, 0.4], [10.0, 8.0, 10.0], "noop/clean")
    assert r["samples"] == pytest.approx([0.05, 0.075, 0.04])
    assert r["median"] == pytest.approx(0.05)
    assert r["of_medians"] == pytest.approx(0.5 / 10.0)
    s = bench.summarize([2.0, None, 1.0, 3.0])
    assert (s["n"], s["median"], s["min"], s["max"]) == (3, 2.0, 1.0, 3.0)


def test_search_summary_medians_over_rounds():
    one = {"search": bench.parse_search(LOG), "plan_package_ms": 5477, "wall_s": 9.0, "candidate_ms": [140, 90]}
    two = {"search": bench.parse_search(LOG.replace("proposals_per_s=368", "proposals_per_s=400")),
           "plan_package_ms": 6000, "wall_s": 10.0, "candidate_ms": [100]}
    s = bench.search_summary([one, two])
    assert s["proposals_per_s"] == pytest.approx(12040)   # median of the 6 rounds of both runs
    assert s["evaluations_per_s"] == pytest.approx(4.05)
    assert s["cache_hit_rate_by_round"] == {"1": 0.65, "2": 0.55, "3": 0.37}
    assert s["proposals_per_s_by_round"] == {"1": 384, "2": 12040, "3": 12104}
    assert s["search_ms"] == pytest.approx(5738.5)
    assert s["candidate_ms"] == 100 and s["candidates"] == 3
    assert s["gain_pct"] == pytest.approx(15.51, abs=0.01)
    assert s["deterministic"]


def test_unexpected_tasks():
    assert bench.unexpected_tasks("noop", [], "vit_fp8") == []
    assert bench.unexpected_tasks("noop", ["build:vit_fp8"], "vit_fp8") == ["build:vit_fp8"]
    assert bench.unexpected_tasks("noop", ["link_kernels:vit_fp8", "build:vit_fp8"], "vit_fp8") == \
        ["link_kernels:vit_fp8", "build:vit_fp8"]
    kernel = ["compile_kernels:vit_fp8", "link_kernels:vit_fp8", "build_tile_images:vit_fp8",
              "write_package:vit_fp8", "run_device:vit_fp8", "measure_kernels:vit_fp8", "plan_package:vit_fp8",
              "build:vit_fp8"]
    assert bench.unexpected_tasks("kernel_edit", kernel, "vit_fp8") == ["plan_package:vit_fp8"]
    assert bench.unexpected_tasks("comment_edit", ["compile_kernels:vit_fp8", "link_kernels:vit_fp8"],
                                  "vit_fp8") == ["link_kernels:vit_fp8"]


def test_compiled_variants_and_candidates_are_read_from_the_log():
    assert [(m["variant"], int(m["ms"])) for m in bench._COMPILED.finditer(LOG)] == [("matmul_f143_f143", 57)]
    assert [int(m["ms"]) for m in bench._CANDIDATE.finditer(LOG)] == [140, 90]


def test_set_search_workers(tmp_path):
    p = tmp_path / "t.toml"
    p.write_text("[target]\ntile_count = 64\n\n[search]\nrounds = 3\nworkers = 2\nseed = 0\n")
    bench.set_search_workers(p, 1)
    assert p.read_text() == "[target]\ntile_count = 64\n\n[search]\nrounds = 3\nworkers = 1\nseed = 0\n"
    p.write_text("[search]\nrounds = 3\n\n[model]\nblocks = 1\n")
    bench.set_search_workers(p, 2)
    assert "[search]\nrounds = 3\n\nworkers = 2\n[model]" in p.read_text()
    p.write_text("[target]\ntile_count = 4\n")
    bench.set_search_workers(p, 2)
    assert p.read_text().endswith("[search]\nworkers = 2\n")


def test_bounds_from_the_closing_line():
    b = bench.parse_bounds("final_cycles=53761 final_exchange=13096 lower_bound=42446 peak_bound=17650\n")
    assert b["final_cycles"] == 53761 and b["lower_bound"] == 42446 and b["peak_bound"] == 17650
    assert b["over_lower_bound"] == pytest.approx(53761 / 42446) and b["over_peak_bound"] == pytest.approx(53761 / 17650)
    old = bench.parse_bounds(LOG)            # a log from before the peak bound was printed
    assert (old["final_cycles"], old["lower_bound"], old["peak_bound"]) == (97871, 50897, None)
    assert old["over_peak_bound"] is None
