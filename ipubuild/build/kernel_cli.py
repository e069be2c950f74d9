"""One kernel variant from the command line: ``doit kernel:<variant>``, without a whole build.

It compiles the variant as a build does (the checked build, ``-DIPU_CHECKED=1``, with the
build's compiler and flags, through ``ipubuild.testing``), takes the shapes a target gives it —
the first operation of the target's graph that calls the variant, lowered under the first of its
plans whose tile work reads only the operation's own inputs — fills that operation's inputs with
seeded random values (or ``.npy`` files), runs that tile's vertices on a tile memory, and
compares what they wrote with the operator's reference on the same inputs, within its
tolerance (``Operator.tolerance``; an FP8 output without a folded cast must match code for
code), as the per-operation check of a build does (``ipubuild.compare.judge``). It reports the
variant's host time (the median of ``--repeat`` calls) and the basic blocks one call executes
(its counted build, as ``measure_kernels`` counts them). Options (doit task parameters)::

    doit kernel:gelu_f32_fp8                         # shapes from the first target that uses it
    doit kernel:matmul_f143_f143 --target vit_rms --repeat 50 --seed 3
    doit kernel:gelu_f32 --target vit_fp8 --inputs x.npy   # the operation's inputs, in order

A failing comparison or a vertex that refuses its arguments fails the task (one line).
"""
from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path, PurePosixPath

import numpy as np

from ..engine.errors import UserError

FP8 = ("f143", "f152")


def _targets(root: Path, pm, wanted: str):
    """The tree's and the plugins' targets to look in, loaded: the one named ``wanted``, or all
    (smallest tile count first, targets bare ``doit`` skips last)."""
    from ..graph.operators import registry
    from .suggest import did_you_mean
    from ..compiler.targets import find_targets, load_target
    from .analysis import _known_names
    found, _ = find_targets(root, pm)
    if wanted:
        chosen = [tf for tf in found if tf.name == wanted]
        if not chosen:
            close = did_you_mean(wanted, [tf.name for tf in found])
            raise UserError(f"--target {wanted}", "no such target" + (f"; did you mean {' or '.join(close)}?"
                            if close else f"; known: {', '.join(sorted(tf.name for tf in found))}"))
        found = chosen
    registry()
    known = _known_names(pm)
    loaded = []
    for tf in found:
        try:
            target = load_target(tf.path, known=known, shown=getattr(tf, "shown", None)) if tf.plugin \
                else load_target(tf.path, known=known, root=root)
        except UserError:
            if wanted:
                raise
            continue
        loaded.append(target)
    loaded.sort(key=lambda t: (not t["target"]["default"], t["target"]["tile_count"], t["name"]))
    return loaded


def find_work(graph, reg, variant: str, tile_count: int):
    """``(op, plan, tile work)``: the first operation of ``graph`` that may call ``variant``, under
    the first of its plans that gives a tile a vertex of it and reads only the operation's
    inputs (no temporaries from another stage); None if none does."""
    for op in graph.ops:
        operator = reg.get(op.type)
        if variant not in operator.variants(graph, op):
            continue
        inputs = {f"v{v}" for v in op.inputs}
        for plan in operator.plans(graph, op, tile_count):
            if "follow" in plan:
                continue
            try:
                lowering = operator.lower(graph, op, plan)
            except (ValueError, KeyError, TypeError):
                continue
            for stage in lowering.stages:
                for work in stage:
                    if any(name == variant for name, _ in work.vertices) and \
                            all(r[0] in inputs for r in work.reads):
                        return op, plan, work, lowering
    return None


def random_inputs(graph, op, seed: int) -> list[np.ndarray]:
    """Seeded random values for each input of ``op``: f32/f16 standard normal, FP8 codes of
    normal values spread over a quarter of the format's range at the value's scale."""
    from ..graph import fp8
    rng = np.random.default_rng(seed)
    out = []
    for vid in op.inputs:
        v = graph.values[vid]
        x = rng.standard_normal(v.shape)
        if v.dtype in FP8:
            top = 240.0 if v.dtype == "f143" else 57344.0
            out.append(fp8.encode((x * top / 4 * 2.0 ** -v.scale_exp).astype(np.float32), v.dtype, v.scale_exp))
        else:
            out.append(x.astype(np.float16 if v.dtype == "f16" else np.float32))
    return out


def given_inputs(graph, op, paths: str) -> list[np.ndarray]:
    """The operation's inputs from ``.npy`` files (comma-separated, in input order)."""
    from ..compiler.harness import STORAGE
    files = [p for p in paths.split(",") if p]
    if len(files) != len(op.inputs):
        raise UserError("--inputs", f"operation {op.name} ({op.type}) takes {len(op.inputs)} inputs, got "
                        f"{len(files)} files")
    out = []
    for f, vid in zip(files, op.inputs):
        v = graph.values[vid]
        try:
            a = np.load(f, allow_pickle=False)
        except (OSError, ValueError) as exc:
            raise UserError(f"--inputs {f}", f"cannot read it as .npy: {exc}") from None
        want = np.dtype(STORAGE[v.dtype])
        if tuple(a.shape) != tuple(v.shape) or a.dtype != want:
            raise UserError(f"--inputs {f}", f"expected {v.name}: shape {list(v.shape)} of {want}, got "
                            f"{list(a.shape)} of {a.dtype}")
        out.append(a)
    return out


def _block(a: np.ndarray, value, r0, r1, c0, c1) -> np.ndarray:
    return np.ascontiguousarray(np.asarray(a).reshape(value.rows, value.cols)[r0:r1, c0:c1])


def counted_blocks(variant, tile, args) -> int | None:
    """Basic blocks one call of ``variant`` executes on ``tile`` with ``args`` (its counted
    build, checked, as ``compile_counted_kernel`` compiles it); None if the compiler cannot."""
    import ctypes

    from ..compiler import kernels as K
    from ..builtin.simulator import load_vertex, tell_tile
    src = Path(variant.source).resolve()
    slot = K.source_slot(src)
    folder = slot.rpartition("/")[0]
    files = {s: f.read_bytes() for s, f in K.header_sources().items()}
    files.update({f"{folder}/{f.name}": f.read_bytes() for f in sorted(src.parent.iterdir())
                  if f.suffix in K.SOURCE_SUFFIXES and f.is_file()})
    files = {slot: files[slot], **{h: files[h] for h in K.included(slot, files)},
             str(PurePosixPath(slot).parent / K.COUNTER_NAME): K.COUNTER.read_bytes()}
    cc, cflags = K.compiler()
    defines = [*map(list, variant.defines), list(K.CHECKED)]
    code, obj, _ = K.run_compiler(variant.name, src.name, files, slot, defines, cc, f"{cflags} {K.COUNT_FLAGS}",
                                  extra=(K.COUNTER_NAME,))
    if code != 0:
        return None
    with tempfile.TemporaryDirectory(prefix="ipubuild-kernel-") as tmp:
        lib, fn = load_vertex(Path(tmp) / "counted.so", obj, "ipu_counted_vertex",
                              [ctypes.c_void_p, ctypes.c_void_p, ctypes.POINTER(ctypes.c_uint64)],
                              f"kernel {variant.name}", "cannot load its counted object")
        tell_tile(lib, tile.mem.size, 0)
        a = np.ascontiguousarray(np.asarray([int(x) & 0xFFFFFFFF for x in args] or [0], dtype=np.uint32))
        blocks = ctypes.c_uint64(0)
        fn(tile.mem.ctypes.data, a.ctypes.data, ctypes.byref(blocks))
        return int(blocks.value)


def run_kernel(root: Path, variant: str, *, target: str = "", seed: int = 0, repeat: int = 20,
               inputs: str = "") -> tuple[bool, list[str]]:
    """Run ``variant`` as the module's docstring says: ``(passed, report lines)``."""
    from ..compiler import harness as testing
    from ..device.compare import judge, operation_reference
    from ..graph.frontend import build_model, supplying_model_files
    from .build import model_files
    from ..graph.operators import registry
    from ..plugins import get_plugin_manager
    from .suggest import did_you_mean
    pm = get_plugin_manager()
    reg = registry()
    if variant not in reg.kernels:
        close = did_you_mean(variant, reg.kernels)
        raise UserError(f"kernel {variant}", "no registered operator declares this variant"
                        + (f"; did you mean {' or '.join(close)}?" if close else ""))
    kv = reg.kernels[variant]
    found = None
    for t in _targets(root, pm, target):
        try:
            files = {slot: (lambda p=p: (root / p).read_bytes()) for slot, p in model_files(t, root).items()}
            with supplying_model_files(files):
                graph = build_model(pm, t).graph
        except UserError:
            if target:
                raise
            continue            # a target that cannot build here: its own build says why
        found = find_work(graph, reg, variant, t["target"]["tile_count"])
        if found:
            break
    if not found:
        where = f"target {target}" if target else "any target of this tree"
        raise UserError(f"kernel {variant}", f"no operation of {where} calls it (so no build compiles it); "
                        "give --target a target whose graph uses it")
    op, plan, work, lowering = found
    operator = reg.get(op.type)
    args_in = given_inputs(graph, op, inputs) if inputs else random_inputs(graph, op, seed)
    folded, plain, pres, refs = operation_reference(graph, op, operator, args_in)
    tols = []

    # the tile: the operation's input blocks it reads, space for what it writes
    values = {f"v{v}": (graph.values[v], a) for v, a in zip(op.inputs, args_in)}
    reads = [_block(values[k][1], values[k][0], r0, r1, c0, c1) for k, r0, r1, c0, c1 in work.reads]
    outs = {f"v{v}": (graph.values[v], i) for i, v in enumerate(op.outputs)}
    writes = []
    for k, r0, r1, c0, c1 in work.writes:
        dtype = outs[k][0].dtype if k in outs else lowering.temps[k][2]
        writes.append(((r1 - r0, c1 - c0), dtype))
    kernels = {name: testing.load_variant(name, werror=False, checked=True) for name, _ in work.vertices}
    tile = testing.TileMemory()
    r_addr = [tile.put(a) for a in reads]
    w_addr = [tile.alloc(int(np.prod(s)) * np.dtype(testing.STORAGE[dt]).itemsize) for s, dt in writes]

    def resolve(a):
        if isinstance(a, (tuple, list)):
            kind, i, off = a
            return (r_addr if kind == "r" else w_addr)[i] + off
        return int(a)
    calls = [(name, [resolve(a) for a in args]) for name, args in work.vertices]
    start = tile.mem.copy()
    for name, args in calls:
        status = kernels[name](tile, args)
        if status != 0:
            why = kernels[name].reason() or f"returned {status}"
            return False, [f"kernel {name}: the vertex refused its arguments: {why} (args {args})"]
    result = [tile.read(a, dt, s) for a, (s, dt) in zip(w_addr, writes)]
    # time and count the variant's first call on the memory it ran on (the calls before it redone)
    tile.mem[:] = start
    first = next(i for i, (name, _) in enumerate(calls) if name == variant)
    for name, args in calls[:first]:
        kernels[name](tile, args)
    before, vargs = tile.mem.copy(), calls[first][1]
    times = []
    for _ in range(max(1, repeat)):
        tile.mem[:] = before
        t0 = time.perf_counter_ns()
        kernels[variant](tile, vargs)
        times.append(time.perf_counter_ns() - t0)
    tile.mem[:] = before
    blocks = counted_blocks(kv, tile, vargs)

    lines = [f"kernel {variant} ({Path(kv.source).name}{''.join(f' -D{k}={v}' for k, v in kv.defines)}, "
             f"checked build): operation {op.name} ({op.type}) of target {t['name']}, plan {plan}, tile {work.tile}"]
    ok = True
    for (k, r0, r1, c0, c1), got in zip(work.writes, result):
        if k not in outs:
            continue
        v, i = outs[k]
        ref = _block(refs[i], v, r0, r1, c0, c1)
        exact = v.dtype in FP8 and not (folded and i == 0)

        def bound(i=i, v=v, r0=r0, r1=r1, c0=c0, c1=c1):
            if not tols:
                tols.extend(operator.tolerance(graph, plain, args_in, pres))
            tol = np.broadcast_to(np.asarray(tols[i], np.float64), np.shape(np.asarray(pres[i]))).reshape(v.rows, v.cols)
            return _block(pres[i], v, r0, r1, c0, c1), tol[r0:r1, c0:c1]
        j = judge(got.reshape(ref.shape), v, ref, None if exact else bound)
        verdict = "PASS" if not j["failed"] else "FAIL"
        ok = ok and not j["failed"]
        how = "code for code" if exact else "within its tolerance"
        line = (f"  {v.name}[{r0}:{r1}, {c0}:{c1}] {v.dtype}: {j['elements']} elements, {j['differ']} differ from "
                f"the reference, {j['failed']} outside ({how}){' max error/tolerance ' + j['ratio'] if 'ratio' in j else ''}"
                f": {verdict}")
        if j.get("worst"):
            w = j["worst"]
            at = np.unravel_index(w["index"], ref.shape)
            line += f" (worst: [{r0 + int(at[0])}, {c0 + int(at[-1])}] expected {w['expected']} got {w['got']})"
        lines.append(line)
    lines.append(f"  host time: median {statistics.median(times) / 1000:.1f} us of {len(times)} calls "
                 f"(min {min(times) / 1000:.1f} us)")
    lines.append(f"  basic blocks: {blocks:,} per call" if blocks is not None
                 else "  basic blocks: not counted (the compiler has no -fsanitize-coverage=trace-pc)")
    lines.append(f"kernelTest={'PASS' if ok else 'FAIL'}")
    return ok, lines
