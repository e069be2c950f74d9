"""A target's program, step by step, without a build: lower its graph, place the initial layout
(with the kernels' reservations of the last build in the current tree, as the build places it),
or read one (a layout JSON, or the search state's incumbent), and print the estimator's figure
and, with ``--exact``, the cost model's (the program, each exchange phase scheduled, the cost:
no storage placement, tile images or device), per step: exchange, compute, sync, and the gap to
the step's share of the lower bound, split into its *sequence* (the smaller of the step's balanced
compute and balanced exchange: a BSP step does one, then the other, so no layout recovers it
without changing the steps) and its *imbalance* over the tiles (what a layout can recover).
The fast loop for plan work: ViT-B/16's initial layout takes minutes and ~1.5 GB here, its
exact table a few GB more; a build costs far more.

    python benchmarks/step_table.py vit_fp8 --exact
    python benchmarks/step_table.py vit_b16_fp8 --layout .ipubuild/search/vit_b16_fp8.state.json --exact
"""
from __future__ import annotations

import argparse
import collections
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("target")
    ap.add_argument("--layout", help="a layout JSON, or a search state (its incumbent)")
    ap.add_argument("--exact", action="store_true", help="also the cost model's per-step figures")
    ap.add_argument("--top", type=int, default=0, help="only the N costliest steps")
    ap.add_argument("--save", help="write the layout used here")
    args = ap.parse_args(argv)

    from ipubuild import frontend, plugins, targets
    from ipubuild.compiler.machine import load_machine
    from ipubuild.compiler.placement import initial_layouts
    from ipubuild.search import SearchContext

    t0 = time.perf_counter()
    target = targets.load_target(str(ROOT / "targets" / f"{args.target}.toml"))
    graph = frontend.build_model(plugins.get_plugin_manager(), target).graph
    tiles = target["target"]["tile_count"]
    machine = load_machine(target["target"]["machine"])
    reservations = _built_reservations(args.target)
    sc = SearchContext(graph, tiles, machine, reservations)
    if args.layout:
        raw = Path(args.layout).read_bytes()
        if raw[:64].isalnum() and b"\n" in raw[:80]:          # a search state: checksum line first
            raw = raw.split(b"\n", 1)[1]
        layout = json.loads(raw)
        layout = layout.get("state", layout)                  # a search state: {"sha256", "state"}
        layout = layout.get("incumbent", layout)
    else:
        layout = next(initial_layouts(sc))
    est = sc.estimator
    res = est.resolve(layout)
    print(f"{args.target}: {len(graph.ops)} operations on {tiles} tiles; "
          f"{'the initial layout placed with the kernel reservations of the last build here; ' if reservations and not args.layout else ''}"
          f"estimate {est.estimate(layout)}, "
          f"within the caps: {est.fits(layout)} ({time.perf_counter() - t0:.0f} s)")
    grids = [(op.name, {d: p[d] for d in "mnk"}) for op in graph.ops
             if "m" in (p := est.resolver.plan(op, res[op.id][0]))]
    print("matmul grids (m × n × k):", ", ".join(f"{n} {g['m']}×{g['n']}×{g['k']}" for n, g in grids))
    if args.save:
        Path(args.save).write_text(json.dumps(layout))
    if not args.exact:
        return 0

    from ipubuild.compiler.planning import exchange
    from ipubuild.compiler.planning.cost import program_cost, step_compute, transfer_bytes
    from ipubuild.compiler.planning.program import build_program
    program = build_program(graph, layout, tiles)
    horizons = [exchange.schedule_phase(s["transfers"], machine)["horizon"] if len(s["transfers"]) else 0
                for s in program["steps"]]
    cost = program_cost(program, horizons, machine)
    f, x = cost["final_cycles"], cost["final_exchange"]
    print(f"final_cycles={f} final_exchange={x} ({100 * x / f:.0f} %) lower_bound={cost['lower_bound']} "
          f"({f / cost['lower_bound']:.2f} x) peak_bound={cost['peak_bound']} ({f / cost['peak_bound']:.1f} x) "
          f"({time.perf_counter() - t0:.0f} s)")
    rows = []
    for step, s in zip(program["steps"], cost["steps"]):
        comp = step_compute(step, machine, program["kernels"])
        balanced = (-(-sum(comp.values()) // tiles),
                    -(-transfer_bytes(step["transfers"]) // (tiles * machine["exchange"]["bytes_per_cycle"])))
        gap = s["exchange"] + s["compute"] - max(balanced)
        rows.append((s["name"], s["exchange"], s["compute"], s["sync"], gap, min(balanced), gap - min(balanced)))
    sequenced = sum(r[5] for r in rows)
    floor = cost["lower_bound"] + sequenced
    # a step exchanges, then computes: even balanced perfectly over the tiles, the steps cost their
    # balanced exchange *plus* their balanced compute, which the lower bound (their max) does not count
    print(f"balanced floor={floor} ({floor / cost['lower_bound']:.3f} x lower_bound): of the "
          f"{f - cost['lower_bound']} cycles over the lower bound, {sequenced} are exchange and compute "
          f"in sequence (a step's smaller balanced term), {f - floor} imbalance over the tiles")
    if args.top:
        rows = sorted(rows, key=lambda r: -(r[1] + r[2]))[:args.top]
    print(f"{'step':36s} {'exchange':>9s} {'compute':>9s} {'sync':>5s} {'gap':>8s} {'sequence':>8s} {'imbalance':>9s}")
    for name, xe, c, sy, gap, seq, imb in rows:
        print(f"{name:36s} {xe:9d} {c:9d} {sy:5d} {gap:8d} {seq:8d} {imb:9d}")
    by_kind = collections.Counter()
    for op, s in zip(program["steps"], cost["steps"]):
        by_kind[op["name"].split("#")[0].split(".")[-1]] += s["exchange"] + s["compute"] + s["sync"]
    print("by operation:", ", ".join(f"{k} {v}" for k, v in by_kind.most_common(8)))
    return 0


def _built_reservations(target: str) -> dict | None:
    """What the last build of ``target`` in the current tree reserved for each kernel (the
    initial layout is placed with it, as the build does), or None where nothing was built. A
    blob the cache has let go is made again by its self-healing (``compile_kernels`` re-run)."""
    if not (Path.cwd() / ".ipubuild" / "refs" / target / "kernel_reservations.ref").exists():
        return None
    from ipubuild.build.pipeline import Workspace
    from ipubuild.engine import canonical, registry
    from ipubuild.engine.engine import MissingBlob
    ws = Workspace.at(Path.cwd())
    digest = ws.read_ref(f"{target}/kernel_reservations")
    if digest is None:
        return None
    registry.load_phases()
    try:
        return canonical.loads(ws.engine.fetch(digest))
    except MissingBlob:
        return None


if __name__ == "__main__":
    sys.exit(main())
