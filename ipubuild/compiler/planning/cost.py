"""The cost model: cycles per BSP step from the kernels' estimators and the exchange horizons."""
from __future__ import annotations

import collections
import threading
from fractions import Fraction

import numpy as np

from ...graph.operators import registry


def scalar_args(args) -> list[int]:
    """Vertex arguments with buffer references as 0: estimators read only the scalars."""
    return [a if isinstance(a, int) else 0 for a in args]


def vertex_cycles(kernel: str, args, machine: dict, kernels: dict | None = None) -> int:
    """A vertex's compute cycles by its kernel's estimator (memoised: programs repeat vertices);
    ``kernels``: the registry's kernel variants, if the caller has them at hand."""
    kv = (kernels if kernels is not None else registry().kernels)[kernel]
    scalars = tuple(scalar_args(args))
    key = (id(kv), scalars, id(machine))
    found = _cycles.get(key)
    if found is None:
        found = int(kv.cycles(list(scalars), machine))
        if len(_cycles) > 65536:
            _cycles.clear()
        _cycles[key] = (found, kv, machine)   # holding them keeps their ids from being reused
        return found
    return found[0]


_cycles: dict = {}


def step_compute(step: dict, machine: dict, program_kernels: list[str]) -> dict[str, int]:
    """Per tile, the compute cycles of one program step (whose vertices index
    ``program_kernels``, the program's ``kernels``). Memoised by the step itself: a program
    built by resuming another (``build_program``) shares its steps, which are never modified
    once built (readers of the engine's values must not modify them)."""
    kernels = registry()
    key = (id(step), id(machine), id(kernels))
    with _computes_lock:
        found = _computes.get(key)
        if found is not None:
            _computes.move_to_end(key)
            return found[0]
    compute = _tiles_compute(step, program_kernels, kernels.kernels, machine)
    with _computes_lock:
        _computes[key] = (compute, step, machine, kernels)   # held, so that their ids are not reused
        while len(_computes) > COMPUTES_KEPT:
            _computes.popitem(last=False)
    return compute


def _tiles_compute(step: dict, names: list[str], variants: dict, machine: dict) -> dict[str, int]:
    """``step_compute`` worked out: each vertex's cycles by its kernel's estimator on its scalar
    arguments (buffer references as 0), looked up once per distinct kernel and arguments."""
    v = step["vertices"].astype(np.int64)
    if not len(v):
        return {}
    args = step["args"]
    scalars = np.where(args[:, 1] == 0, args[:, 0], 0).tolist()
    cycles, at, seen = [], 0, {}
    for kernel, count in v[:, 1:].tolist():
        key = (kernel, *scalars[at:at + count])
        c = seen.get(key)
        if c is None:
            c = seen[key] = vertex_cycles(names[kernel], scalars[at:at + count], machine, variants)
        cycles.append(c)
        at += count
    per_tile = np.bincount(v[:, 0], weights=np.asarray(cycles, dtype=np.float64)).astype(np.int64)
    return {str(t): int(per_tile[t]) for t in np.unique(v[:, 0]).tolist()}


#: the steps whose compute is kept, the most recently used: a ViT-B/16 program has 209 steps, and
#: a candidate shares most of them with the incumbent (a decoded step holds its program's blob, so
#: the memo stays small)
COMPUTES_KEPT = 256
_computes: collections.OrderedDict = collections.OrderedDict()
_computes_lock = threading.Lock()


def transfer_bytes(transfers) -> int:
    """The bytes an array of transfers moves."""
    t = np.asarray(transfers, dtype=np.int64).reshape(-1, 10)
    return int((t[:, 8] * t[:, 9]).sum())


def peak_bound(program: dict, machine: dict) -> int:
    """A bound no program of this graph can beat on ``tile_count`` tiles: every operation's
    multiply-accumulates at the AMP's peak rate (or, for one without, its output elements at
    the vector units' peak rate), spread perfectly over all tiles, with no exchange and one
    sync."""
    c = machine["compute"]
    work = sum((Fraction(w["macs"], c["amp_macs_per_cycle"][w["dtype"]]) if w["macs"]
                else Fraction(w["elements"], c["vector_flops_per_cycle"])) for w in program.get("work", []))
    return -(-work.numerator // (work.denominator * program["tile_count"])) + machine["exchange"]["sync_cycles"]


def program_cost(program: dict, horizons: list[int], machine: dict) -> dict:
    """``final_cycles`` = Σ over steps of (exchange horizon + slowest tile's compute + sync);
    also the lower bound Σ max(balanced compute, balanced exchange) + syncs (this program's:
    its steps, its work and the bytes it moves, each received byte counted once per receiving
    tile), and ``peak_bound`` (the graph's, whatever the program: see ``peak_bound``)."""
    sync = machine["exchange"]["sync_cycles"]
    tiles = program["tile_count"]
    total = exchange = bound = 0
    steps = []
    for step, horizon in zip(program["steps"], horizons):
        compute = step_compute(step, machine, program["kernels"])
        slowest = max(compute.values(), default=0)
        moved = transfer_bytes(step["transfers"])
        bound += max(-(-sum(compute.values()) // tiles),
                     -(-moved // (tiles * machine["exchange"]["bytes_per_cycle"]))) + sync
        total += horizon + slowest + sync
        exchange += horizon
        steps.append({"name": step["name"], "exchange": horizon, "compute": slowest, "sync": sync})
    return {"final_cycles": total, "final_exchange": exchange, "lower_bound": bound,
            "peak_bound": peak_bound(program, machine), "steps": steps}
