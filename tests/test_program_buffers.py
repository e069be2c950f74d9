"""A program's buffers as one int32 table (``graph/program_buffers.py``): what the planner, the
storage placement and the report read, without a Python object per buffer."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from ipubuild import frontend, plugins, targets
from ipubuild.compiler.planning.program import build_program, default_layout, program_blob, vertices_of
from ipubuild.graph.artifacts import (BUFFER_KINDS, buffer_codes, buffer_codes_of, buffer_numbers, code_ranks,
                                      from_plan_blob)
from ipubuild.graph.program_buffers import COLUMNS, buffer_table, buffers_of

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def program():
    t = targets.load_target(str(ROOT / "targets" / "vit_fp8.toml"))
    graph = frontend.build_model(plugins.get_plugin_manager(), t).graph
    return build_program(graph, default_layout(graph, 64), 64)


def test_buffer_codes_of_kinds_and_numbers_are_the_codes_of_their_names():
    rng = np.random.default_rng(0)
    numbers = np.concatenate([np.arange(12), rng.integers(0, 10 ** 8, 2000), 10 ** np.arange(8), 10 ** np.arange(1, 9) - 1])
    kinds = rng.integers(0, len(BUFFER_KINDS), len(numbers))
    names = [f"{BUFFER_KINDS[k]}{n}" for k, n in zip(kinds.tolist(), numbers.tolist())]
    assert buffer_codes_of(kinds, numbers).tolist() == buffer_codes(names).tolist()
    with pytest.raises(ValueError, match="10\\*\\*8"):
        buffer_codes_of(np.zeros(1, np.int64), np.array([10 ** 8]))


def test_a_buffers_number_is_read_back_from_its_code():
    rng = np.random.default_rng(3)
    numbers = np.concatenate([rng.integers(0, 10 ** 8, 5000), 10 ** np.arange(8), 10 ** np.arange(1, 9) - 1, [0]])
    kinds = rng.integers(0, len(BUFFER_KINDS), len(numbers))
    assert buffer_numbers(buffer_codes_of(kinds, numbers)).tolist() == numbers.tolist()


@pytest.mark.parametrize("dtype", [np.int32, np.int64])
def test_code_ranks_are_numpys_unique_and_inverse(dtype):
    """The exchange renumbering ranks a step's buffer codes without sorting them all: the same
    distinct codes, in order, and the same places as np.unique's, for int32 transfers and int64;
    codes of buffers too far apart for its table, codes that are no buffer's (negative, past the
    last kind), and none too."""
    rng = np.random.default_rng(5)
    numbers = np.concatenate([rng.integers(0, 10 ** 8, 300), rng.integers(1, 3000, 300), 10 ** np.arange(8)])
    codes = buffer_codes_of(rng.integers(0, len(BUFFER_KINDS), len(numbers)), numbers)
    near = codes[300:600]                   # numbers below 3000: ranked by the table
    for sample in (near[rng.integers(0, len(near), 20000)], codes[rng.integers(0, len(codes), 20000)],
                   codes[:1], np.array([-1, 5, 5, 2]),
                   np.array([len(BUFFER_KINDS) * 11 ** 8, 7]), np.zeros(0, np.int64)):
        sample = sample.astype(dtype)
        got, expected = code_ranks(sample), np.unique(sample, return_inverse=True)
        assert got[0].dtype == sample.dtype and got[0].tolist() == expected[0].tolist()
        assert got[1].tolist() == expected[1].tolist()


def test_every_buffer_a_program_names_is_a_row_of_its_tile(program):
    buffers = buffers_of(program)
    assert list(buffers) == [str(t) for t in range(64)] and len(buffers) == 64
    named = set()
    for step in program["steps"]:
        for tile, verts in vertices_of(program, step).items():
            named.update((tile, a[1]) for _, args in verts for a in args if isinstance(a, list))
        t = np.asarray(step["transfers"]).reshape(-1, 10)
        for tile, code in {*map(tuple, t[:, [0, 1]].tolist()), *map(tuple, t[:, [4, 5]].tolist())}:
            named.add((str(tile), buffers.names(tile)[int(np.searchsorted(buffers.rows(tile)[:, 1], code))]))
    assert named and all(bid in buffers[tile] for tile, bid in named)
    for tile in buffers:
        names = buffers.names(tile)
        assert names == sorted(names) and list(buffers[tile]) == names


def test_records_say_what_each_kind_of_buffer_holds(program):
    buffers, steps = buffers_of(program), len(program["steps"])
    seen = set()
    for tile in buffers:
        for bid, rec in buffers[tile].items():
            kind, seen = bid[0], seen | {bid[0]}
            assert rec == buffers.record(tile, bid)
            assert 0 <= rec["start"] <= rec["end"] <= steps and rec["size"] > 0
            if kind in "ci":
                block = rec["init" if kind == "c" else "input"]
                assert block[0] == rec["value"] and block[1] < block[2] and block[3] < block[4]
                assert kind == "i" or rec["end"] == steps          # constants live through every run
            elif kind == "o":
                assert set(rec) == {"size", "start", "end", "value", "block"}
            else:
                assert set(rec) == {"size", "start", "end", "value"}
    assert seen == set("cgio")
    for out in program["outputs"]:
        for tile, bid, *_ in out["ranges"]:
            assert buffers.record(tile, bid)["end"] == steps      # outputs live until the host reads them
    with pytest.raises(KeyError):
        buffers.record(0, "o999999")
    with pytest.raises(KeyError):
        buffers["64"]


def test_a_buffer_lives_through_every_step_that_reads_or_sends_it(program):
    buffers = buffers_of(program)
    used = []                                              # (tile, buffer, step)
    for s, step in enumerate(program["steps"]):
        for tile, verts in vertices_of(program, step).items():
            used += [(tile, a[1], s) for _, args in verts for a in args if isinstance(a, list)]
        t = np.asarray(step["transfers"]).reshape(-1, 10)
        for tile, code in set(map(tuple, t[:, [0, 1]].tolist())):
            used.append((str(tile), buffers.names(tile)[int(np.searchsorted(buffers.rows(tile)[:, 1], code))], s))
    assert any(bid[0] == "o" for _, bid, _ in used) and any(bid[0] == "g" for _, bid, _ in used)
    for tile, bid, s in used:
        rec = buffers.record(tile, bid)
        assert rec["start"] <= s <= rec["end"], (tile, bid, s, rec)


def test_the_program_artifact_carries_its_buffers_as_one_array(program):
    decoded = from_plan_blob(bytes(program_blob(program)))
    table = decoded["buffers"]["table"]
    assert isinstance(table, np.ndarray) and table.dtype == np.int32 and table.shape[1] == len(COLUMNS)
    assert not table.flags.owndata                   # a view of the blob: no copy, no object per buffer
    assert np.array_equal(table, program["buffers"]["table"])
    assert dict(buffers_of(decoded)) == dict(buffers_of(program))


def test_a_table_too_large_for_int32_is_refused():
    with pytest.raises(ValueError, match="int32"):
        buffer_table([[0, "o", 2 ** 31, 0, "v1", 0, 1, 0, 1]], [0], 1)


def test_the_values_of_many_buffers_are_their_records_values(program):
    buffers = buffers_of(program)
    t = buffers.table
    pick = np.random.default_rng(3).choice(len(t), 500, replace=False)
    got = buffers.values_of(t[pick, 0], t[pick, 1])
    names = buffers_of(program).names
    want = [buffers.record(int(tile), names(int(tile))[int(np.searchsorted(buffers.rows(int(tile))[:, 1], code))])["value"]
            for tile, code in t[pick, :2].tolist()]
    assert got == want and len(set(got)) > 10
    with pytest.raises(KeyError):
        buffers.values_of([int(t[0, 0])], [int(t[:, 1].max()) + 1])
