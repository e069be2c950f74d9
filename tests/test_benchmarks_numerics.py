"""Fast tests of benchmarks/numerics.py's records and summary, on canned verdicts (no builds)."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

_PATH = Path(__file__).resolve().parent.parent / "benchmarks" / "numerics.py"
_spec = importlib.util.spec_from_file_location("ipubuild_bench_numerics", _PATH)
numerics = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = numerics
_spec.loader.exec_module(numerics)

GATES = {"min_cosine": 0.999, "max_abs_error": 0.15}


def verdict(cos, err, *, first=None, failed=()):
    ops = {"mode": "operations", "diverged": [first["op"]] if first else [], "first": first,
           "each": [{"op": "patchify", "differ": 0, "failed": 0}, {"op": "head", "differ": 3, "failed": 0,
                                                                   "ratio": "0.25"}]}
    return {"pass": not first and not failed, "device_ok": True, "min_cosine": f"{cos:.9f}",
            "max_abs_error": f"{err:.6f}", "failed_gates": list(failed), "thresholds": GATES, "operations": ops}


def run(label, v, wall=2.0, device=200, check=100):
    r = numerics.record(label, v, 0 if v["pass"] else 1, wall)
    r["phase_ms"] = {"run_device": device, "check_numerics": check, "map_values": 20, "evaluate_reference": None}
    return r


def test_set_key_replaces_or_adds():
    text = "[target]\nseed = 0\n\n[numerics]\nmin_cosine = 0.99\n"
    assert numerics.set_key(text, "target", "seed", 3) == "[target]\nseed = 3\n\n[numerics]\nmin_cosine = 0.99\n"
    assert numerics.set_key(text, "numerics", "compare", "outputs").endswith('min_cosine = 0.99\ncompare = "outputs"\n')
    assert numerics.set_key("[target]\nseed = 0\n", "numerics", "compare", "operations") == \
        '[target]\nseed = 0\n\n[numerics]\ncompare = "operations"\n'


def test_summary_worst_clean_figures_margins_cost_and_bugs():
    clean = {"t": [run("t 0", verdict(1.0, 1e-6)), run("t 1", verdict(0.99986, 0.05))]}
    outputs = {"t": [run("t 0 off", verdict(1.0, 1e-6), device=150, check=3),
                     run("t 1 off", verdict(0.99986, 0.05), device=170, check=3)]}
    first = {"op": "block0.gelu", "type": "gelu", "failed": 9, "elements": 10,
             "worst": {"kernel": "gelu_f32_fp8", "tile": 4}}
    bugs = {"gelu": [run("g 0", verdict(0.998, 0.22, first=first, failed=["min_cosine", "max_abs_error"]), wall=1.0),
                     run("g 1", verdict(0.9995, 0.1, first=first), wall=3.0)]}
    s = numerics.summarize(clean, bugs, clean, outputs)
    t = s["targets"]["t"]
    assert (t["all_pass"], t["worst_min_cosine"], t["worst_max_abs_error"], t["gates"]) == (True, 0.99986, 0.05, GATES)
    assert abs(t["cosine_margin"] - 0.001 / 0.00014) < 1e-6 and abs(t["error_margin"] - 3.0) < 1e-9
    assert t["worst_tolerance_ratio"] == 0.25
    c = s["compare_cost"]["t"]
    # medians of the seeds' pairs: on 300 ms both, off 153 and 173
    assert (c["on_ms"], c["off_ms"], c["extra_ms"], c["map_values_ms"]) == (300, 173, 147, 20), c
    assert s["kernel_loop_wall_s"] == 3.0 and abs(c["extra_of_kernel_loop"] - 0.147 / 3.0) < 1e-12
    g = s["mutations"]["gelu"]
    assert g["all_fail"] and g["named"] == ["block0.gelu"] and g["kernels"] == ["gelu_f32_fp8"]
    assert (g["best_min_cosine"], g["smallest_max_abs_error"]) == (0.9995, 0.1)
    # one seed passed the gates: the gates alone do not catch this bug
    assert not g["gates_alone_fail"] and g["gates_failed"] == ["max_abs_error", "min_cosine"]
    table = numerics.table({"summary": s, "seeds": 2, "mutation_target": "t", "skipped_targets": []})
    assert "0.999/0.15" in table and "block0.gelu" in table and "PASS" in table


def test_a_bug_that_passes_is_not_counted_as_failing():
    ok = run("b", verdict(1.0, 0.0))
    s = numerics.summarize({}, {"b": [ok]})
    assert s["mutations"]["b"]["all_fail"] is False and s["mutations"]["b"]["named"] == []


def test_a_previous_run_is_summarized_again_from_its_raw_records(tmp_path):
    clean = [run("t 0", verdict(1.0, 1e-6), wall=10.0)]
    clean[0]["compare"] = "outputs"             # "auto" compared outputs: a separate build did operations
    on = run("t 0 operations", verdict(1.0, 1e-6), device=300, check=900)
    off = run("t 0 outputs", verdict(1.0, 1e-6), device=280, check=20)
    path = tmp_path / "old.json"
    path.write_text(numerics.json.dumps({"clean": {"t": clean}, "per_operation": {"t": [on]},
                                         "outputs_only": {"t": [off]}, "mutations": {}, "summary": {}}))
    c = numerics.resummarize(path)["summary"]["compare_cost"]["t"]
    assert (c["on_ms"], c["off_ms"], c["extra_ms"]) == (1200, 300, 900) and abs(c["extra_of_build"] - 0.09) < 1e-12
