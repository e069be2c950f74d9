"""Storage placement's first fit in C (``planning.storage_native``) places every buffer where the
Python loop (``storage._allocate_python``) does: on random tiles, and on every tile of a real
program; and a buffer that fits nowhere is still reported by the Python loop's message."""
from __future__ import annotations

import random

import numpy as np
import pytest

from ipubuild.graph.program_buffers import ProgramBuffers, buffer_table, buffers_of
from ipubuild.compiler.planning import storage, storage_native
from ipubuild.engine.errors import UserError

pytestmark = pytest.mark.skipif(storage_native.library() is None, reason="no C compiler")

RANGES = [[4096, 20000], [24576, 60000]]


def _buffers(rnd: random.Random, n: int) -> dict:
    out = {}
    for i in range(n):
        start = rnd.randrange(0, 12)
        out[f"{rnd.choice('cgio')}{i}"] = {"size": rnd.choice([1, 7, 64, 100, 512, 2048, 4000]),
                                           "start": start, "end": start + rnd.randrange(0, 5)}
    return out


@pytest.mark.parametrize("seed", range(40))
def test_first_fit_in_c_places_as_the_python_loop(seed):
    rnd = random.Random(seed)
    bufs = _buffers(rnd, rnd.randrange(1, 120))
    align = rnd.choice([4, 8, 64])
    try:
        want = storage._allocate_python(bufs, RANGES, align, 0, None)
    except UserError as exc:
        with pytest.raises(UserError) as got:
            storage.allocate(bufs, RANGES, align, tile=0)
        assert str(got.value) == str(exc)
        return
    assert storage.allocate(bufs, RANGES, align, tile=0) == want


def test_a_real_programs_tiles_are_placed_as_the_python_loop():
    from ipubuild import frontend, plugins, targets
    from ipubuild.compiler.machine import load_machine
    from ipubuild.compiler.planning.program import build_program, default_layout
    from pathlib import Path
    root = Path(__file__).resolve().parent.parent
    t = targets.load_target(str(root / "targets" / "vit_fp8.toml"))
    graph = frontend.build_model(plugins.get_plugin_manager(), t).graph
    program = build_program(graph, default_layout(graph, 64), 64)
    m = load_machine("ipu21")
    ranges = storage.tile_ranges(m, 30000)["available_ranges"]
    checked = 0
    for tile, bufs in buffers_of(program).items():
        if bufs:
            align = m["memory"]["alignment"]
            assert storage.allocate(bufs, ranges, align, tile=int(tile)) == \
                storage._allocate_python(bufs, ranges, align, int(tile), None), tile
            checked += 1
    assert checked >= 16


def test_headroom_is_the_largest_free_top_of_a_tiles_ranges():
    placed = {"tiles": {"0": {"ranges": {"available_ranges": [[0, 1000], [2000, 5000]]}},
                        "1": {"ranges": {"available_ranges": [[0, 1000], [2000, 2600]]}}},
              "addresses": [-1, 0, 100, 2000]}         # buffers o1, o2 and c3, by number
    buffers = ProgramBuffers(buffer_table([[0, "o", 100, 0, "v1", 0, 1, 0, 100], [0, "o", 50, 0, "v1", 1, 2, 0, 50],
                                           [0, "c", 2900, 0, "v2", 0, 1, 0, 2900]], [1, 1, 1], 2))
    # tile 0: [0, 1000) used up to 156 (b's 50 bytes from 100 take 56), free from 160 (aligned);
    # [2000, 5000) up to 4904: the smaller range has the larger free top
    assert storage.headroom(placed, buffers, 8) == [1000 - 160, 1000]


def test_a_tile_renumbered_upstream_is_placed_from_the_memo_as_afresh():
    """``allocate_rows`` remembers a tile's placement by its buffers' sizes and lifetimes in
    placement order: the same tile with its buffers numbered later in the program (an operation
    upstream made more buffers) is a hit, and every answer, hit or not, is what first fit gives
    (numbered in another order, equal buffers are placed in another order)."""
    from ipubuild.graph.artifacts import buffer_codes
    rnd = random.Random(41)
    hits = 0
    for _ in range(60):
        bufs = _buffers(rnd, rnd.randrange(1, 80))
        numbers = sorted(rnd.sample(range(10 ** 5, 5 * 10 ** 5), len(bufs)))
        rows = np.array([[0, 0, b["size"], b["start"], b["end"], 0] for b in bufs.values()], dtype=np.int64)
        for shift, order in ((0, 1), (rnd.randrange(1, 5 * 10 ** 5), 1), (0, -1)):     # -1: numbered backwards
            rows[:, 1] = buffer_codes([f"o{n + shift}" for n in numbers[::order]])
            before = len(storage._memo)
            try:
                got = storage.allocate_rows(rows, RANGES, 8, tile=0)
            except UserError:
                break
            hits += len(storage._memo) == before
            codes, size, start, end = rows[:, [1, 2, 3, 4]].T
            assert got.tolist() == storage._place(None, codes, size, start, end, RANGES, 8, 0, None).tolist()
    assert hits >= 30
