"""The compiler's phases, by the reference's names, each a pure function of declared inputs.

Artifacts: ``graph`` (IR JSON), ``params`` (constants and example inputs), ``layout`` (the
search's choice), ``search`` (its convergence), ``program`` (steps, buffers, transfers), ``provisional_storage``,
``exchange_schedule``, ``kernel_plan``, ``link_map``, ``code_sizes``, ``storage``,
``exchange_tables``, ``placed_exchanges``, ``cost``, the per-tile families ``tile_program``,
``tile_data``, ``tile_code``, ``tile_kernels`` and ``images`` (each an index of one blob per tile),
then ``host_program`` and the package. See ``docs/architecture.md`` for the picture.
"""
from __future__ import annotations

import weakref

import numpy as np

from ...graph import tensors
from ...graph.artifacts import graph_of, machine_of, params_of, to_json as _json
from ...graph.artifacts import to_plan_blob, to_plan_json as _plan
from ...graph.artifacts import buffer_numbers
from ...graph.placement import placement_blob, placement_of
from ...graph.program_buffers import CODE, buffers_of
from ...engine import canonical
from ...engine.engine import phase
from ...engine.executors import run_phases
from ...engine.log import log, progress
from . import codegen, exchange, storage as mem
from .cost import program_cost
from .program import build_program, kernels_per_tile, program_blob

OPS = ("ipubuild_operators",)


def reservations_of(ctx) -> dict[str, int]:
    """Code bytes reserved for each kernel variant the target compiles (``compile_kernels``)."""
    return ctx.json("reservations")


@phase("compile_runtime", inputs=("machine",), outputs=("runtime",), config=("target.tile_count",))
def compile_runtime(ctx):
    """The tile runtime's footprint: what the loader places before any generated code."""
    m = machine_of(ctx)
    layout = mem.tile_ranges(m, 0)
    return {"runtime": _json({"linked_end": layout["linked_end"], "host_code_base": layout["host_code_base"],
                              "host_code_bytes": m["code"]["host_code_bytes"],
                              "tile_count": ctx.config["target"]["tile_count"]})}


# planning (plan_package, the search's phase, is in search.py) -----------------------------------
def provisional_code_bytes(program: dict, reservations: dict) -> dict[str, int]:
    """An upper bound of each tile's generated code before exchanges are scheduled. Its
    exchange table: per step, the larger of the two tables the step's schedule may keep (its
    coalesced transfers grouped into broadcasts for an ordinary or a paired schedule); placing
    storage only merges entries."""
    per_tile = kernels_per_tile(program)
    tiles = program["tile_count"]
    table = np.zeros(tiles, np.int64)
    for step in program["steps"]:
        if len(step["transfers"]):
            table += _step_table(step["transfers"], tiles)
    table, body = table.tolist(), program_steps_bytes(program).tolist()
    return {tile: sum(reservations[k] for k in per_tile.get(tile, [])) + codegen.exchange_bytes(0, 0)
            + table[int(tile)] + codegen.program_bytes(per_tile.get(tile, []), []) + body[int(tile)]
            for tile in map(str, range(tiles))}


def program_steps_bytes(program: dict) -> np.ndarray:
    """Per tile, what its steps take of its encoded tile program (``codegen.program_bytes`` less
    the header and kernel names, which do not depend on the steps): 8 bytes per step it runs
    vertices in, 4 per vertex and 4 per argument."""
    tiles = program["tile_count"]
    out = np.zeros(tiles, np.int64)
    for step in program["steps"]:
        v = step["vertices"].astype(np.int64)
        if len(v):
            np.add.at(out, v[:, 0], 4 + 4 * v[:, 2])
            out[np.unique(v[:, 0])] += 8
    return out


def _step_table(transfers: np.ndarray, tiles: int) -> np.ndarray:
    """Per tile, the larger of the exchange tables one step's transfers may keep. Memoised by
    the bytes of the transfers ``renumbered``: a search candidate shares most steps with its
    incumbent, up to the buffers' numbers (on ViT-B/16 the grouping is 3 s of a candidate), and
    forked workers inherit the parent's."""
    step = _renumbered(transfers)                       # the same sizes whatever the buffers' numbers
    key = (step.digest, tiles)
    found = _step_tables.get(key)
    if found is None:
        entry = codegen.exchange_bytes(1, 0) - codegen.exchange_bytes(0, 0)
        per_destination = codegen.exchange_bytes(0, 1) - codegen.exchange_bytes(0, 0)
        # not kept for schedule_exchange_phase: on ViT-B/16 every step's groups at once are
        # gigabytes (it groups them again, one step at a time)
        _, plain, pairs = exchange.grouped_arrays(transfers)
        sizes = [np.bincount(g.heads[:, 0], weights=entry + per_destination * g.destinations(), minlength=tiles)
                 for g in (plain, pairs)]
        found = np.maximum(*sizes).astype(np.int64)
        found.flags.writeable = False
        if len(_step_tables) >= 1024:
            _step_tables.clear()
        _step_tables[key] = found
    return found


_step_tables: dict = {}


class _Step:
    """What both phases that read a step's transfers derive from them: the digest of their
    ``exchange.renumbered`` rows (with dtype and shape), the buffer codes those stand for, and
    once made, the digest of the sub-phase input that holds them (``schedule_exchange_phase``'s)."""

    __slots__ = ("ref", "digest", "codes", "input")

    def __init__(self, transfers):
        renamed, self.codes = exchange.renumbered(transfers)
        self.ref = weakref.ref(transfers)
        self.digest = (canonical.digest(np.ascontiguousarray(renamed)), renamed.dtype.str, renamed.shape)
        self.input = None


def _renumbered(transfers: np.ndarray) -> _Step:
    """``_Step`` of a step's transfers, memoised by the array itself (held weakly, never
    mutated): a search candidate's program shares most of its steps with the build it
    resumed, and renumbering and hashing every step's transfers again was 2-3 s of a ViT-B/16
    candidate."""
    if not isinstance(transfers, np.ndarray):
        return _Step(np.asarray(transfers))
    found = _steps.get(id(transfers))
    if found is None or found.ref() is not transfers:
        found = _Step(transfers)
        if len(_steps) >= 4096:
            _steps.clear()
        _steps[id(transfers)] = found
    return found


_steps: dict[int, _Step] = {}


def _allocate_all(program: dict, code: dict[str, int], machine: dict) -> bytes:
    """The ``storage`` artifact (``graph.placement``) of the program with each tile's code at
    ``code[tile]`` bytes."""
    tiles = {}
    align = machine["memory"]["alignment"]
    buffers = buffers_of(program)
    table = buffers.table
    addresses = np.full(len(table) + 1, -1, np.int64)          # by buffer number: 1, 2, …
    numbers = buffer_numbers(table[:, CODE])
    for n, tile in enumerate(buffers):
        progress("tiles' storage placed", n, len(buffers))
        ranges = mem.tile_ranges(machine, code.get(tile, 0))
        if ranges["code_end"] > machine["memory"]["executable_end"]:
            from ...engine.errors import UserError
            raise UserError(f"tile {tile}", f"generated code needs {code[tile]} bytes but the "
                            f"executable region holds {machine['memory']['executable_end'] - ranges['code_address']}; "
                            "raise target.tile_count")
        tiles[tile] = {"code_bytes": code.get(tile, 0), "ranges": ranges}
        lo, hi = buffers.span(tile)
        addresses[numbers[lo:hi]] = mem.allocate_rows(table[lo:hi], ranges["available_ranges"], align,
                                                      tile=int(tile), names=_BufferNames(buffers, tile, program["names"]))
    progress("tiles' storage placed", len(buffers), len(buffers))
    return placement_blob(tiles, addresses)


class _BufferNames:
    """Buffer id -> the name of the tensor it holds (for error messages; looked up lazily)."""

    def __init__(self, buffers, tile: str, names: dict):
        self.buffers, self.tile, self.names = buffers, tile, names

    def get(self, bid, default=None):
        try:
            value = self.buffers.record(self.tile, bid)["value"]
        except (KeyError, ValueError):       # not a buffer of this tile, or not a program's name
            return default
        return self.names.get(value, default)


@phase("place_provisional_storage", inputs=("graph", "layout", "machine", "reservations"),
       outputs=("program", "provisional_storage", "provisional_code"), config=("target.tile_count",), hooks=OPS)
def place_provisional_storage(ctx):
    """The program, its storage placed with its code at the provisional size, and that size per
    tile (``{tile: bytes}``: small, so that the search reads it without the placement)."""
    g, m = graph_of(ctx), machine_of(ctx)
    program = build_program(g, ctx.json("layout"), ctx.config["target"]["tile_count"])
    code = provisional_code_bytes(program, reservations_of(ctx))
    return {"program": program_blob(program), "provisional_storage": _allocate_all(program, code, m),
            "provisional_code": _json(code)}


@phase("schedule_exchange_phase", inputs=("transfers", "machine"), outputs=("schedule",))
def schedule_exchange_phase(ctx):
    """One exchange phase's schedule: a sub-phase, so that identical phases (in this program or
    in a search candidate) reuse it from the cache."""
    return {"schedule": to_plan_blob(exchange.schedule_phase(ctx.json("transfers"), machine_of(ctx)),
                                     tuple(path[1:] for path in exchange.SCHEDULE_ARRAYS))}


@phase("schedule_provisional_exchanges", inputs=("program", "machine"), outputs=("exchange_schedule",))
def schedule_provisional_exchanges(ctx):
    program = ctx.json("program")
    out = []
    for s, step in enumerate(program["steps"]):
        if not len(step["transfers"]):
            out.append(exchange.no_schedule())
            continue
        # renumbered: the same step after a change upstream (which renumbers buffers) is reused
        known = _renumbered(step["transfers"])
        if known.input is None or not ctx.engine.store.holds_pinned(known.input):
            canonical_transfers, _ = exchange.renumbered(step["transfers"])
            known.input = ctx.engine.put(to_plan_blob(canonical_transfers, ((),)), pin=True)
        r = ctx.engine.run("schedule_exchange_phase", {"transfers": known.input, "machine": ctx.digest("machine")}, {})
        sched = exchange.restore_buffers(ctx.engine.decoded(r.outputs["schedule"]), known.codes)
        if r.hit:
            log.info("reused exchange optimization after validating relocated rows", phase=s)
        else:
            log.info("compared ordinary and paired exchange schedules", phase=s, candidates=sched["candidates"],
                     ordinary_horizon=sched["ordinary_horizon"], paired_horizon=sched["paired_horizon"],
                     use_paired=sched["use_paired"])
        out.append(sched)
    return {"exchange_schedule": to_plan_blob(out, exchange.SCHEDULE_ARRAYS)}


@phase("plan_kernels", inputs=("program",), outputs=("kernel_plan",))
def plan_kernels(ctx):
    program = ctx.json("program")
    per_tile = kernels_per_tile(program)
    counts = np.zeros(program["tile_count"], np.int64)
    for step in program["steps"]:
        np.add.at(counts, step["vertices"][:, 0].astype(np.int64), 1)
    vertices = {t: int(counts[int(t)]) for t in per_tile}
    return {"kernel_plan": _json({"tiles": per_tile, "vertices": vertices,
                                  "kernels": sorted({k for ks in per_tile.values() for k in ks})})}


@phase("link_runtime", inputs=("kernel_plan", "runtime", "machine", "reservations"), outputs=("link_map",))
def link_runtime(ctx):
    """Kernel code addresses per tile, from the reservations (not the objects: an edit that
    stays inside its reservation moves nothing)."""
    plan, runtime, m = ctx.json("kernel_plan"), ctx.json("runtime"), machine_of(ctx)
    res = reservations_of(ctx)
    base = mem.tile_ranges(m, 0)["code_address"]
    out = {}
    for tile, kernels in plan["tiles"].items():
        addr, placed = base, []
        for k in kernels:
            placed.append([k, addr, res[k]])
            addr += res[k]
        out[tile] = {"kernels": placed, "kernel_bytes": addr - base}
    return {"link_map": _json({"runtime": runtime, "tiles": out})}


@phase("link_kernels", inputs=("link_map", "objects"), outputs=("tile_kernels/*",))
def link_kernels(ctx):
    """Bind each tile's kernel slots to the compiled objects' digests (one member per tile, so
    an edited kernel changes only the tiles that run it)."""
    objects = ctx.family("objects")
    return {f"tile_kernels/{tile}": _json([[k, addr, size, objects[k]] for k, addr, size in info["kernels"]])
            for tile, info in ctx.json("link_map")["tiles"].items()}


@phase("size_tile_code", inputs=("program", "link_map", "exchange_schedule"), outputs=("code_sizes",))
def size_tile_code(ctx):
    program, link, sched = ctx.json("program"), ctx.json("link_map"), ctx.json("exchange_schedule")
    tiles = program["tile_count"]
    entries = np.zeros(tiles, np.int64)
    dests = np.zeros(tiles, np.int64)
    for s in sched:
        g = exchange.scheduled(s)
        entries += np.bincount(g.heads[:, 0], minlength=tiles)
        dests += np.bincount(g.heads[:, 0], weights=g.destinations(), minlength=tiles).astype(np.int64)
    entries, dests, body = entries.tolist(), dests.tolist(), program_steps_bytes(program).tolist()
    out = {}
    for tile in map(str, range(tiles)):
        kernels = [k for k, _, _ in link["tiles"].get(tile, {"kernels": []})["kernels"]]
        prog = codegen.program_bytes(kernels, []) + body[int(tile)]
        xch = codegen.exchange_bytes(entries[int(tile)], dests[int(tile)])
        kb = link["tiles"].get(tile, {"kernel_bytes": 0})["kernel_bytes"]
        out[tile] = {"kernel_bytes": kb, "program_bytes": prog, "exchange_table_bytes": xch,
                     "total": kb + prog + xch}
    biggest = max(v["exchange_table_bytes"] for v in out.values())
    log.info("exchange table and repeat patch storage", exchange_table_bytes=biggest,
             maximum_uncompressed_repeat_patch_bytes=0, maximum_elided_arithmetic_patch_bytes=0)
    return {"code_sizes": _plan(out)}


@phase("place_storage", inputs=("program", "code_sizes", "machine"), outputs=("storage",))
def place_storage(ctx):
    program, sizes, m = ctx.json("program"), ctx.json("code_sizes"), machine_of(ctx)
    placed = _allocate_all(program, {t: v["total"] for t, v in sizes.items()}, m)
    t = max(sizes, key=lambda k: (sizes[k]["total"], -int(k)))
    r, s, c = mem.tile_ranges(m, sizes[t]["total"]), sizes[t], m["code"]
    log.info("placing generated tile programs", linked_end=r["linked_end"], host_code_base=r["host_code_base"],
             host_code_bytes=c["host_code_bytes"], generated_code_bytes=s["total"],
             exchange_table_bytes=s["exchange_table_bytes"], executable_ranges=_ranges(r["executable_ranges"]))
    log.info("allocated package support memory", linked_end=r["linked_end"], profile_bytes=c["profile_bytes"],
             exchange_table_bytes=s["exchange_table_bytes"], host_code_bytes=c["host_code_bytes"],
             host_data_bytes=c["host_data_bytes"], generated_code_bytes=s["total"],
             code_address=r["code_address"], available_ranges=_ranges(r["available_ranges"]))
    return {"storage": placed}


def _ranges(rs) -> str:
    return "[" + ", ".join(f"({a}, {b})" for a, b in rs) + "]"


@phase("lower_exchanges", inputs=("exchange_schedule", "storage"), outputs=("exchange_tables",))
def lower_exchanges(ctx):
    sched, placed = ctx.json("exchange_schedule"), placement_of(ctx.json("storage"))
    return {"exchange_tables": to_plan_blob([{**exchange.resolve(exchange.scheduled(s), placed).as_fields(),
                                              "use_paired": s["use_paired"]} for s in sched], exchange.SCHEDULE_ARRAYS)}


@phase("optimize_exchange_placement", inputs=("exchange_tables", "program", "machine"),
       outputs=("placed_exchanges", "cost"), hooks=OPS)
def optimize_exchange_placement(ctx):
    tables, program, m = ctx.json("exchange_tables"), ctx.json("program"), machine_of(ctx)
    placed, horizons = [], []
    for t in tables:
        entries = exchange.merge_adjacent(exchange.Groups.from_fields(t))
        horizons.append(exchange.horizon_of(entries, m, t["use_paired"]) if len(entries) else 0)
        placed.append({**entries.as_fields(), "use_paired": t["use_paired"], "horizon": horizons[-1]})
    cost = program_cost(program, horizons, m)
    log.info("costed final placed program", final_cycles=cost["final_cycles"], final_exchange=cost["final_exchange"])
    log.info("bounded final placed program", lower_bound=cost["lower_bound"],
             ratio=f"{cost['final_cycles'] / max(1, cost['lower_bound']):.3f}", peak_bound=cost["peak_bound"],
             peak_ratio=f"{cost['final_cycles'] / max(1, cost['peak_bound']):.3f}")
    return {"placed_exchanges": to_plan_blob(placed, exchange.SCHEDULE_ARRAYS), "cost": _json(cost)}


# code and images -------------------------------------------------------------------------------
def _tile_steps(program: dict, placed) -> dict[int, list]:
    """``{tile: [[step, [[kernel (the program's index), [u32 arguments]], ...]], ...]}``: each
    tile's vertices per step with every buffer argument placed (``placed``: a
    ``graph.placement.Placement``)."""
    out: dict[int, list] = {}
    addresses = np.asarray(placed.addresses, dtype=np.int64)
    for s, step in enumerate(program["steps"]):
        v, args = step["vertices"], step["args"].astype(np.int64)
        if not len(v):
            continue
        values = (args[:, 0] + np.where(args[:, 1] > 0, addresses[args[:, 1]], 0)).tolist()
        at = 0
        for tile, kernel, count in v.tolist():
            verts = out.setdefault(tile, [])
            if not verts or verts[-1][0] != s:
                verts.append([s, []])
            verts[-1][1].append((kernel, values[at:at + count]))
            at += count
    return out


@phase("prepare_tile_code", inputs=("graph", "params", "program", "storage", "placed_exchanges", "link_map",
                                    "code_sizes"),
       outputs=("tile_program/*", "tile_data/*", "host_program"))
def prepare_tile_code(ctx):
    g = graph_of(ctx)
    program, link, sizes = ctx.json("program"), ctx.json("link_map"), ctx.json("code_sizes")
    placed = placement_of(ctx.json("storage"))
    address = placed.addresses.tolist()                      # by buffer number
    consts, _ = params_of(ctx, g)
    buffers = buffers_of(program)
    sends: dict[str, list] = {t: [] for t in buffers}
    for s, table in enumerate(ctx.json("placed_exchanges")):
        for e in exchange.Groups.from_fields(table).entry_lists():
            sends[str(e[0])].append([s] + e)
    steps_of = _tile_steps(program, placed)
    out = {}
    for tile, bufs in buffers.items():
        kernels = [k for k, _, _ in link["tiles"].get(tile, {"kernels": []})["kernels"]]
        index = {program["kernels"].index(k): i for i, k in enumerate(kernels)}
        steps = [[s, [[index[k], args] for k, args in verts]] for s, verts in steps_of.get(int(tile), [])]
        code_address = placed.tiles[tile]["ranges"]["code_address"]
        kb = sizes[tile]["kernel_bytes"]
        out[f"tile_program/{tile}"] = _plan({
            "kernels": kernels, "steps": steps, "exchange": sends[tile],
            "paired": [t["use_paired"] for t in ctx.json("placed_exchanges")],
            "addresses": {"program": code_address + kb,
                          "exchange": code_address + kb + sizes[tile]["program_bytes"]}})
        data = {}
        for bid, b in bufs.items():
            if "init" in b:
                vk, r0, r1, c0, c1 = b["init"]
                arr = consts[int(vk[1:])]
                arr2 = arr.reshape(-1, arr.shape[-1]) if arr.ndim > 1 else arr.reshape(1, -1)
                data[f"{g.values[int(vk[1:])].name}@{address[int(bid[1:])]}"] = np.ascontiguousarray(arr2[r0:r1, c0:c1])
        out[f"tile_data/{tile}"] = tensors.pack(data)
    def binding(entry):
        v = g.values[entry["value"]]
        return {"name": v.name, "dtype": v.dtype, "shape": list(v.shape), "scale_exp": v.scale_exp,
                "ranges": codegen.bindings(v, entry["ranges"], placed)}
    out["host_program"] = _json({
        "initialize": {"phases": 1}, "run": {"phases": len(program["steps"])},
        "steps": [s["name"] for s in program["steps"]],
        "paired": [t["use_paired"] for t in ctx.json("placed_exchanges")],
        "horizons": [t["horizon"] for t in ctx.json("placed_exchanges")],
        "inputs": [binding(e) for e in program["inputs"]],
        "outputs": [binding(e) for e in program["outputs"]]})
    return out


@phase("emit_tile_code", inputs=("tile_program",), outputs=("tile_code/*",))
def emit_tile_code(ctx):
    out = {}
    for tile, digest in ctx.family("tile_program").items():
        p = ctx.engine.decoded(digest)
        prog = codegen.encode_program(p["kernels"], p["steps"])
        xch = codegen.encode_exchange(p["exchange"])
        out[f"tile_code/{tile}"] = tensors.pack({
            "program": np.frombuffer(prog, np.uint8), "exchange": np.frombuffer(xch, np.uint8),
            "addresses": np.array([p["addresses"]["program"], p["addresses"]["exchange"]], "<u4")})
    return out


@phase("build_tile_images", inputs=("tile_code", "tile_data", "tile_kernels"), outputs=("images",))
def build_tile_images(ctx):
    """Every used tile's image (and the idle tiles' one, as ``idle``), each by the
    ``build_tile_image`` sub-phase: a tile whose code, data and kernels did not change is a
    cache hit, so a kernel edit rebuilds only the images of the tiles that run it."""
    code, data, kernels = (ctx.family(n) for n in ("tile_code", "tile_data", "tile_kernels"))
    images, built = {}, 0
    tiles = sorted(code, key=int)
    calls = [("build_tile_image", {"tile_code": code[t], "tile_data": data[t], "tile_kernels": kernels[t]}, {})
             for t in tiles]
    for tile, r in zip(tiles, run_phases(ctx.engine, calls)):     # here, or on a cluster
        images[tile] = r.outputs["image"]
        built += not r.hit
    images["idle"] = ctx.engine.run("build_idle_image", {}, {}).outputs["image"]
    log.info("built tile images", tiles=len(code), rebuilt=built, reused=len(code) - built)
    return {"images": _json(images)}


@phase("build_tile_image", inputs=("tile_code", "tile_data", "tile_kernels"), outputs=("image",))
def build_tile_image(ctx):
    code = tensors.unpack(ctx.bytes("tile_code"))
    prog_addr, xch_addr = (int(a) for a in code["addresses"])
    data = tensors.unpack(ctx.bytes("tile_data"))
    return {"image": codegen.build_image(
        {"program": code["program"].tobytes(), "exchange": code["exchange"].tobytes(),
         "addresses": {"program": prog_addr, "exchange": xch_addr}}, data, ctx.json("tile_kernels"))}


@phase("build_idle_image", outputs=("image",))
def build_idle_image(ctx):
    return {"image": codegen.build_image({}, {}, [])}
