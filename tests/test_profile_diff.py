"""What changed since the previous build: the kept profile, the diff's lines and the page's marks."""
from __future__ import annotations

import json

from ipubuild.compiler.planning import exchange
from ipubuild.graph.program_buffers import buffer_table
from ipubuild.ui import profile_diff
from ipubuild.ui.report import top_exchanges


def _profile(cycles):
    return {"total_cycles": sum(cycles), "samples": 3, "tiles_used": 2,
            "steps": [{"name": f"s{i}", "exchange": 0, "slowest": c, "sync": 0} for i, c in enumerate(cycles)]}


def _kernels(blocks):
    return {"kernels": {name: {"calls": 2, "estimated_cycles": 10, "blocks": b} for name, b in blocks.items()}}


def test_the_diff_names_what_moved_with_its_delta(tmp_path):
    out = tmp_path / "artifacts" / "t"
    out.mkdir(parents=True)
    for name, value in (("t.profile.previous.json", _profile([10, 20, 30])), ("t.profile.json", _profile([10, 25, 30])),
                        ("t.kernels.previous.json", _kernels({"gelu": 2270925, "old": 1})),
                        ("t.kernels.json", _kernels({"gelu": 2270926, "new": 1}))):
        (out / name).write_text(json.dumps(value))
    lines = profile_diff.changes(tmp_path, "t")
    assert lines == ["changes since the previous build:",
                     "  total_cycles: 60 → 65 (+5) (+8.33 %)",
                     "  step 1 s1: 20 → 25 (+5) (+25.00 %) cycles",
                     "  kernel gelu blocks: 2,270,925 → 2,270,926 (+1) (+0.00 %)",
                     "  kernel new: new", "  kernel old: gone"]
    marks = profile_diff.marks(profile_diff.of_target(tmp_path, "t"))
    assert marks == {"steps": {"1": 5}, "kernels": {"gelu": {"blocks": [2270925, 2270926]}},
                     "figures": {"total_cycles": [60, 65]}}


def test_without_an_earlier_profile_it_says_so(tmp_path):
    assert "none kept yet" in profile_diff.changes(tmp_path, "t")[0]
    assert profile_diff.marks(None) == {"steps": {}, "kernels": {}, "figures": {}}


def test_a_rewritten_profile_keeps_the_one_it_replaces(tmp_path):
    from ipubuild.build.pipeline import Workspace
    ws = Workspace.at(tmp_path)
    try:
        path = tmp_path / "artifacts" / "t" / "t.profile.json"
        path.parent.mkdir(parents=True)
        path.write_bytes(b"old")
        assert ws.restore(path, ws.engine.put(b"new"))
        assert path.read_bytes() == b"new" and (path.parent / "t.profile.previous.json").read_bytes() == b"old"
        other = path.parent / "t.verdict.json"                  # other files keep no earlier copy
        other.write_bytes(b"a")
        ws.restore(other, ws.engine.put(b"b"))
        assert sorted(p.name for p in path.parent.iterdir()) == ["t.profile.json", "t.profile.previous.json",
                                                                 "t.verdict.json"]
    finally:
        ws.close()


def test_the_largest_exchanges_are_between_tiles():
    program = {"names": {"a": "x.out"}, "buffers": buffer_table([[0, "o", 6400, 0, "a", 0, 100, 0, 64],     # o1
                                                     [1, "o", 16, 0, "b", 0, 1, 0, 16]], [0, 0], 2),
               "steps": [{"name": "x", "transfers": exchange.transfer_array(
                   [[0, "o1", 0, 0, 0, "o1", 0, 0, 100, 64],      # on-tile copy
                    [0, "o1", 0, 0, 1, "o2", 0, 0, 1, 16]])}]}
    x = top_exchanges(program)
    assert [(e["from"], e["to"], e["value"]) for e in x["top"]] == [(0, 1, "x.out")]
    assert x["total_bytes"] == 100 * 64 + 16
