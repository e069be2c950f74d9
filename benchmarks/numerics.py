#!/usr/bin/env python3
"""The numerical test's figures: clean builds over data seeds, what the per-operation comparison
costs, and deliberate kernel bugs.

    python benchmarks/numerics.py [--seeds N] [--first-seed S] [--targets vit_fp8,vit_rms] [--mutation-target vit_fp8]
                                  [--extra FILE ...] [--no-cost] [--no-mutations] [--out benchmarks/results/numerics.json]

Copies the tree (as ``benchmarks/run.py`` does) and, in that copy, for every data seed
``S … S+N-1`` (``[target] seed``): builds each target of ``--targets`` (``targets/<name>.toml``;
one whose model family no installed plugin provides is skipped and named) and each ``--extra``
target file; then the same build comparing operation by operation (unless the first did) and
comparing the graph's outputs only, which re-run ``run_device`` and ``check_numerics`` alone
(``--no-cost`` skips them); then, on ``--mutation-target``, each deliberate kernel bug of
``tests/mutations.py`` through the kernel loop (edit the C source, ``doit build``, restore it).
From every build's verdict (``artifacts/<t>/<t>.verdict.json``) it records the gates' figures —
the graph outputs' minimum cosine similarity and maximum absolute error against the
device-precision reference — whether each gate passed, the per-operation comparison (the first
operation that diverged, its kernel; for clean builds each operation's largest error over its
tolerance), the device's verdict and the phases' times.

The summary gives, per target, the worst clean figures over the seeds and their margin to the
target's gates; the comparison's cost (``run_device`` + ``check_numerics``, operation by
operation against outputs only: medians over the seeds, same run), also as a share of a kernel
edit's rebuild; and per bug the figures closest to passing and whether every seed failed it —
with the per-operation comparison and by the gates alone. Writes JSON (``--out``) and prints a
table.
"""
from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SCHEMA = 1


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


bench = _load("ipubuild_bench_run", REPO / "benchmarks" / "run.py")
mutations = _load("ipubuild_mutations", REPO / "tests" / "mutations.py")


def progress(message: str) -> None:
    print(f"[numerics] {message}", file=sys.stderr, flush=True)


def set_key(text: str, section: str, key: str, value) -> str:
    """``text`` (a target file) with ``key = value`` in ``[section]`` (replacing or adding it)."""
    lines, out, current, done = text.splitlines(keepends=True), [], None, False
    for line in lines:
        s = line.strip()
        if s.startswith("[") and s.endswith("]"):
            if current == section and not done:
                out.append(f"{key} = {json.dumps(value)}\n")
                done = True
            current = s.strip("[]").strip()
        elif current == section and re.match(rf"{re.escape(key)}\s*=", s):
            line, done = f"{key} = {json.dumps(value)}\n", True
        out.append(line)
    if not done:
        if current != section:
            out.append(f"\n[{section}]\n")
        out.append(f"{key} = {json.dumps(value)}\n")
    return "".join(out)


class Builds:
    """Builds in the scratch tree; a failing build is a result here, not an error."""

    def __init__(self, tree: Path, logs: Path):
        self.tree, self.logs, self.count = tree, logs, 0
        self.env = bench.Bench(tree, logs, logs).env
        script = Path(sys.executable).with_name("doit")
        self.doit = [str(script)] if script.exists() else [sys.executable, "-m", "doit"]

    def build(self, target: str, label: str) -> dict:
        self.count += 1
        log_path = self.logs / f"{self.count:03d}-{re.sub(r'[^A-Za-z0-9_.-]+', '_', label)}.log"
        wall, rc, _ = bench._timed([*self.doit, f"build:{target}"], self.tree, self.env, log_path)
        log = log_path.read_text(errors="replace")
        verdict_file = self.tree / "artifacts" / target / f"{target}.verdict.json"
        ran = re.search(r"^\.  check_numerics:", log, re.M) is not None
        if not ran or not verdict_file.exists():
            raise SystemExit(f"numerics benchmark: {label}: the build did not reach the numerical test "
                             f"(exit {rc}); its log: {log_path}\n" + "\n".join(log.splitlines()[-10:]))
        verdict = json.loads(verdict_file.read_text())
        progress(f"  {label}: {wall:.1f} s, numericalTest={'PASS' if verdict['pass'] else 'FAIL'} "
                 f"deviceTest={'PASS' if verdict['device_ok'] else 'FAIL'}")
        out = record(label, verdict, rc, wall)
        phases = bench.parse_phases(log)
        out["phase_ms"] = {name: bench._one(bench.phase_ms(phases, name))
                           for name in ("map_values", "run_device", "check_numerics", "evaluate_reference")}
        return out


def _float(text):
    try:
        return float(text)
    except (TypeError, ValueError):
        return None


def record(label: str, verdict: dict, rc: int, wall: float) -> dict:
    """What a build's verdict says, for the distributions."""
    ops = verdict.get("operations", {})
    first = ops.get("first") or {}
    worst = first.get("worst", {})
    return {
        "label": label, "exit": rc, "wall_s": round(wall, 2), "pass": verdict["pass"],
        "device_ok": verdict["device_ok"], "min_cosine": _float(verdict["min_cosine"]),
        "max_abs_error": _float(verdict["max_abs_error"]), "failed_gates": verdict.get("failed_gates", []),
        "thresholds": verdict["thresholds"], "compare": ops.get("mode"),
        "diverged": ops.get("diverged", []),
        "first": ({"op": first.get("op"), "type": first.get("type"), "kernel": worst.get("kernel"),
                   "tile": worst.get("tile"), "failed": first.get("failed"), "elements": first.get("elements")}
                  if first else None),
        # each operation's largest difference over its tolerance (float outputs that differ)
        "ratios": {e["op"]: _float(e["ratio"]) for e in ops.get("each", []) if "ratio" in e},
        "differ": {e["op"]: e["differ"] for e in ops.get("each", [])},
    }


def family_available(tree: Path, target: str) -> bool:
    """Whether an installed plugin builds the target's model family."""
    import tomllib

    from ipubuild.frontend import model_families
    from ipubuild.plugins import get_plugin_manager
    family = tomllib.loads((tree / "targets" / f"{target}.toml").read_text())["model"]["family"]
    return family in model_families(get_plugin_manager())


COMPARE_PHASES = ("run_device", "check_numerics")


def compare_cost(on: list, off: list, clean: list) -> dict:
    """What the per-operation comparison costs: ``run_device`` + ``check_numerics`` with it
    (``on``) and without it (``off``), the same seeds in the same run; medians over the seeds,
    also as a share of the seed's ``clean`` build (all it re-ran for that seed)."""
    def ms(r):
        return sum(r["phase_ms"][p] or 0 for p in COMPARE_PHASES)
    pairs = [(ms(a), ms(b), c["wall_s"]) for a, b, c in zip(on, off, clean)]
    if not pairs:
        return {}
    med = lambda xs: sorted(xs)[len(xs) // 2]    # noqa: E731
    return {"seeds": len(pairs), "phases": list(COMPARE_PHASES),
            "on_ms": med([a for a, _, _ in pairs]), "off_ms": med([b for _, b, _ in pairs]),
            "extra_ms": med([a - b for a, b, _ in pairs]),
            "ratio": med([a / b for a, b, _ in pairs if b]),
            "extra_of_build": med([(a - b) / 1000 / w for a, b, w in pairs if w]),
            # once per layout (and nothing to map when comparing outputs only), so often cached
            "map_values_ms": max([r["phase_ms"]["map_values"] for r in on + clean if r["phase_ms"]["map_values"]],
                                 default=None)}


def summarize(clean: dict, bugs: dict, per_operation: dict | None = None, outputs_only: dict | None = None) -> dict:
    out = {"targets": {}, "mutations": {}, "compare_cost": {
        t: compare_cost(per_operation[t], runs, clean[t]) for t, runs in (outputs_only or {}).items()}}
    for target, runs in clean.items():
        cos = [r["min_cosine"] for r in runs]
        err = [r["max_abs_error"] for r in runs]
        # each operation's largest error over its tolerance, in every build that compared them
        ratios = [v for r in runs + (per_operation or {}).get(target, []) for v in r["ratios"].values() if v is not None]
        out["targets"][target] = {
            "seeds": len(runs), "all_pass": all(r["pass"] and r["device_ok"] for r in runs),
            "worst_min_cosine": min(cos), "worst_max_abs_error": max(err),
            "gates": runs[0]["thresholds"],
            "cosine_margin": (1 - runs[0]["thresholds"]["min_cosine"]) / max(1 - min(cos), 1e-12),
            "error_margin": runs[0]["thresholds"]["max_abs_error"] / max(max(err), 1e-12),
            "worst_tolerance_ratio": max(ratios) if ratios else 0.0}
    loop = sorted(r["wall_s"] for runs in bugs.values() for r in runs)
    if loop:
        # a kernel edit's rebuild (compile, images, package, device run, numerical test)
        out["kernel_loop_wall_s"] = loop[len(loop) // 2]
        for c in out["compare_cost"].values():
            if c:
                c["extra_of_kernel_loop"] = c["extra_ms"] / 1000 / out["kernel_loop_wall_s"]
    for name, runs in bugs.items():
        out["mutations"][name] = {
            "seeds": len(runs), "all_fail": all(not r["pass"] for r in runs),
            "named": sorted({r["first"]["op"] for r in runs if r["first"]}),
            "kernels": sorted({r["first"]["kernel"] for r in runs if r["first"]}),
            "best_min_cosine": max(r["min_cosine"] for r in runs),
            "smallest_max_abs_error": min(r["max_abs_error"] for r in runs),
            "gates_alone_fail": all(r["failed_gates"] for r in runs),
            "gates_failed": sorted({g for r in runs for g in r["failed_gates"]})}
    return out


def run(args) -> dict:
    started = time.perf_counter()
    tmp = Path(tempfile.mkdtemp(prefix="ipubuild-numerics-"))
    clean: dict[str, list] = {}
    outputs_only: dict[str, list] = {}
    per_operation: dict[str, list] = {}
    bugs: dict[str, list] = {m.name: [] for m in mutations.MUTATIONS}
    skipped = []
    try:
        tree = bench.make_scratch(REPO, tmp)
        logs = tmp / "logs"
        logs.mkdir()
        for extra in args.extra:
            shutil.copy(REPO / extra, tree / "targets" / Path(extra).name)
        b = Builds(tree, logs)
        targets = args.targets.split(",") + [Path(e).stem for e in args.extra]
        for t in list(targets):
            if not family_available(tree, t):
                skipped.append(t)
                targets.remove(t)
        texts = {t: (tree / "targets" / f"{t}.toml").read_text() for t in targets}
        for seed in range(args.first_seed, args.first_seed + args.seeds):
            for t in targets:
                (tree / "targets" / f"{t}.toml").write_text(set_key(texts[t], "target", "seed", seed))
            for t in targets:
                clean.setdefault(t, []).append(b.build(t, f"{t} seed {seed}"))
                if not args.no_cost:
                    # what the per-operation comparison costs: the same build comparing operation
                    # by operation (the clean build, when "auto" did) and the graph's outputs
                    # only — run_device and check_numerics re-run, nothing else
                    seeded = set_key(texts[t], "target", "seed", seed)
                    target_file = tree / "targets" / f"{t}.toml"
                    if clean[t][-1]["compare"] == "operations":
                        per_operation.setdefault(t, []).append(clean[t][-1])
                    else:
                        target_file.write_text(set_key(seeded, "numerics", "compare", "operations"))
                        per_operation.setdefault(t, []).append(b.build(t, f"{t} seed {seed} operations"))
                    target_file.write_text(set_key(seeded, "numerics", "compare", "outputs"))
                    outputs_only.setdefault(t, []).append(b.build(t, f"{t} seed {seed} outputs only"))
                    target_file.write_text(seeded)
            if args.mutation_target in targets and not args.no_mutations:
                for m in mutations.MUTATIONS:
                    before = m.apply(tree)
                    try:
                        bugs[m.name].append(b.build(args.mutation_target, f"{m.name} seed {seed}"))
                    finally:
                        m.revert(tree, before)
    finally:
        if args.keep_scratch:
            progress(f"kept the scratch tree and logs in {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    return {"schema": SCHEMA, "when": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": " ".join(sys.argv), "machine": bench.machine_info(), "seeds": args.seeds,
            "mutation_target": args.mutation_target, "skipped_targets": skipped,
            "mutation_table": [{"name": m.name, "what": m.what, "file": m.file, "expected": m.op}
                               for m in mutations.MUTATIONS],
            "summary": summarize(clean, {k: v for k, v in bugs.items() if v}, per_operation, outputs_only),
            "clean": clean, "per_operation": {t: [r for r in runs if r not in clean[t]] for t, runs in per_operation.items()},
            "outputs_only": outputs_only, "mutations": {k: v for k, v in bugs.items() if v},
            "total_s": round(time.perf_counter() - started, 1)}


def table(result: dict) -> str:
    s = result["summary"]
    lines = [f"{result['seeds']} data seeds; margin: (1 - gate) / (1 - worst cosine), gate / worst error", "",
             f"{'clean target':<22} {'pass':>5} {'gates':>12} {'worst cosine':>14} {'worst error':>12} {'cos margin':>11} "
             f"{'err margin':>11} {'worst op ratio':>15}"]
    for t, r in s["targets"].items():
        gates = f"{r['gates']['min_cosine']}/{r['gates']['max_abs_error']}"
        lines.append(f"{t:<22} {str(r['all_pass']):>5} {gates:>12} {r['worst_min_cosine']:>14.9f} "
                     f"{r['worst_max_abs_error']:>12.6f} {r['cosine_margin']:>11.1f} {r['error_margin']:>11.1f} "
                     f"{r['worst_tolerance_ratio']:>15.4g}")
    lines += ["", f"{'bug (' + str(result['mutation_target']) + ')':<24} {'fails':>5} {'named':<28} "
              f"{'best cosine':>12} {'min error':>10} {'gates alone':>12}"]
    for name, r in s["mutations"].items():
        lines.append(f"{name:<24} {str(r['all_fail']):>5} {','.join(r['named']):<28} {r['best_min_cosine']:>12.6f} "
                     f"{r['smallest_max_abs_error']:>10.4f} {('fail: ' + '+'.join(r['gates_failed'])) if r['gates_alone_fail'] else 'PASS':>12}")
    if s.get("compare_cost"):
        lines += ["", f"{'compare cost':<22} {'on ms':>8} {'off ms':>8} {'extra ms':>9} {'ratio':>6} {'of build':>9} "
                  f"{'map_values ms':>14}   (run_device + check_numerics, per-operation vs outputs only; medians)"]
        for t, c in s["compare_cost"].items():
            if c:
                lines.append(f"{t:<22} {c['on_ms']:>8.0f} {c['off_ms']:>8.0f} {c['extra_ms']:>9.0f} {c['ratio']:>6.2f} "
                             f"{c['extra_of_build']:>9.1%} {c['map_values_ms'] or 0:>14.0f}")
    if result["skipped_targets"]:
        lines.append(f"\nskipped (model family not installed): {', '.join(result['skipped_targets'])}")
    return "\n".join(lines)


def resummarize(path: Path) -> dict:
    """A previous run's JSON with its summary recomputed from its raw records."""
    result = json.loads(Path(path).read_text())
    clean = result["clean"]
    per_operation = {t: [r if r["compare"] == "operations" else extra.pop(0) for r in clean[t]]
                     for t, extra in ((t, list(result.get("per_operation", {}).get(t, []))) for t in clean)
                     if t in result.get("outputs_only", {})}
    result["summary"] = summarize(clean, result["mutations"], per_operation, result.get("outputs_only", {}))
    return result


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, default=5, help="data seeds (default 5)")
    ap.add_argument("--first-seed", type=int, default=0)
    ap.add_argument("--targets", default="vit_fp8,vit_rms", help="comma-separated names of targets/*.toml "
                    "(default: vit_fp8,vit_rms; vit_b16_fp8 takes minutes and GBs a build)")
    ap.add_argument("--mutation-target", default="vit_fp8")
    ap.add_argument("--no-mutations", action="store_true")
    ap.add_argument("--no-cost", action="store_true", help="skip the builds comparing outputs only (the "
                    "per-operation comparison's cost)")
    ap.add_argument("--extra", action="append", default=[], help="another target file to build (e.g. "
                    "benchmarks/targets/vit_b16_1472.toml)")
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "numerics.json"))
    ap.add_argument("--keep-scratch", action="store_true")
    ap.add_argument("--summarize", metavar="JSON", help="no builds: recompute the summary of a previous run's JSON "
                    "(written to --out)")
    args = ap.parse_args(argv)
    result = resummarize(args.summarize) if args.summarize else run(args)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1, sort_keys=True) + "\n")
    print(table(result))
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
