"""The profile report: the page is a content-addressed artifact, byte-identical for the same
inputs, self-contained, carrying the charts' data; the search's convergence is an artifact of its
own (the same after a resume); ``doit profile:<target>`` prints the top steps or one error line;
and the page loads and draws in a real headless browser (skipped without chromium)."""
from __future__ import annotations

import json
import re
import shutil
import struct
import subprocess
import zlib
from pathlib import Path

import numpy as np
import pytest

from ipubuild.graph.program_buffers import buffer_table, buffers_of
from ipubuild.engine import canonical
from ipubuild.build.build import all_steps
from ipubuild.errors import UserError
from ipubuild.build.pipeline import Workspace
from ipubuild.ui.report import KINDS, _runs, describe_plan, heatmap, plan_tiles, read_profile, report_data, \
    top_steps_table
from ipubuild.ui.report_page import render
from ipubuild.search import read_state
from ipubuild.targets import load_target

from buildtree import assert_passed, doit, make_tree, snapshot

NAME = "small"


# --- a built small target ---------------------------------------------------------------------

@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """A small tree built by ``doit build:small`` (with a snapshot of ipubuild/)."""
    environ = snapshot(tmp_path_factory.mktemp("code"))
    tree = make_tree(tmp_path_factory.mktemp("tree"))
    run = doit(tree, f"build:{NAME}", environ=environ)
    assert_passed(run, NAME)
    return tree, environ


def _art(ws: Workspace, name: str):
    return ws.engine.decoded(ws.read_ref(f"{NAME}/{name}"))


def _page(tree: Path) -> str:
    return (tree / "artifacts" / NAME / f"{NAME}.profile.html").read_text(encoding="utf-8")


def _data(page: str) -> dict:
    m = re.search(r'<script type="application/json" id="report-data">(.*?)</script>', page, re.S)
    assert m, "the page embeds no data"
    return json.loads(m.group(1))


def _step(tree: Path, task: str, monkeypatch):
    """The build's step ``task``, configured as doit configures it (target path relative to the tree)."""
    monkeypatch.chdir(tree)
    target = load_target(f"targets/{NAME}.toml", root=tree)
    return next(s for s in all_steps(target, tree) if s.task == task)


def test_the_page_is_the_phase_output_and_byte_identical_when_rerun(built, monkeypatch):
    tree, _ = built
    ws = Workspace.at(tree)
    page = (tree / "artifacts" / NAME / f"{NAME}.profile.html").read_bytes()
    assert canonical.digest(page) == ws.read_ref(f"{NAME}/report")
    step = _step(tree, "report_profile", monkeypatch)
    again = ws.engine.run(step.phase, {s: ws.read_ref(a) for s, a in step.inputs.items()}, step.config, force=True)
    assert again.outputs["report"] == ws.read_ref(f"{NAME}/report")
    assert render(_data(page.decode())).encode() == page


def test_the_page_carries_the_charts_data(built):
    tree, _ = built
    ws = Workspace.at(tree)
    page = _page(tree)
    d = _data(page)
    profile, cost, program = _art(ws, "profile"), _art(ws, "cost"), _art(ws, "program")
    storage, sizes = _art(ws, "storage"), _art(ws, "code_sizes")
    # header
    assert d["target"] == NAME and d["final_cycles"] == cost["final_cycles"] == profile["total_cycles"]
    assert d["lower_bound"] == cost["lower_bound"] and d["tiles"] == 1472 and d["tile_count"] == 16
    for figure in (f"{cost['final_cycles']:,}", f"{cost['lower_bound']:,}", "16 planned", "1472"):
        assert figure in page, figure
    # steps
    steps = profile["steps"]
    assert d["steps"] == {"names": [s["name"] for s in steps], "exchange": [s["exchange"] for s in steps],
                          "compute": [s["slowest"] for s in steps], "sync": [s["sync"] for s in steps]}
    # heatmap: 16 tiles, one row each, one column per step
    h = d["heatmap"]
    assert h["tiles_per_row"] == 1 and h["steps_per_column"] == 1
    tiles = [r[0] for r in h["rows"]]
    assert h["values"] == [steps[s]["compute"].get(str(t), 0) for t in tiles for s in range(len(steps))]
    # memory maps: every used tile, runs covering its SRAM; code and constants add up
    m = d["memory"]
    assert [t["tile"] for t in m["tiles"]] == sorted(int(t) for t in buffers_of(program))
    for t in m["tiles"]:
        runs = t["runs"]
        assert sum(runs[1::2]) == m["end"] - m["base"]
        by = {k: sum(n for kind, n in zip(runs[::2], runs[1::2]) if KINDS[kind] == k) for k in KINDS}
        tile = str(t["tile"])
        assert by["code"] == storage["tiles"][tile]["code_bytes"] == sizes[tile]["total"]
        assert by["constants"] == sum(-(-b["size"] // 8) * 8 for bid, b in buffers_of(program)[tile].items()
                                      if bid.startswith("c"))
        assert by["data"] + by["shared"] > 0 and by["free"] > 0
    # the search's convergence is its artifact
    assert d["search"] == _art(ws, "search")
    # exchanges: bytes per step from the program's transfers, largest first
    x = d["exchanges"]
    assert x["bytes_per_step"] == [sum(t[8] * t[9] for t in s["transfers"].tolist()) for s in program["steps"]]
    sizes_top = [e["bytes"] for e in x["top"]]
    assert sizes_top == sorted(sizes_top, reverse=True) and sizes_top[0] > 0
    assert x["steps"][0]["bytes"] == max(x["bytes_per_step"])
    # plans: a row per operation of the planned graph, in its order; a matmul's is its tile grid
    graph, layout = _art(ws, "plan_graph"), _art(ws, "layout")
    assert [r[0] for r in d["plans"]] == [op[2] for op in graph["ops"]]
    grids = [r for r in d["plans"] if r[1] == "matmul"]
    assert grids and '<table id="plan-table">' in page
    for name, _, plan, tiles, first in grids:
        m, n, k = map(int, re.fullmatch(r"(\d+) × (\d+) × (\d+) grid \(rows × columns × K-slices.*\)", plan).groups())
        op_id = next(op[0] for op in graph["ops"] if op[2] == name)
        assert tiles == m * n * k <= 16 and first == layout["ops"][str(op_id)]["offset"]
        assert f"<td>{name}</td><td>matmul</td><td>{plan}</td>" in page
    # kernels: the measured kernel profile, a row per variant with its estimate and its count
    kernels = _art(ws, "kernel_profile")
    assert d["kernels"] == kernels and kernels["kernels"] and not kernels["notes"]
    table = page[page.index('<table id="kernel-table">'):]
    for name, k in kernels["kernels"].items():
        assert k["blocks"] > 0 and k["calls"] > 0
        assert f"<td>{name}</td><td class=num>{k['calls']:,}</td><td class=num>{k['estimated_cycles']:,}</td>" in table
        assert f"<td class=num>{k['blocks']:,}</td>" in table


def test_the_page_is_self_contained(built):
    page = _page(built[0])
    assert not re.search(r"https?:", page, re.I)
    # the one reference: the optional marks of what moved since the previous build, beside the page
    # (written when a build finishes; the page works without it)
    assert re.findall(r"\b(?:src|href)\s*=\s*\S+", page, re.I) == [f'src="{NAME}.changes.js"></script>']
    assert "@import" not in page and "url(" not in page


def test_the_search_artifact_is_its_history_and_survives_a_resume(built, monkeypatch, capfd):
    tree, _ = built
    ws = Workspace.at(tree)
    search = _art(ws, "search")
    state = read_state(tree / ".ipubuild" / "search" / f"{NAME}.state.json")
    assert search["history"] == state["history"] and search["history"], "the small target's search improves"
    assert search["initial_cycles"] == search["history"][0]["before"]
    assert search["history"][-1]["after"] == _art(ws, "cost")["final_cycles"]
    assert all(h["after"] < h["before"] for h in search["history"])
    # re-running the phase resumes from the saved state: the same layout and the same summary
    step = _step(tree, "plan_package", monkeypatch)
    capfd.readouterr()
    again = ws.engine.run(step.phase, {s: ws.read_ref(a) for s, a in step.inputs.items()}, step.config, force=True)
    err = capfd.readouterr().err
    assert re.search(r"validated search incumbent .*resuming=true", err), err[-2000:]
    assert again.outputs == {"layout": ws.read_ref(f"{NAME}/layout"), "search": ws.read_ref(f"{NAME}/search")}


def test_noop_build_does_not_touch_the_page_and_a_deleted_page_comes_back(built):
    tree, environ = built
    path = tree / "artifacts" / NAME / f"{NAME}.profile.html"
    before = path.stat().st_mtime_ns, path.read_bytes()
    run = doit(tree, f"build:{NAME}", environ=environ)
    assert_passed(run, NAME)
    assert run.executed == [], run.tail()
    assert (path.stat().st_mtime_ns, path.read_bytes()) == before
    path.unlink()
    run = doit(tree, f"build:{NAME}", environ=environ)
    assert_passed(run, NAME)
    assert path.read_bytes() == before[1]
    assert set(run.executed) <= {f"build:{NAME}", f"report_profile:{NAME}"}, run.tail()
    # a change the report does not read (a numerics gate) re-checks the numbers, not the page
    target = tree / "targets" / f"{NAME}.toml"
    target.write_text(target.read_text() + "[numerics]\nmin_cosine = 0.98\n")
    mtime = path.stat().st_mtime_ns
    run = doit(tree, f"build:{NAME}", environ=environ)
    assert_passed(run, NAME)
    assert f"check_numerics:{NAME}" in run.executed and f"report_profile:{NAME}" not in run.executed, run.tail()
    assert path.stat().st_mtime_ns == mtime


def test_doit_profile_prints_the_top_steps(built):
    tree, environ = built
    run = doit(tree, f"profile:{NAME}", environ=environ)
    assert run.returncode == 0, run.tail()
    profile = json.loads((tree / "artifacts" / NAME / f"{NAME}.profile.json").read_bytes())
    lines = [ln for ln in run.stdout.splitlines() if not ln.startswith(".  ")]
    top = top_steps_table(profile)
    assert lines[:len(top)] == top and lines[len(top)] == ""
    assert lines[0].split() == ["step", "exchange", "compute", "sync", "total", "share"]
    # then the kernel table: the build's figures per kernel variant, and host time measured now
    kernels = json.loads((tree / "artifacts" / NAME / f"{NAME}.kernels.json").read_bytes())["kernels"]
    table = lines[len(top) + 1:]
    assert table[0].split()[:5] == ["kernel", "calls", "estimated", "cycles", "basic"], table
    rows = {ln.split()[0]: ln.split() for ln in table[1:1 + len(kernels)]}
    assert sorted(rows) == sorted(kernels)
    for name, k in kernels.items():
        assert rows[name][1:4] == [str(k["calls"]), f"{k['estimated_cycles']:,}", f"{k['blocks']:,}"], rows[name]
        assert rows[name][-1] == "µs" and float(rows[name][-2]) > 0, rows[name]
    notes = [i for i, ln in enumerate(table) if ln.startswith("host time: this machine")]
    assert notes and table[notes[0] + 1] == "", table
    # last, what moved since the previous build (none kept after one build)
    assert table[notes[0] + 2:] == ["changes since the previous build: none kept yet (one earlier profile is kept "
                                    "once a build rewrites it)"], table


def test_doit_profile_of_an_unbuilt_target_is_one_line(tmp_path, built):
    _, environ = built
    tree = make_tree(tmp_path)
    run = doit(tree, f"profile:{NAME}", environ=environ)
    assert run.returncode != 0 and "Traceback" not in run.output, run.tail()
    assert run.error_lines == [f"error: artifacts/{NAME}/{NAME}.profile.json: no profile yet; "
                               f"run `doit build:{NAME}` first"], run.tail()


# --- the pieces, on made-up inputs ---------------------------------------------------------------

def _profile(steps):
    return {"total_cycles": sum(x + c + y for _, x, c, y in steps), "tiles": 4,
            "steps": [{"name": n, "exchange": x, "slowest": c, "sync": y, "compute": {"0": c}} for n, x, c, y in steps]}


def test_top_steps_table_orders_by_total_with_shares():
    lines = top_steps_table(_profile([("a", 10, 20, 5), ("b", 100, 40, 5), ("c", 0, 60, 5)]), top=2)
    assert [ln.split()[:2] for ln in lines[1:3]] == [["1", "b"], ["2", "c"]]
    assert lines[1].split()[2:] == ["100", "40", "5", "145", "59.2", "%"]
    assert lines[-1] == "top 2 of 3 steps: 85.7 % of 245 cycles"


@pytest.mark.parametrize("plan, says, tiles", [
    ({"m": 2, "n": 36, "k": 4}, "2 × 36 × 4 grid (rows × columns × K-slices)", 288),
    ({"rows": 61, "cols": 2, "tiles": 1464}, "61 × 2 grid a head (rows × columns)", 1464),
    ({"rows": 122, "tiles": 1464}, "rows 122, tiles 1464", 1464),
    ({"rows": 64}, "64 row blocks", 64),
])
def test_the_plan_table_names_each_kind_of_plan_and_its_tiles(plan, says, tiles):
    assert describe_plan(plan) == says and plan_tiles(plan) == tiles


@pytest.mark.parametrize("content, says", [
    (None, "no profile yet; run `doit build:t` first"),
    (b"{not json", "not a readable profile (JSONDecodeError)"),
    (b'{"steps": [{"name": "a", "exchange": "1", "slowest": 2, "sync": 3}]}', "holds no per-step figures"),
    (b'{"ok": true, "tiles": 1472, "samples": 0, "total_cycles": 5}', "holds no per-step figures"),
    (b"[1, 2]", "holds no per-step figures"),
    (b"\xff\xfe", "not a readable profile"),
])
def test_a_missing_or_bad_profile_is_one_line(tmp_path, content, says):
    path = tmp_path / "t.profile.json"
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(UserError) as exc:
        read_profile(path, "t", shown="artifacts/t/t.profile.json")
    assert str(exc.value).startswith("artifacts/t/t.profile.json: " + says) and "\n" not in str(exc.value)


def test_heatmap_groups_many_tiles_by_their_slowest():
    steps = [{"name": f"s{s}", "exchange": 0, "slowest": 0, "sync": 0,
              "compute": {str(t): (t * 7 + s * 13) % 101 + 1 for t in range(0, 600, 2)}} for s in range(3)]
    h = heatmap(steps)
    assert h["tiles"] == 300 and h["tiles_per_row"] == 3 and len(h["rows"]) == 100
    assert h["rows"][0] == [0, 4] and h["rows"][-1] == [594, 598]
    for r, (lo, hi) in enumerate(h["rows"]):
        for s in range(3):
            want = max(v for t, v in steps[s]["compute"].items() if lo <= int(t) <= hi)
            assert h["values"][r * 3 + s] == want
    assert "a group of 3 consecutive computing tiles" in render(_fake_data(h))


def test_a_device_reporting_only_totals_gets_the_cost_models_steps():
    """The backend contract asks a profile only for ok, tiles, samples and total_cycles."""
    cost = {"final_cycles": 1300, "final_exchange": 100, "lower_bound": 900,
            "steps": [{"name": "a", "exchange": 100, "compute": 300, "sync": 600}, {"name": "b", "exchange": 0,
                                                                                  "compute": 300, "sync": 0}]}
    program = {"tile_count": 2, "names": {}, "buffers": buffer_table([], [], 2),
               "steps": [{"name": "a", "transfers": []}, {"name": "b", "transfers": []}]}
    storage = {"tiles": {t: {"code_bytes": 0, "ranges": {}} for t in ("0", "1")}, "addresses": [-1]}
    machine = {"clock_hz": 1_000_000_000, "memory": {"sram_base": 0, "sram_end": 64, "alignment": 8}}
    d = report_data("t", "hw", {"ok": True, "tiles": 2, "samples": 0, "total_cycles": 1300}, cost, program,
                    storage, {}, machine, {"initial_cycles": 1300, "history": []})
    assert d["steps_from"] == "cost model" and d["steps"]["compute"] == [300, 300] and d["heatmap"]["tiles"] == 0
    page = render(d)
    assert "The device (hw) reported only totals" in page and "no compute cycles per tile" in page


def test_memory_runs_cover_the_range_and_mark_shared_bytes():
    k = {n: i for i, n in enumerate(KINDS)}
    runs = _runs([(0, 16, k["reserved"]), (16, 48, k["code"]), (64, 96, k["data"]), (80, 112, k["exchange"]),
                  (200, 300, k["constants"])], 0, 256)
    assert runs == [k["reserved"], 16, k["code"], 32, k["free"], 16, k["data"], 16, k["shared"], 16,
                    k["exchange"], 16, k["free"], 88, k["constants"], 56]


def test_names_cannot_break_out_of_the_embedded_data():
    d = _fake_data(heatmap([{"name": "x", "compute": {"0": 1}}]))
    d["steps"]["names"] = ["</script><script>alert(1)</script><!--"]
    d["exchanges"]["top"] = [{"step": 0, "name": "</script>", "from": 0, "to": 1, "value": "<b>v</b>", "bytes": 4}]
    page = render(d)
    assert page.count("<script") == 4 and page.count("</script>") == 4     # data, the marks, the two scripts
    assert _data(page) == d
    assert "&lt;b&gt;v&lt;/b&gt;" in page


def _fake_data(h: dict) -> dict:
    n = len(h["columns"])
    return {"target": "t", "final_cycles": 10, "lower_bound": 5, "final_exchange": 2, "device_cycles": 10,
            "device": "ipumodel", "tiles": 1472, "tile_count": 4, "tiles_used": 2, "clock_hz": 1_850_000_000,
            "steps_from": "device",
            "steps": {"names": [f"s{i}" for i in range(n)], "exchange": [1] * n, "compute": [1] * n, "sync": [1] * n},
            "heatmap": h, "memory": {"base": 0, "end": 16, "kinds": list(KINDS), "tiles": []},
            "search": {"initial_cycles": 10, "history": []},
            "exchanges": {"total_bytes": 0, "bytes_per_step": [0] * n, "count": 0, "steps": [], "top": []},
            "kernels": {"kernels": {}, "notes": [], "measure": ""}, "plans": []}


# --- in a real browser ---------------------------------------------------------------------------

def _chromium() -> str:
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if not found:
        pytest.skip("chromium is not installed (Debian: apt-get install chromium); the browser tests need it")
    return found


def _browse(tmp_path: Path, page: Path, *flags: str) -> subprocess.CompletedProcess:
    """Load ``page`` in headless chromium (its own profile, console messages on stderr)."""
    cmd = [_chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
           "--no-first-run", "--enable-logging=stderr", "--v=0", f"--user-data-dir={tmp_path / 'profile'}",
           *flags, page.as_uri()]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)


def _console(stderr: str) -> list[str]:
    return [ln for ln in stderr.splitlines() if ":CONSOLE" in ln]


def test_the_page_loads_without_console_messages_and_draws_the_step_chart(tmp_path, built):
    _chromium()
    # the method can see a broken page: its uncaught error reaches the console
    probe = tmp_path / "probe.html"
    probe.write_text("<!DOCTYPE html><html><body><script>undefinedFunction();</script></body></html>")
    seen = _console(_browse(tmp_path, probe, "--dump-dom").stderr)
    assert any("undefinedFunction" in ln for ln in seen), "chromium did not report a page's console"

    page = built[0] / "artifacts" / NAME / f"{NAME}.profile.html"
    run = _browse(tmp_path, page, "--dump-dom")
    assert run.returncode == 0, run.stderr[-3000:]
    assert _console(run.stderr) == [], _console(run.stderr)   # the page logs nothing: any message is a fault
    dom = run.stdout
    assert re.search(r'<body[^>]*data-rendered="true"', dom), "the page's script did not finish"
    chart = re.search(r'<div id="step-chart" class="chart"><svg.*?</svg></div>', dom, re.S)
    assert chart, "no step chart"
    steps = len(_data(page.read_text(encoding="utf-8"))["steps"]["names"])
    assert chart.group(0).count('<g class="bar">') == steps
    assert chart.group(0).count('class="x"') == chart.group(0).count('class="c"') == steps
    assert re.search(r'<canvas id="memory-canvas" width="\d{4}" height="\d{3,}"', dom)
    assert '<div id="search-chart" class="chart"><svg' in dom


def _png(data: bytes) -> np.ndarray:
    """The RGB pixels of an 8-bit, non-interlaced PNG (what chromium writes)."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    pos, idat, ihdr = 8, [], None
    while pos < len(data):
        n, kind = struct.unpack(">I4s", data[pos:pos + 8])
        if kind == b"IHDR":
            ihdr = struct.unpack(">IIBBBBB", data[pos + 8:pos + 8 + n])
        elif kind == b"IDAT":
            idat.append(data[pos + 8:pos + 8 + n])
        pos += 12 + n
    w, h, depth, ctype, _, _, interlace = ihdr
    assert depth == 8 and interlace == 0 and ctype in (2, 6), ihdr
    bpp, raw = (3 if ctype == 2 else 4), zlib.decompress(b"".join(idat))
    stride = w * bpp
    prev, rows = bytearray(stride), []
    for y in range(h):
        f, cur = raw[y * (stride + 1)], bytearray(raw[y * (stride + 1) + 1:(y + 1) * (stride + 1)])
        if f == 1:
            for x in range(bpp, stride):
                cur[x] = (cur[x] + cur[x - bpp]) & 255
        elif f == 2:
            cur = bytearray((a + b) & 255 for a, b in zip(cur, prev))
        elif f in (3, 4):
            for x in range(stride):
                a, b = (cur[x - bpp] if x >= bpp else 0), prev[x]
                if f == 3:
                    cur[x] = (cur[x] + ((a + b) >> 1)) & 255
                    continue
                c = prev[x - bpp] if x >= bpp else 0
                pa, pb, pc = abs(b - c), abs(a - c), abs(a + b - 2 * c)
                cur[x] = (cur[x] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 255
        rows.append(bytes(cur))
        prev = cur
    return np.frombuffer(b"".join(rows), np.uint8).reshape(h, w, bpp)[:, :, :3]


def _pixels_near(px: np.ndarray, rgb: str, tolerance: int = 6) -> int:
    want = np.array([int(rgb[i:i + 2], 16) for i in (1, 3, 5)])
    return int((np.abs(px.astype(int) - want).max(axis=2) <= tolerance).sum())


def test_screenshot_shows_the_header_and_the_step_chart(tmp_path, built):
    page = built[0] / "artifacts" / NAME / f"{NAME}.profile.html"
    shot = tmp_path / "report.png"
    run = _browse(tmp_path, page, "--hide-scrollbars", "--window-size=1000,620", f"--screenshot={shot}")
    assert run.returncode == 0 and shot.exists(), run.stderr[-3000:]
    px = _png(shot.read_bytes())
    assert px.shape[:2] == (620, 1000)
    assert _pixels_near(px, "#1d2330") > 1000 * 60        # the header band
    assert _pixels_near(px, "#e8833a") > 2000             # exchange bars
    assert _pixels_near(px, "#3b75af") > 2000             # compute bars


def test_unique_rows_are_numpys_unique_rows():
    """The report packs rows into one number to find the distinct ones: the same rows, order and
    inverse as np.unique(axis=0), also where the fields do not fit a number."""
    from ipubuild.ui.report import _unique_rows
    rng = np.random.default_rng(5)
    for high in (4, 1500, 2 ** 40):
        a = rng.integers(0, high, size=(3000, 3), dtype=np.int64)
        rows, inverse = _unique_rows(a)
        want_rows, want_inverse = np.unique(a, axis=0, return_inverse=True)
        assert np.array_equal(rows, want_rows) and np.array_equal(inverse, want_inverse.ravel())
