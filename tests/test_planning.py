"""Planning (ipubuild/planning): storage allocation, exchange scheduling and coalescing, cost."""
from __future__ import annotations

import copy
import re
from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from ipubuild.graph.program_buffers import buffers_of
from ipubuild import frontend, ir, plugins, targets
from ipubuild.errors import UserError
from ipubuild.compiler.machine import load_machine
from ipubuild.operators import registry
from ipubuild.compiler.planning import codegen, exchange, phases, storage
from ipubuild.compiler.planning.cost import program_cost, step_compute
from ipubuild.compiler.planning.program import build_program, default_layout, plans_of, vertices_of

ROOT = Path(__file__).resolve().parents[1]
MACHINE = load_machine("ipu21")
FAST = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@pytest.fixture(scope="module")
def vit_graph():
    t = targets.load_target(str(ROOT / "targets" / "vit_fp8.toml"))
    return frontend.build_model(plugins.get_plugin_manager(), t).graph


@pytest.fixture(scope="module")
def vit_program(vit_graph):
    return build_program(vit_graph, default_layout(vit_graph, 64), 64)


def align_up(x, a):
    return -(-x // a) * a


# storage -----------------------------------------------------------------------------------------
@st.composite
def ranges_st(draw):
    cuts = sorted(draw(st.lists(st.integers(0, 20000), min_size=2, max_size=6, unique=True)))
    pairs = [(cuts[i], cuts[i + 1]) for i in range(0, len(cuts) - 1, 2)]
    return draw(st.permutations(pairs))


@st.composite
def buffers_st(draw):
    n = draw(st.integers(1, 14))
    out = {}
    for i in range(n):
        start = draw(st.integers(0, 5))
        out[f"b{i}"] = {"size": draw(st.integers(0, 3000)), "start": start,
                        "end": start + draw(st.integers(0, 3))}
    return out


_MSG = re.compile(r"^tile (\d+): tensor (\S+) needs (\d+) bytes but the largest free block of tile memory "
                  r"is (\d+) bytes; ")


@FAST
@given(buffers_st(), ranges_st(), st.sampled_from([4, 8, 16]), st.integers(0, 1471))
def test_allocate_is_safe_or_explains(buffers, ranges, alignment, tile):
    names = {b: f"tensor_{b}" for b in buffers}
    try:
        addrs = storage.allocate(buffers, ranges, alignment, tile=tile, names=names)
    except UserError as exc:
        msg = str(exc)
        assert "\n" not in msg
        m = _MSG.match(msg)
        assert m, msg
        assert int(m.group(1)) == tile
        bid = m.group(2).removeprefix("tensor_")
        assert bid in buffers
        needed, free = int(m.group(3)), int(m.group(4))
        assert needed == align_up(max(buffers[bid]["size"], 1), alignment)
        if alignment == 8:        # the free-space report is computed at 8-byte alignment
            assert free < needed
        # the buffer really cannot fit when it is alone: or its live neighbours crowd it out
        biggest = max((hi - align_up(lo, alignment) for lo, hi in ranges), default=0)
        others = [b for b in buffers if b != bid and buffers[b]["start"] <= buffers[bid]["end"]
                  and buffers[bid]["start"] <= buffers[b]["end"]]
        assert needed > biggest or others
        return
    assert set(addrs) == set(buffers)
    placed = {}
    for b, a in addrs.items():
        size = align_up(max(buffers[b]["size"], 1), alignment)
        assert a % alignment == 0, (b, a)
        assert any(lo <= a and a + size <= hi for lo, hi in ranges), (b, a, size, ranges)
        placed[b] = (a, a + size)
    for x in buffers:
        for y in buffers:
            if x < y and buffers[x]["start"] <= buffers[y]["end"] and buffers[y]["start"] <= buffers[x]["end"]:
                (a0, a1), (b0, b1) = placed[x], placed[y]
                assert a1 <= b0 or b1 <= a0, (x, placed[x], y, placed[y])


@FAST
@given(st.lists(st.integers(1, 4000), min_size=1, max_size=10), ranges_st(), st.sampled_from([4, 8, 16]))
def test_allocate_disjoint_lifetimes_reuse_memory(sizes, ranges, alignment):
    """Buffers that are never live together each get the start of the first range (in the given
    order) that holds them."""
    buffers = {f"b{i}": {"size": s, "start": 2 * i, "end": 2 * i + 1} for i, s in enumerate(sizes)}
    fits = [r for r in ranges if align_up(r[0], alignment) + align_up(max(sizes), alignment) <= r[1]]
    assume(fits)
    addrs = storage.allocate(buffers, ranges, alignment, tile=0)
    for b, s in zip(buffers, sizes):
        first = next(align_up(lo, alignment) for lo, hi in ranges
                     if align_up(lo, alignment) + align_up(s, alignment) <= hi)
        assert addrs[b] == first


def test_allocate_overflow_message():
    with pytest.raises(UserError) as info:
        storage.allocate({"a": {"size": 100, "start": 0, "end": 3}, "b": {"size": 100, "start": 1, "end": 2}},
                         [(0, 160)], 8, tile=7, names={"a": "alpha", "b": "beta"})
    assert str(info.value).startswith("tile 7: tensor beta needs 104 bytes but the largest free block of "
                                      "tile memory is 56 bytes")


def test_allocate_overflow_message_is_consistent_for_wide_alignment():
    with pytest.raises(UserError) as info:
        storage.allocate({"x": {"size": 8, "start": 0, "end": 0}}, [(8, 72)], 64, tile=3)
    m = _MSG.match(str(info.value))
    assert int(m.group(4)) < int(m.group(3)), str(info.value)


def _tiny_machine():
    mach = copy.deepcopy(load_machine("ipu21"))
    code_end = storage.tile_ranges(mach, 0)["code_end"]
    mach["memory"]["loader_limit"] = code_end + 4096
    return mach


def test_memory_overflow_through_the_pipeline(vit_program):
    mach = _tiny_machine()
    assert phases._allocate_all(vit_program, {}, load_machine("ipu21"))   # fits on the real machine
    with pytest.raises(UserError) as info:
        phases._allocate_all(vit_program, {}, mach)
    msg = str(info.value)
    m = _MSG.match(msg)
    assert m and "\n" not in msg, msg
    tile = m.group(1)
    assert tile in buffers_of(vit_program)
    needed, free = int(m.group(3)), int(m.group(4))
    assert free < needed
    sizes = [align_up(b["size"], 8) for b in buffers_of(vit_program)[tile].values()]
    assert needed in sizes
    assert "tile_count" in msg


def test_memory_overflow_names_the_graph_tensor(vit_graph, vit_program):
    with pytest.raises(UserError) as info:
        phases._allocate_all(vit_program, {}, _tiny_machine())
    name = _MSG.match(str(info.value)).group(2)
    assert name in {v.name for v in vit_graph.values.values()}, str(info.value)


def test_code_overflow_through_the_pipeline(vit_program):
    mach = load_machine("ipu21")
    room = mach["memory"]["executable_end"] - storage.tile_ranges(mach, 0)["code_address"]
    with pytest.raises(UserError, match=r"^tile 5: generated code needs .* bytes"):
        phases._allocate_all(vit_program, {"5": room + 1}, mach)


def test_vit_allocation_respects_lifetimes(vit_program):
    from ipubuild.graph.artifacts import from_plan_blob
    from ipubuild.graph.placement import placement_of
    placed = placement_of(from_plan_blob(phases._allocate_all(vit_program, {}, MACHINE)))
    for tile, bufs in buffers_of(vit_program).items():
        addrs = {bid: placed.address(bid) for bid in bufs}
        ranges = placed.tiles[tile]["ranges"]["available_ranges"]
        items = sorted(bufs.items())
        for i, (x, bx) in enumerate(items):
            sx = align_up(max(bx["size"], 1), 8)
            assert any(lo <= addrs[x] and addrs[x] + sx <= hi for lo, hi in ranges)
            for y, by in items[i + 1:]:
                if bx["start"] <= by["end"] and by["start"] <= bx["end"]:
                    sy = align_up(max(by["size"], 1), 8)
                    assert addrs[x] + sx <= addrs[y] or addrs[y] + sy <= addrs[x], (tile, x, y)


# exchange ----------------------------------------------------------------------------------------
@st.composite
def transfers_st(draw, max_tiles=8, broadcast=False):
    n = draw(st.integers(1, 25))
    out = []
    for _ in range(n):
        rows = draw(st.integers(1, 6))
        rb = draw(st.integers(1, 300))
        t = [draw(st.integers(0, max_tiles - 1)), "o1", 0, rb, draw(st.integers(0, max_tiles - 1)), "g2", 0, rb, rows, rb]
        if broadcast and t[0] != t[4]:
            more = draw(st.lists(st.integers(0, max_tiles - 1), max_size=3, unique=True))
            for d in more:
                if d not in (t[0], t[4]):
                    t.extend([d, "g2", 0, rb])
        out.append(t)
    return out


def _duration(t, paired):
    x = MACHINE["exchange"]
    rows, nbytes = t[8], t[8] * t[9]
    if t[0] == t[4]:
        return x["transfer_setup_cycles"] * rows + -(-nbytes // x["local_copy_bytes_per_cycle"])
    if paired:
        return x["paired_setup_cycles"] + x["transfer_setup_cycles"] * rows + -(-nbytes // x["paired_bytes_per_cycle"])
    return x["transfer_setup_cycles"] * rows + -(-nbytes // x["bytes_per_cycle"])


def _ports(t, paired):
    if t[0] == t[4] and len(t) == 10:
        return [("local", t[0])]
    dests = exchange.destination_tiles(t)
    if paired:
        return [("send", t[0] // 2)] + sorted({("recv", d // 2) for d in dests})
    return [("send", t[0])] + [("recv", d) for d in dests]


def _replay(transfers, order, paired):
    free, end = defaultdict(int), 0
    for i in order:
        ports = _ports(transfers[i], paired)
        start = max(free[p] for p in ports)
        for p in ports:
            free[p] = start + _duration(transfers[i], paired)
        end = max(end, start + _duration(transfers[i], paired))
    return end


@FAST
@given(transfers_st(broadcast=True), st.booleans())
def test_schedule_respects_ports(transfers, paired):
    horizon, order = exchange.schedule(transfers, MACHINE, paired)
    assert sorted(order) == list(range(len(transfers)))
    # never longer than starting the largest first; the same for any order of the transfers
    largest = sorted(range(len(transfers)), key=lambda i: (-transfers[i][8] * transfers[i][9], transfers[i]))
    assert horizon <= _replay(transfers, largest, paired)
    assert exchange.schedule(transfers[::-1], MACHINE, paired)[0] == horizon
    # re-simulate: each transfer starts when all its ports are free
    free, busy = defaultdict(int), defaultdict(list)
    end = 0
    for i in order:
        t = transfers[i]
        ports = _ports(t, paired)
        start = max(free[p] for p in ports)
        dur = _duration(t, paired)
        for p in ports:
            busy[p].append((start, start + dur))
            free[p] = start + dur
        end = max(end, start + dur)
    assert horizon == end
    for p, spans in busy.items():
        spans.sort()
        for (a0, a1), (b0, b1) in zip(spans, spans[1:]):
            assert a1 <= b0, (p, spans)
    # bandwidth bounds: no port moves more than its bandwidth allows
    bw = MACHINE["exchange"]["paired_bytes_per_cycle" if paired else "bytes_per_cycle"]
    per_port = defaultdict(int)
    for t in transfers:
        if _ports(t, paired)[0][0] != "local":
            for p in _ports(t, paired):
                per_port[p] += t[8] * t[9]
    if per_port:
        assert horizon * bw >= max(per_port.values())
    assert horizon >= max(_duration(t, paired) for t in transfers)
    assert horizon <= sum(_duration(t, paired) for t in transfers)


@FAST
@given(transfers_st(max_tiles=6))
def test_schedule_phase_prefers_ordinary_unless_paired_is_shorter(transfers):
    s = exchange.schedule_phase(transfers, MACHINE)
    merged = exchange.coalesce(transfers)
    ordinary, _ = exchange.schedule(exchange.broadcasts(merged, False), MACHINE, paired=False)
    paired, _ = exchange.schedule(exchange.broadcasts(merged, True), MACHINE, paired=True)
    assert (s["ordinary_horizon"], s["paired_horizon"]) == (ordinary, paired)
    assert s["use_paired"] == (paired < ordinary)
    if s["paired_horizon"] >= s["ordinary_horizon"]:
        assert not s["use_paired"]
    assert s["horizon"] == min(ordinary, paired)
    assert s["candidates"] == len(merged)
    chosen = exchange.broadcasts(merged, s["use_paired"])
    assert sorted(map(str, exchange.scheduled(s).lists())) == sorted(map(str, chosen))


@st.composite
def program_transfers_st(draw, max_tiles=6):
    """Transfers as a program makes them: buffers by name, offsets, strides and rows varied, so
    that some coalesce and some share their source rows."""
    n = draw(st.integers(1, 40))
    bufs = [f"{k}{i}" for k in "go" for i in (1, 2, 10, 11)]
    out = []
    for _ in range(n):
        rows = draw(st.integers(1, 4))
        rb = draw(st.sampled_from([8, 16, 24]))
        stride = draw(st.sampled_from([rb, 2 * rb]))
        out.append([draw(st.integers(0, max_tiles - 1)), draw(st.sampled_from(bufs)), draw(st.sampled_from([0, 8, 16, 24])),
                    stride, draw(st.integers(0, max_tiles - 1)), draw(st.sampled_from(bufs)),
                    draw(st.sampled_from([0, 8, 16, 24])), draw(st.sampled_from([rb, 2 * rb])), rows, rb])
    return out


@FAST
@given(program_transfers_st(), st.booleans())
def test_array_grouping_is_the_list_grouping(transfers, paired):
    """The planner groups a program's transfers over arrays; the list functions are the
    reference: the same coalesced transfers, the same broadcasts in the same order."""
    merged = exchange.coalesce(transfers)
    arrays = exchange.coalesce_array(exchange.transfer_array(transfers))
    assert exchange.transfer_lists(arrays) == merged
    assert exchange.broadcast_groups(arrays, paired).lists() == exchange.broadcasts(merged, paired)


def _unicast(transfers):
    """Broadcasts split back into one transfer per destination."""
    out = []
    for t in transfers:
        dests = [t[4:8]] + [t[i:i + 4] for i in range(10, len(t), 4)]
        out.extend(t[:4] + d + t[8:10] for d in dests)
    return out


@FAST
@given(st.lists(st.tuples(st.integers(0, 7), st.integers(0, 2), st.integers(1, 3), st.integers(1, 40)),
                min_size=1, max_size=30), st.booleans())
def test_broadcasts_group_same_source_rows_onto_distinct_ports(sends, paired):
    transfers = [[src, "s", off * 64, 64, dst, f"d{i}", 0, 64, rows, 40] for i, (src, off, rows, dst) in
                 enumerate((src, off, rows, dst % 8) for src, off, rows, dst in sends)]
    grouped = exchange.broadcasts(transfers, paired)
    assert sorted(map(str, _unicast(grouped))) == sorted(map(str, transfers))    # same bytes, same places
    for t in grouped:
        ports = [d // 2 if paired else d for d in exchange.destination_tiles(t)]
        assert len(ports) == len(set(ports))
        assert len(ports) == 1 or t[0] not in exchange.destination_tiles(t)
    single = {(t[0], t[2], t[8]) for t in transfers if t[0] != t[4]}
    assert len([t for t in grouped if t[0] != t[4]]) >= len(single)
    assert exchange.broadcasts(transfers, paired) == grouped                       # deterministic


def test_a_broadcast_costs_one_send():
    one = [[0, "s", 0, 400, 1, "d", 0, 400, 1, 400]]
    fan = [[0, "s", 0, 400, d, "d", 0, 400, 1, 400] for d in range(1, 9)]
    single = exchange.schedule(one, MACHINE, paired=False)[0]
    assert exchange.schedule(fan, MACHINE, paired=False)[0] == 8 * single       # one send port, eight sends
    grouped = exchange.broadcasts(fan, paired=False)
    assert len(grouped) == 1 and exchange.destination_tiles(grouped[0]) == list(range(1, 9))
    assert exchange.schedule(grouped, MACHINE, paired=False)[0] == single
    assert exchange.schedule_phase([[0, "o1", *t[2:5], "g2", *t[6:]] for t in fan], MACHINE)["horizon"] == single


@st.composite
def gather_st(draw):
    """Transfers into disjoint destination ranges; some continue the previous one on both sides."""
    out, cursor = [], defaultdict(int)
    for _ in range(draw(st.integers(1, 20))):
        rows, rb = draw(st.integers(1, 4)), draw(st.integers(1, 24))
        ss = rb + draw(st.sampled_from([0, 0, 3]))
        ds = rb + draw(st.sampled_from([0, 0, 5]))
        mode = draw(st.sampled_from(["new", "both", "both", "src_only", "dst_only"])) if out else "new"
        if mode != "new":
            # continue the previous transfer on both sides, or on one side only
            p = out[-1]
            st_, sb, dt, db = p[0], p[1], p[4], p[5]
            so = p[2] + (p[8] - 1) * p[3] + p[9]
            do = p[6] + (p[8] - 1) * p[7] + p[9]
            assert do == cursor[(dt, db)]
            if mode == "src_only":
                do += draw(st.integers(1, 9))
            elif mode == "dst_only":
                so += draw(st.sampled_from([-p[9], 1, 5]))
                so = max(so, 0)
        else:
            st_, sb = draw(st.integers(0, 3)), draw(st.sampled_from(["s0", "s1"]))
            dt, db = draw(st.integers(0, 3)), draw(st.sampled_from(["d0", "d1"]))
            so = draw(st.integers(0, 200))
            do = cursor[(dt, db)] + draw(st.sampled_from([0, 0, 7]))
        out.append([st_, sb, so, ss, dt, db, do, ds, rows, rb])
        cursor[(dt, db)] = do + (rows - 1) * ds + rb
    return draw(st.permutations(out))


def _apply(transfers, mem):
    mem = {k: v.copy() for k, v in mem.items()}
    for s_t, sb, so, ss, d_t, db, do, ds, rows, rb in transfers:
        for r in range(rows):
            mem[(d_t, db)][do + r * ds:do + r * ds + rb] = mem[(s_t, sb)][so + r * ss:so + r * ss + rb]
    return mem


@FAST
@given(gather_st(), st.integers(0, 2 ** 32 - 1))
def test_coalesce_preserves_the_byte_mapping(transfers, seed):
    rng = np.random.default_rng(seed)
    mem = {(t, b): rng.integers(0, 256, 4096, dtype=np.uint8) for t in range(4) for b in ("s0", "s1")}
    mem.update({(t, b): np.zeros(4096, np.uint8) for t in range(4) for b in ("d0", "d1")})
    original = copy.deepcopy(transfers)
    merged = exchange.coalesce(transfers)
    assert transfers == original                    # the input is not modified
    assert len(merged) <= len(transfers)
    assert sum(t[8] * t[9] for t in merged) == sum(t[8] * t[9] for t in transfers)
    a, b = _apply(transfers, mem), _apply(merged, mem)
    for k in mem:
        np.testing.assert_array_equal(a[k], b[k], err_msg=str(k))
    assert exchange.coalesce(merged) == merged        # idempotent


def test_coalesce_merges_continuations():
    t = [[0, "a", 0, 8, 1, "b", 0, 8, 2, 8], [0, "a", 16, 8, 1, "b", 16, 8, 1, 8]]
    assert exchange.coalesce(t) == [[0, "a", 0, 24, 1, "b", 0, 24, 1, 24]]
    strided = [[0, "a", 0, 10, 1, "b", 0, 8, 2, 8]]
    assert exchange.coalesce(strided) == strided


# cost --------------------------------------------------------------------------------------------
def _single_matmul(g, op):
    sub = ir.Graph()
    ids = []
    for i in op.inputs:
        v = g.values[i]
        vid = sub.value(v.name, v.shape, v.dtype, v.scale_exp)
        (sub.constants if i in g.constants else sub.inputs).append(vid)
        ids.append(vid)
    sub.outputs = [sub.add("matmul", ids, name=op.name, **op.attrs)]
    return sub


def _pow2(n):
    return n & (n - 1) == 0


def test_more_tiles_never_slow_a_matmul_down(vit_graph):
    matmuls = [op for op in vit_graph.ops if op.type == "matmul"]
    assert len(matmuls) == 6
    for op in matmuls:
        sub = _single_matmul(vit_graph, op)
        plans = registry().get("matmul").plans(sub, sub.ops[0], 64)
        assert plans
        cost = []
        for i, p in enumerate(plans):
            prog = build_program(sub, {"ops": {"0": {"plan": i, "offset": 0}}}, 64)
            slowest = [max(step_compute(s, MACHINE, prog["kernels"]).values()) for s in prog["steps"]]
            assert len(slowest) == (1 if p["k"] == 1 else 2)
            cost.append((p, slowest))
        for p, cp in cost:
            for q, cq in cost:
                tp, tq = p["m"] * p["n"] * p["k"], q["m"] * q["n"] * q["k"]
                # same K split, more tiles on power-of-two grids (nested splits): each tile's
                # block is no larger
                if q["k"] == p["k"] and tq > tp and all(_pow2(x[d]) for x in (p, q) for d in "mn"):
                    assert sum(cq) <= sum(cp), (op.name, p, cp, q, cq)
                # a plan that splits every dimension at least as much: the matmul stage is no slower
                if q["m"] >= p["m"] and q["n"] >= p["n"] and q["k"] >= p["k"]:
                    assert cq[0] <= cp[0], (op.name, p, cp, q, cq)


def test_program_cost_sums_steps(vit_graph, vit_program):
    horizons = []
    for step in vit_program["steps"]:
        horizons.append(exchange.schedule_phase(step["transfers"], MACHINE)["horizon"] if len(step["transfers"]) else 0)
    cost = program_cost(vit_program, horizons, MACHINE)
    sync = MACHINE["exchange"]["sync_cycles"]
    kernels = registry().kernels
    total, slowest_all = 0, []
    for step, h in zip(vit_program["steps"], horizons):
        per_tile = {t: sum(kernels[k].cycles([a if isinstance(a, int) else 0 for a in args], MACHINE)
                           for k, args in verts) for t, verts in vertices_of(vit_program, step).items()}
        slowest = max(per_tile.values(), default=0)
        slowest_all.append(slowest)
        total += h + slowest + sync
    assert len(cost["steps"]) == len(vit_program["steps"]) >= len(vit_graph.ops)
    assert cost["final_cycles"] == total
    assert cost["final_exchange"] == sum(horizons)
    assert [s["compute"] for s in cost["steps"]] == slowest_all
    assert [s["exchange"] for s in cost["steps"]] == horizons
    assert all(s["sync"] == sync for s in cost["steps"])
    assert 0 < cost["lower_bound"] <= cost["final_cycles"]


def test_vit_plans_and_program_shape(vit_graph, vit_program):
    plans = plans_of(vit_graph, 64)
    assert set(plans) == {op.id for op in vit_graph.ops}
    assert all(plans[op.id] for op in vit_graph.ops)
    step_ops = [s["op"] for s in vit_program["steps"]]
    assert step_ops == sorted(step_ops) and set(step_ops) == {op.id for op in vit_graph.ops}
    for op in vit_graph.ops:      # one step per stage of the operation's default plan
        impl = registry().get(op.type)
        stages = len(impl.lower(vit_graph, op, impl.plans(vit_graph, op, 64)[0]).stages)
        assert step_ops.count(op.id) == stages, op.name
    names = {o["name"] for o in vit_program["outputs"]}
    assert names == {"features", "logits"}
    # every graph output element is covered exactly once by the output ranges
    for o in vit_program["outputs"]:
        v = vit_graph.values[o["value"]]
        count = np.zeros((v.rows, v.cols), int)
        for _tile, _bid, r0, r1, c0, c1 in o["ranges"]:
            count[r0:r1, c0:c1] += 1
        assert np.all(count == 1)


def test_peak_bound_is_the_graphs_work_at_peak_rate(vit_graph, vit_program):
    from ipubuild.compiler.planning.cost import peak_bound
    g = ir.Graph()
    a = g.input("a", (100, 64))
    y = g.add("matmul", [a, g.constant("w", (64, 30))])
    g.outputs = [g.add("gelu", [y])]
    prog = build_program(g, default_layout(g, 16), 16)
    c = MACHINE["compute"]
    work = 100 * 64 * 30 / c["amp_macs_per_cycle"]["f32"] + 100 * 30 / c["vector_flops_per_cycle"]
    assert peak_bound(prog, MACHINE) == int(np.ceil(work / 16)) + MACHINE["exchange"]["sync_cycles"]
    # whatever the layout, the program-independent bound stays put and below the program's
    cost = program_cost(vit_program, [0] * len(vit_program["steps"]), MACHINE)
    other = build_program(vit_graph, {"ops": {str(op.id): {"plan": min(1, len(plans_of(vit_graph, 64)[op.id]) - 1),
                                                           "offset": 5} for op in vit_graph.ops}}, 64)
    assert peak_bound(other, MACHINE) == cost["peak_bound"] <= cost["lower_bound"]


def test_provisional_code_bounds_the_scheduled_exchange_tables(vit_graph):
    from ipubuild.compiler.placement import initial_layout
    from ipubuild.search import SearchContext, heuristics
    layout = initial_layout(SearchContext(vit_graph, 64, MACHINE), heuristics())
    program = build_program(vit_graph, layout, 64)
    none = {k: 0 for k in registry().kernels}
    bound = phases.provisional_code_bytes(program, none)
    entries = defaultdict(list)
    for s, step in enumerate(program["steps"]):
        if len(step["transfers"]):
            for t in exchange.scheduled(exchange.schedule_phase(step["transfers"], MACHINE)).lists():
                entries[str(t[0])].append([s, t[0], 0, t[3], t[4], 0, t[7], t[8], t[9],
                                           *[x for d in zip(t[10::4], t[12::4], t[13::4]) for x in (d[0], 0, d[2])]])
    broadcast = 0
    per_step = [vertices_of(program, step) for step in program["steps"]]
    for tile in buffers_of(program):
        table = len(codegen.encode_exchange(entries.get(tile, [])))
        kernels = phases.kernels_per_tile(program)[tile]
        steps = [[s, [[kernels.index(k), [0] * len(a)] for k, a in verts[tile]]] for s, verts in enumerate(per_step)
                 if tile in verts]
        code = table + len(codegen.encode_program(kernels, steps))
        assert bound[tile] >= code, tile
        broadcast += any(len(e) > 9 for e in entries.get(tile, []))
    assert broadcast       # the bound is met with broadcasts in the tables


def test_provisional_code_of_a_changed_step_is_its_own_not_the_memoised_one(vit_program):
    """The per-step tables are memoised by the transfers' bytes: a step whose transfers change
    (same count, other sources) is costed afresh."""
    none = {k: 0 for k in registry().kernels}
    warm = phases.provisional_code_bytes(vit_program, none)
    s = max(range(len(vit_program["steps"])), key=lambda i: len(vit_program["steps"][i]["transfers"]))
    changed = dict(vit_program, steps=list(vit_program["steps"]))
    t = vit_program["steps"][s]["transfers"].copy()
    t[:, 0] = (t[:, 0] + 1) % vit_program["tile_count"]           # every transfer from the next tile
    changed["steps"][s] = dict(changed["steps"][s], transfers=t)
    got = phases.provisional_code_bytes(changed, none)
    phases._step_tables.clear()
    assert got == phases.provisional_code_bytes(changed, none) != warm
    assert phases.provisional_code_bytes(vit_program, none) == warm


def _merge_adjacent_lists(entries):
    """The list form ``exchange.merge_adjacent`` had: the reference its arrays are checked against."""
    def dests(e):
        return [tuple(e[3:6]), *zip(e[8::3], e[9::3], e[10::3])]
    out = []
    for e in entries:
        if out:
            p = out[-1]
            pd, ed = dests(p), dests(e)
            if p[0] == e[0] and p[6] == 1 and e[6] == 1 and p[1] + p[7] == e[1] and len(pd) == len(ed) \
                    and all(a[0] == b[0] and a[1] + p[7] == b[1] for a, b in zip(pd, ed)):
                p[7] += e[7]
                p[2] = p[5] = p[7]
                p[10::3] = [p[7]] * len(p[10::3])
                continue
        out.append(list(e))
    return out


@st.composite
def placed_entries_st(draw):
    """Placed entries as a schedule leaves them: runs of single rows that continue one another
    on every side, broken by a change of tile, of row count, of destinations or of address."""
    out, addr = [], 0
    for _ in range(draw(st.integers(1, 30))):
        rb = draw(st.sampled_from([4, 8]))
        src = draw(st.integers(0, 2))
        dests = draw(st.lists(st.integers(0, 3), min_size=1, max_size=3, unique=True))
        rows = draw(st.sampled_from([1, 1, 1, 2]))
        if draw(st.booleans()):
            addr += draw(st.sampled_from([4, 8, 12]))
        e = [src, 1000 + addr, rb, dests[0], 2000 + addr, rb, rows, rb]
        for d in dests[1:]:
            e.extend([d, 3000 + 100 * d + addr, rb])
        out.append(e)
        addr += rb
    return out


@FAST
@given(placed_entries_st())
def test_merging_placed_entries_over_arrays_is_the_list_merge(entries):
    merged = exchange.merge_adjacent(exchange.placed_entries(entries))
    assert merged.entry_lists() == _merge_adjacent_lists([list(e) for e in entries])


def test_resolving_a_schedule_places_every_buffer_at_its_address():
    sched = exchange.schedule_phase([[0, "o1", 8, 16, 1, "g2", 0, 16, 2, 16], [0, "o1", 8, 16, 2, "g3", 4, 16, 2, 16],
                                     [1, "o10", 0, 8, 1, "g2", 32, 8, 1, 8]], MACHINE)
    from ipubuild.graph.placement import Placement
    addresses = {"0": {"o1": 100}, "1": {"g2": 200, "o10": 300}, "2": {"g3": 400}}
    by_number = np.full(11, -1)
    for table in addresses.values():
        for bid, addr in table.items():
            by_number[int(bid[1:])] = addr
    want = []
    for t in exchange.scheduled(sched).lists():
        e = [t[0], addresses[str(t[0])][t[1]] + t[2], t[3], t[4], addresses[str(t[4])][t[5]] + t[6], t[7], t[8], t[9]]
        for d, b, o, s in zip(t[10::4], t[11::4], t[12::4], t[13::4]):
            e.extend([d, addresses[str(d)][b] + o, s])
        want.append(e)
    assert exchange.resolve(exchange.scheduled(sched), Placement({"tiles": {}, "addresses": by_number})).entry_lists() == want
    assert any(len(e) > 8 for e in want)           # a broadcast among them
    by_number[10] = -1                              # o10 not placed
    with pytest.raises(KeyError):
        exchange.resolve(exchange.scheduled(sched), Placement({"tiles": {}, "addresses": by_number}))


def test_a_grids_estimate_counts_what_is_folded_into_the_matmul(vit_graph):
    """``gridplan.grid_cost`` of vit_fp8's fc1 (a GELU folded in) and fc2 (an addend) exceeds
    that of the same product without them by a cycle an element of the kernel that writes the
    result at the least (the GELU's compute; the addend's 4 bytes received at 4 a cycle), on
    every grid, split-K or not."""
    from ipubuild.compiler.gridplan import grid_cost
    ops = {op.name: op for op in vit_graph.ops}
    fc1, fc2 = ops["block0.fc1"], ops["block0.fc2"]
    assert fc1.attrs.get("activation") == "gelu" and fc2.attrs.get("addend")
    for op in (fc1, fc2):
        plain = copy.deepcopy(op)
        for k in ("activation", "addend", "to", "scale_exp"):
            plain.attrs.pop(k, None)
        plans = [p for p in registry().get("matmul").plans(vit_graph, op, 64) if p["k"] in (1, 4)]
        assert {p["k"] for p in plans} == {1, 4}
        m_, n_ = vit_graph.values[op.outputs[0]].shape
        for p in plans:
            rows, cols = -(-m_ // p["m"]), -(-n_ // p["n"])
            written = (rows if p["k"] == 1 else -(-rows // p["k"])) * cols
            more = grid_cost(vit_graph, op, p, MACHINE)[0] - grid_cost(vit_graph, plain, p, MACHINE)[0]
            assert more >= written, (op.name, p, more, written)


def test_a_matmul_also_offers_grids_whose_column_blocks_are_whole_32_column_blocks(vit_graph):
    """After its own grids (in their order: the initial placement spreads its tries over them),
    a matmul offers, marked ``aligned``, the grids of the same rows and K-slices whose column
    count cuts N into whole 32-column blocks: for the fused QKV (576 columns, heads of 64) 18
    and 9 blocks, which the powers of two miss with a K split."""
    from ipubuild.graph.operators import aligned_counts
    qkv = next(op for op in vit_graph.ops if op.name == "block0.qkv")
    plans = registry().get("matmul").plans(vit_graph, qkv, 64)
    own = [p for p in plans if not p.get("aligned")]
    extra = [p for p in plans if p.get("aligned")]
    assert plans == own + extra and extra
    assert aligned_counts(576, 64) == [1, 2, 3, 6, 9, 18]
    grids = {(p["m"], p["n"], p["k"]) for p in plans}
    for m, k in {(p["m"], p["k"]) for p in own}:
        assert {n for n in aligned_counts(576, 64) if m * n * k <= 64} <= {n for mm, n, kk in grids if (mm, kk) == (m, k)}
    assert {(p["m"], p["n"], p["k"]) for p in extra}.isdisjoint({(p["m"], p["n"], p["k"]) for p in own})
    assert (1, 18, 2) in grids and (1, 18, 2) not in {(p["m"], p["n"], p["k"]) for p in own}


def test_aligned_variants_keep_about_as_many_tiles():
    """A grid goes to the aligned column counts nearest its own, with its own rows and with the
    rows that keep rows × columns nearest below and above: ViT-B/16's QKV (2304 columns) on
    2 × 64 × 8 to 4 × 36 × 8 (whole heads of 64 columns on 1152 tiles), not only to 2 × 36 × 8
    (on 576)."""
    from ipubuild.compiler.gridplan import aligned_variants
    plans = [{"m": m, "n": n, "k": 8} for m in (1, 2, 4, 8) for n in (16, 36, 64, 72) if m * n * 8 <= 1472]
    grid = lambda i: (plans[i]["m"], plans[i]["n"], plans[i]["k"])  # noqa: E731
    base = plans.index({"m": 2, "n": 64, "k": 8})
    found = {grid(i) for i in aligned_variants(plans, [base], 2304)}
    assert found == {(2, 36, 8), (4, 36, 8), (1, 72, 8), (2, 72, 8)}, found


def test_neighbour_grids_trade_one_count_for_another():
    """One trade from 2 × 46 × 16: twice the rows for half the columns (4 × 23 × 16, the
    nearest such grid, not 8 × 11 × 16), twice the columns or rows for half the K-slices; the
    third count kept, aligned grids and other plans left out, and only where such a grid exists."""
    from ipubuild.compiler.gridplan import neighbour_grids
    plans = [{"m": 2, "n": 46, "k": 16}, {"m": 4, "n": 23, "k": 16}, {"m": 4, "n": 24, "k": 16, "aligned": True},
             {"m": 2, "n": 92, "k": 8}, {"m": 8, "n": 11, "k": 16}, {"m": 4, "n": 46, "k": 8}, {"rows": 3},
             {"m": 3, "n": 46, "k": 8}, {"m": 1, "n": 46, "k": 32}]
    assert neighbour_grids(plans, 0) == [1, 3, 5, 8]
    assert neighbour_grids(plans, 6) == []
    assert neighbour_grids(plans, 2) == []          # no other aligned grid


def test_head_aligned_qkv_blocks_cut_the_attention_scores_exchange(vit_graph):
    """The attention scores read each head's K columns of the fused QKV: from 36-column blocks a
    head's 64 columns cross a block edge, so every row is a transfer of its own (a setup each);
    from 32-column blocks each block's rows go in one transfer. The estimator, pinned to the
    exact cost model, sees it (the scores' own plan unchanged)."""
    from ipubuild.compiler.gridplan import aligned_variants
    from ipubuild.search import SearchContext
    sc = SearchContext(vit_graph, 64, MACHINE)
    ops = {op.name: op for op in vit_graph.ops}
    qkv, scores = ops["block0.qkv"], ops["block0.scores"]
    plans = sc.plans[qkv.id]
    base = plans.index({"m": 2, "n": 16, "k": 1})
    (aligned,) = [i for i in aligned_variants(plans, [base], 576) if (plans[i]["m"], plans[i]["n"]) == (2, 18)]
    terms = []
    for p in (base, aligned):
        layout = default_layout(vit_graph, 64)
        layout["ops"][str(qkv.id)]["plan"] = p
        layout["ops"][str(scores.id)]["plan"] = 0
        terms.append(sc.estimator.term(scores, layout).cycles)
    setup = MACHINE["exchange"]["transfer_setup_cycles"]
    assert terms[0] - terms[1] >= setup * 100, terms
