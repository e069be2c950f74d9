"""Figures measured on the compiled kernels, per vertex kind: the basic blocks they execute.

The cycle estimators (``KernelVariant.cycles``) model a kernel; they do not read its code, so an
edit to a kernel's C source leaves the device profile's cycles as they were. This module measures
the code itself. ``compile_kernels`` compiles every variant the target uses a second time, with
``-fsanitize-coverage=trace-pc`` and ``kernels/counter/block_counter.c`` (the compiler calls a
counting function at the start of every basic block it emits); ``measure_kernels`` runs the package's
program on the host — the simulator's loading and exchange, with the counted objects in place of
the package's — and records, per kernel variant, its calls, the blocks they executed (in all, and
the fewest and most of one call) and its estimator's cycles. A count depends only on the
compiled code and the data the call reads, so the result is the same on every run and is an
ordinary content-addressed artifact (``<target>.kernels.json``, and a table on the profile page).

Planning reads only the plain objects' reservations, and the package only the plain objects: the
counted ones feed ``measure_kernels`` alone, so editing only kernel code re-runs the compile, the
images, the package, the device run and this measurement, and no planning phase. A compiler
without the flag, or a variant that does not compile with it, leaves that variant's figures out,
with a one-line note saying why.

Host time is not measured here: it varies from run to run, and every artifact of a build must be
reproducible; ``doit profile:<target>`` measures it on demand (``host_times``).
"""
from __future__ import annotations

import ctypes
import statistics
import tempfile
import time
from pathlib import Path

from ..engine import canonical
from ..graph import tensors
import numpy as np

from ..builtin import vertex_runner
from ..builtin.simulator import (Simulator, _input_bytes, _Plan, _pool, _row, load_vertex, run_exchange, tell_tile,
                                 threads)
from ..engine.engine import phase
from ..engine.errors import UserError
from ..compiler.kernels import COUNT_FLAGS, counting


class _Counting(Simulator):
    """The simulator's loading, with each kernel variant's counted build (``counted``: its
    object's bytes) loaded beside its plain one and told the tile's size and where its data map
    lies, as the simulator tells a checked build: ``self.counted[lane]`` is ``{variant: counted
    entry point}``, one copy of each counted object per lane (a counted build counts in a static
    variable: two threads must not run one copy at once)."""

    def __init__(self, counted: dict[str, bytes], lanes: int = 1):
        self.objects, self.counted = counted, [{} for _ in range(lanes)]

    def _load_kernels(self, pkg, workdir, tile_bytes, map_at):
        plain = super()._load_kernels(pkg, workdir, tile_bytes, map_at)
        for name in plain:
            if name in self.objects:
                for lane, found in enumerate(self.counted):
                    lib, fn = load_vertex(Path(workdir) / f"counted-{name}-{lane}.so", self.objects[name],
                                          "ipu_counted_vertex",
                                          [ctypes.c_void_p, ctypes.c_void_p, ctypes.POINTER(ctypes.c_uint64)],
                                          f"kernel {name}", "cannot load its counted object")
                    tell_tile(lib, tile_bytes, map_at)
                    found[name] = fn
        return plain


def _counted_blocks(pkg, inputs: dict, workdir: Path, counted: dict[str, bytes]):
    """Run the program of ``pkg`` (a ``Package``) on the host, step by step, every vertex in
    tile then program order, each kernel variant's counted build in place of its plain one
    where it has one: ``(the _Plan, each vertex's executed blocks)`` (``2**64 - 1`` where
    uncounted), vertices in the plan's order. A step's lanes (runs of whole tiles, which share
    no memory) run on threads at once, as the simulator runs them."""
    lanes = threads() if vertex_runner.library() is not None else 1
    loader = _Counting(counted, lanes)
    plan, memory, row_of = _loaded_plan(loader, pkg, inputs, workdir, lanes)
    fns = [[mine.get(name) or fn for name, (fn, _) in zip(plan.names, plan.kernels)] for mine in loader.counted]
    flags = np.array([name in loader.counted[0] for name in plan.names] + [False], np.uint8)
    addresses = [np.array([ctypes.cast(fn, ctypes.c_void_p).value for fn in mine] + [0], np.uint64) for mine in fns]
    blocks = np.empty(len(plan.kernel), np.uint64)

    def run_lane(lane: int, lo: int, hi: int) -> None:
        count = ctypes.c_uint64()
        k = plan.kernel[lo:hi]
        found = vertex_runner.count(addresses[lane][k], flags[k], plan.mems[lo:hi], plan.argp[lo:hi])
        if found is None:                                # through ctypes, one call at a time
            found = np.empty(hi - lo, np.uint64)
            for j, i in enumerate(range(lo, hi)):
                fn, mem, args = fns[lane][plan.kernel[i]], int(plan.mems[i]), int(plan.argp[i])
                if flags[plan.kernel[i]]:
                    fn(mem, args, ctypes.byref(count))
                    found[j] = count.value
                else:
                    fn(mem, args)
                    found[j] = UNCOUNTED
        blocks[lo:hi] = found

    with _pool(lanes) as pool:
        for s in range(len(plan.step_bounds) - 1):
            run_exchange(memory, row_of, plan.entries[s], pool)
            first, *rest = plan.lanes[s] or [(0, 0)]
            later = [pool.submit(run_lane, lane, *span) for lane, span in enumerate(rest, 1)]
            run_lane(0, *first)
            for f in later:
                f.result()
    return plan, blocks


UNCOUNTED = np.uint64(2**64 - 1)


def _loaded_plan(loader: Simulator, pkg, inputs: dict, workdir: Path, lanes: int = 1):
    """``pkg`` loaded by ``loader`` with ``inputs`` written: its ``_Plan`` on ``lanes`` lanes, its
    memory and its ``row_of``."""
    m = pkg.manifest
    loaded = loader._load(pkg, m["machine"], workdir)
    plan = _Plan(loaded, m["machine"], m["host"]["run"]["phases"], lanes)
    for b in m["inputs"]:
        raw = _input_bytes(b, inputs)
        for off, size, tile, addr in b["ranges"]:
            loaded.memory[_row(loaded.row_of, tile, b["name"]), addr:addr + size] = raw[off:off + size]
    return plan, loaded.memory, loaded.row_of


def _executed(pkg, inputs: dict, workdir: Path):
    """Run the program of ``pkg`` (a ``Package``) on the host, one vertex after another in
    program order: yield ``(kernel, args, call)`` for every vertex call, in order, and the caller
    makes the ``call()``."""
    plan, memory, row_of = _loaded_plan(Simulator(), pkg, inputs, workdir)
    for s in range(len(plan.step_bounds) - 1):
        run_exchange(memory, row_of, plan.entries[s])
        yield from plan.calls(s)         # every call of the step in tile order, then program order


def _inputs(graph: dict, params: bytes) -> dict:
    """The program's inputs by name, from the ``graph`` and ``params`` artifacts."""
    from ..graph.ir import Graph
    g = Graph.from_json(graph)
    arrays = tensors.unpack(params)
    return {g.values[v].name: arrays[f"v{v}"] for v in g.inputs}


@phase("measure_kernels", inputs=("package", "params", "graph", "counted_objects"), outputs=("kernel_profile",),
       config=("profile.kernel_counts", "target.tile_count"), hooks=("ipubuild_operators",))
def measure_kernels(ctx):
    """Per kernel variant: calls, estimated cycles (its estimator) and executed basic blocks
    (``<target>.kernels.json``; see the module's docstring). With the target's ``[profile]
    kernel_counts`` off, only a note saying so."""
    if not counting(ctx.config):
        return {"kernel_profile": canonical.dumps({
            "measure": "", "kernels": {}, "notes": [
                f"kernels not counted: [profile] kernel_counts = {ctx.config['profile']['kernel_counts']!r} "
                f"on {ctx.config['target']['tile_count']} tiles; set it to \"on\" to count them"]})}
    from ..device.package import validated
    counted = ctx.json("counted_objects")
    objects = {name: ctx.engine.fetch(d) for name, d in counted["objects"].items()}
    pkg = validated(ctx.bytes("package"), "package", ctx.digest("package"))
    with tempfile.TemporaryDirectory(prefix="ipubuild-measure-") as work:
        plan, blocks = _counted_blocks(pkg, _inputs(ctx.json("graph"), ctx.bytes("params")), Path(work), objects)
    kinds: dict[str, dict] = {}
    for k in sorted(set(plan.kernel.tolist())):
        mine = plan.kernel == k
        executed = blocks[mine]
        kinds[plan.names[k]] = {
            "calls": int(mine.sum()), "estimated_cycles": int(plan.cycles[mine].sum()),
            "blocks": None if (executed == UNCOUNTED).any() else int(executed.sum(dtype=np.uint64)),
            "blocks_per_call": None if (executed == UNCOUNTED).any() else [int(executed.min()), int(executed.max())]}
    by_reason: dict[str, list[str]] = {}
    for name, note in sorted(counted["notes"].items()):
        by_reason.setdefault(note, []).append(name)
    notes = [f"no basic-block counts for {', '.join(names)}: {note}" for note, names in sorted(by_reason.items())]
    return {"kernel_profile": canonical.dumps({
        "measure": f"basic blocks executed by each kernel compiled with {COUNT_FLAGS}, on the build's inputs",
        "kernels": kinds, "notes": notes})}


# doit profile:<target>: host time per kernel, measured on demand ---------------------------------
def host_times(package: bytes, inputs: dict, repeat: int = 3) -> dict[str, dict]:
    """Host time of each kernel variant's vertex calls, running the package's own objects on this
    machine ``repeat`` times: ``{variant: {"calls", "median_ns"}}``, the median over every call
    of every run. It varies from run to run, so it is never part of an artifact."""
    from ..device.package import validated
    pkg = validated(package, "package")
    times: dict[str, list[int]] = {}
    clock = time.perf_counter_ns
    for _ in range(repeat):
        with tempfile.TemporaryDirectory(prefix="ipubuild-time-") as work:
            for kname, _, call in _executed(pkg, inputs, Path(work)):
                t0 = clock()
                call()
                times.setdefault(kname, []).append(clock() - t0)
    return {k: {"calls": len(v) // repeat, "median_ns": int(statistics.median(v))} for k, v in sorted(times.items())}


def host_time_table(kernel_profile: dict, times: dict[str, dict]) -> list[str]:
    """Per kernel variant: calls, estimated cycles, executed basic blocks and host time, as
    aligned text lines."""
    kinds = kernel_profile.get("kernels", {})
    head = ("kernel", "calls", "estimated cycles", "basic blocks", "blocks/call", "host time median/call")
    rows = []
    for name in sorted(set(kinds) | set(times)):
        k, t = kinds.get(name, {}), times.get(name)
        per = k.get("blocks_per_call")
        rows.append((name, str(k.get("calls", t["calls"] if t else "")),
                     f"{k['estimated_cycles']:,}" if "estimated_cycles" in k else "–",
                     f"{k['blocks']:,}" if k.get("blocks") is not None else "–",
                     (f"{per[0]:,}" if per[0] == per[1] else f"{per[0]:,}–{per[1]:,}") if per else "–",
                     f"{t['median_ns'] / 1000:.1f} µs" if t else "–"))
    widths = [max(len(r[j]) for r in [head, *rows]) for j in range(len(head))]
    lines = ["  ".join(c.ljust(widths[j]) if j == 0 else c.rjust(widths[j]) for j, c in enumerate(r))
             for r in [head, *rows]]
    lines += [f"note: {n}" for n in kernel_profile.get("notes", [])]
    return lines


def profile_lines(root: Path, target: str) -> list[str]:
    """The kernel table of ``doit profile:<target>``: the build's kernel profile, and host time
    measured now on the built package (or a line saying why it could not be)."""
    from ..engine.engine import MissingBlob
    from .pipeline import Workspace
    out = Path(root) / "artifacts" / target
    try:
        kernel_profile = canonical.loads((out / f"{target}.kernels.json").read_bytes())
    except (OSError, ValueError):
        return [f"no kernel figures: artifacts/{target}/{target}.kernels.json is missing or unreadable; "
                f"run `doit build:{target}`"]
    try:
        ws = Workspace.at(root)
        digests = [ws.read_ref(f"{target}/{a}") for a in ("graph", "params")]
        if None in digests:
            raise UserError(f"{target}", "the build's graph or inputs are not in the cache")
        graph, params = (ws.engine.fetch(d) for d in digests)
        times = host_times((out / f"{target}.ipuexe").read_bytes(), _inputs(canonical.loads(graph), params))
        note = ("host time: this machine, the package's own kernel objects, the median over the calls of 3 runs; "
                "it varies from run to run (the other figures do not)")
    except (OSError, UserError, MissingBlob) as exc:
        times, note = {}, f"host time not measured: {exc}; run `doit build:{target}`"
    return [*host_time_table(kernel_profile, times), note]
