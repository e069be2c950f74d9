"""The cost model: cycles per BSP step from the kernels' estimators and the exchange horizons."""
from __future__ import annotations

from ..operators import registry


def scalar_args(args) -> list[int]:
    """Vertex arguments with buffer references as 0: estimators read only the scalars."""
    return [a if isinstance(a, int) else 0 for a in args]


def vertex_cycles(kernel: str, args, machine: dict) -> int:
    """A vertex's compute cycles by its kernel's estimator (memoised: programs repeat vertices)."""
    kv = registry().kernels[kernel]
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


def step_compute(step: dict, machine: dict) -> dict[str, int]:
    return {tile: sum(vertex_cycles(k, a, machine) for k, a in verts)
            for tile, verts in step["vertices"].items()}


def program_cost(program: dict, horizons: list[int], machine: dict) -> dict:
    """``final_cycles`` = Σ over steps of (exchange horizon + slowest tile's compute + sync);
    also the lower bound Σ max(balanced compute, balanced exchange) + syncs."""
    sync = machine["exchange"]["sync_cycles"]
    tiles = program["tile_count"]
    total = exchange = bound = 0
    steps = []
    for step, horizon in zip(program["steps"], horizons):
        compute = step_compute(step, machine)
        slowest = max(compute.values(), default=0)
        moved = sum(t[8] * t[9] for t in step["transfers"])
        bound += max(-(-sum(compute.values()) // tiles),
                     -(-moved // (tiles * machine["exchange"]["bytes_per_cycle"]))) + sync
        total += horizon + slowest + sync
        exchange += horizon
        steps.append({"name": step["name"], "exchange": horizon, "compute": slowest, "sync": sync})
    return {"final_cycles": total, "final_exchange": exchange, "lower_bound": bound, "steps": steps}
