"""The exchange scheduler over arrays (``planning.exchange_native``, C loops) gives the schedules
the Python loops (``exchange.schedule_python``) give: same horizon, same order, on random phases
and on every phase of a real program, ordinary and paired, before and after storage placement."""
from __future__ import annotations

import itertools
import random
from pathlib import Path

import pytest

from ipubuild import frontend, plugins, targets
from ipubuild.compiler.machine import load_machine
from ipubuild.compiler.planning import exchange, exchange_native
from ipubuild.compiler.planning.program import build_program, default_layout

ROOT = Path(__file__).resolve().parents[1]
MACHINE = load_machine("ipu21")

pytestmark = pytest.mark.skipif(exchange_native.library() is None, reason="no C compiler")


def _random_phase(rng: random.Random) -> list[list]:
    tiles = rng.choice([1, 2, 3, 8, 32, 300])
    out = []
    for _ in range(rng.randint(1, 80)):
        rows = rng.randint(1, 6)
        rb = rng.choice([1, 4, 8, 64, 300, rng.randint(1, 5000)])
        t = [rng.randrange(tiles), rng.choice("st"), rng.randint(0, 3) * rb, rng.choice([rb, 2 * rb]),
             rng.randrange(tiles), rng.choice("de"), rng.randint(0, 2) * rb, rb, rows, rb]
        if rng.random() < 0.3 and t[0] != t[4]:
            for d in rng.sample(range(tiles), min(tiles, rng.randint(0, 4))):
                if d not in (t[0], t[4]):
                    t.extend([d, "d", 0, rb])
        out.append(t)
    if rng.random() < 0.2:                    # repeated transfers: ties broken by index
        out += [list(t) for t in rng.sample(out, min(len(out), 5))]
    return out


def test_random_phases_schedule_as_the_python_loops():
    rng = random.Random(26)
    earliest = 0
    for _ in range(1500):
        transfers = _random_phase(rng)
        for paired in (False, True):
            want = exchange.schedule_python(transfers, MACHINE, paired)
            assert exchange_native.schedule(transfers, MACHINE, paired) == want, (paired, transfers)
            tie = {i: r for r, i in enumerate(sorted(range(len(transfers)), key=lambda i: (transfers[i], i)))}
            largest = sorted(range(len(transfers)), key=lambda i: (-transfers[i][8] * transfers[i][9], tie[i]))
            earliest += want[1] != largest
    assert earliest > 100          # the earliest-start order was kept often enough to be compared


def test_real_program_phases_schedule_as_the_python_loops():
    t = targets.load_target(str(ROOT / "targets" / "vit_fp8.toml"))
    graph = frontend.build_model(plugins.get_plugin_manager(), t).graph
    program = build_program(graph, default_layout(graph, 64), 64)
    phases = 0
    for step in program["steps"]:
        if not len(step["transfers"]):
            continue
        phases += 1
        merged = exchange.coalesce(exchange.transfer_lists(step["transfers"]))
        for paired in (False, True):
            group = exchange.broadcasts(merged, paired)
            assert exchange_native.schedule(group, MACHINE, paired) == exchange.schedule_python(group, MACHINE, paired)
            # the planner's path: the program's arrays grouped and scheduled without lists
            arrays = exchange.broadcast_groups(exchange.coalesce_array(step["transfers"]), paired)
            assert arrays.lists() == group
            assert exchange_native.schedule_groups(arrays, MACHINE, paired) == exchange.schedule_python(group, MACHINE, paired)
            # placed entries' form (``horizon_of``): buffers become addresses
            placed = [[t[0], 0, 64 * i, t[3], t[4], 0, 64 * i, *t[7:]] for i, t in enumerate(group)]
            assert exchange_native.schedule(placed, MACHINE, paired) == exchange.schedule_python(placed, MACHINE, paired)
    assert phases > 5


def _same_schedule(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        (a[k] == b[k]).all() and a[k].dtype == b[k].dtype if hasattr(a[k], "dtype") else a[k] == b[k] for k in a)


def test_a_phase_schedules_the_same_whatever_its_buffers_numbers():
    """``schedule_provisional_exchanges`` schedules each phase with its buffers renumbered in
    order (so a step renumbered by a change upstream is reused): mapped back, that is the
    schedule of the phase as it is, on random phases with buffer numbers of every length and on
    the program's."""
    rng = random.Random(27)
    checked = 0
    for _ in range(400):
        phase = _random_phase(rng)
        names = {}
        for t in phase:                       # program-style names: numbers of 1 to 8 digits
            for i in [1, 5, *range(11, len(t), 4)]:
                digits = rng.randint(1, 8)
                t[i] = names.setdefault(t[i], rng.choice("cgio") + str(rng.randrange(10 ** (digits - 1), 10 ** digits)))
        transfers = exchange.transfer_array(phase)
        renamed, codes = exchange.renumbered(transfers)
        assert sorted(set(renamed[:, 1]) | set(renamed[:, 5])) != sorted(set(transfers[:, 1]) | set(transfers[:, 5]))
        want = exchange.schedule_phase(transfers, MACHINE)
        assert _same_schedule(exchange.restore_buffers(exchange.schedule_phase(renamed, MACHINE), codes), want)
        checked += 1
    t = targets.load_target(str(ROOT / "targets" / "vit_fp8.toml"))
    graph = frontend.build_model(plugins.get_plugin_manager(), t).graph
    program = build_program(graph, default_layout(graph, 64), 64)
    for step in program["steps"]:
        if len(step["transfers"]):
            renamed, codes = exchange.renumbered(step["transfers"])
            want = exchange.schedule_phase(step["transfers"], MACHINE)
            assert _same_schedule(exchange.restore_buffers(exchange.schedule_phase(renamed, MACHINE), codes), want)
            checked += 1
    assert checked > 410


def test_a_memoised_horizon_is_the_phase_schedules_whatever_its_addresses():
    """``exchange.horizon_of`` remembers horizons by the phase's shape (tiles, rows and row bytes
    in content order), not its addresses: a phase whose buffers all moved by the same amount is
    a hit, and every answer, hit or not, is the horizon of the phase scheduled afresh."""
    rng = random.Random(28)
    hits = 0
    for _ in range(300):
        group = exchange.broadcasts(_random_phase(rng), False)
        placed = [[t[0], 64 * i + t[2], t[3], t[4], 64 * i + 8 + t[6], *t[7:10],
                   *(x for d in range(10, len(t), 4) for x in (t[d], 64 * i + 16 + t[d + 2], t[d + 3]))]
                  for i, t in enumerate(group)]
        for moved in (0, rng.randrange(1, 4096) * 8, 0):
            entries = [[a + moved if k in (1, 4) or (k > 8 and k % 3 == 0) else a for k, a in enumerate(e)]
                       for e in placed]
            if moved == 0 and rng.random() < 0.5:                 # two addresses swapped: a new order
                i, j = rng.randrange(len(entries)), rng.randrange(len(entries))
                entries[i][1], entries[j][1] = entries[j][1], entries[i][1]
            for paired in (False, True):
                before = len(exchange._horizons)
                got = exchange.horizon_of(entries, MACHINE, paired)
                hits += len(exchange._horizons) == before
                as_lists = [[e[0], 0, e[1], e[2], e[3], 0, *e[4:8], *(x for d in zip(e[8::3], e[9::3], e[10::3])
                                                                     for x in (d[0], 0, d[1], d[2]))]
                            for e in entries]
                assert got == exchange.schedule_python(as_lists, MACHINE, paired)[0]
    assert hits > 300
    # five equal transfers whose horizon (44 or 66 cycles) depends on their order, which ties
    # break by source address: every order is the horizon of its own
    phase = [[1, 2], [1, 0], [0, 1], [0, 2], [2, 0]]
    horizons = set()
    for order in itertools.permutations(range(5)):
        entries = [[src, 64 * k, 64, dst, 0, 64, 1, 64] for (src, dst), k in zip(phase, order)]
        got = exchange.horizon_of(entries, MACHINE, False)
        assert got == exchange.schedule_python([[e[0], 0, e[1], 64, e[3], 0, 0, 64, 1, 64] for e in entries],
                                               MACHINE, False)[0]
        horizons.add(got)
    assert horizons == {44, 66}
