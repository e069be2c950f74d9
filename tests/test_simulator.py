"""The ipumodel simulator on small hand-made packages with real kernels: host calls, exchange,
vertices, the profile, failing vertices and corrupt bindings."""
from __future__ import annotations

import gc
import shutil

import numpy as np
import pytest

from ipubuild import __version__
from ipubuild.engine import canonical
from ipubuild.builtin.simulator import Simulator
from ipubuild.errors import UserError
from ipubuild.compiler.kernels import KERNEL_DIR, compile_kernel, compiler
from ipubuild.compiler.machine import load_machine
from ipubuild.operators import registry
from ipubuild.package import FORMAT_VERSION, write_package
from ipubuild.compiler.planning import codegen, exchange
from ipubuild.compiler.planning.storage import tile_ranges

pytestmark = pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler")

MACHINE = load_machine("ipu21")
MEM = MACHINE["memory"]
CODE = tile_ranges(MACHINE, 0)["code_address"]
DATA = 393216
KERNELS = {"add_f32": ("add.c", []), "copy": ("copy.c", [])}


@pytest.fixture(params=["C", "python"], autouse=True)
def native_form(request, monkeypatch):
    """Every test runs with the simulator's and the reader's loops in C (vertex calls, exchange
    copies, checks and grouping, table reading) and in their Python forms (``$IPUBUILD_NATIVE=0``:
    vertices called through ctypes one at a time)."""
    from ipubuild.builtin import exchange_copy, vertex_runner
    from ipubuild.compiler.planning import codegen_native
    monkeypatch.setenv("IPUBUILD_NATIVE", "1" if request.param == "C" else "0")
    if request.param == "C" and None in (vertex_runner.library(), exchange_copy.library(), codegen_native.library()):
        pytest.fail("the simulator's loops do not compile here")
    return request.param


@pytest.fixture(scope="module")
def objects():
    cc, cflags = compiler()
    header = (KERNEL_DIR / "ipu_kernel.h").read_bytes()
    return {name: compile_kernel(name, src, (KERNEL_DIR / src).read_bytes(), {"ipu_kernel.h": header},
                                 defines, cc, cflags, src)[0]
            for name, (src, defines) in KERNELS.items()}


def package(objects, programs: dict, exchange_entries: list, outputs: list, data: dict, tiles=4,
            horizons=None) -> bytes:
    """A package: ``programs[tile] = [[step, [[kernel, args], ...]], ...]`` (a tile of the target
    without a program computes nothing; tiles past the last program's are idle), every tile's
    exchange entries, output bindings, initial data by tile and each step's exchange cycles
    (``horizons``, default 0)."""
    images, kernels = {}, {}
    used = 1 + max(programs)
    for tile, steps in ((t, programs.get(t, [])) for t in range(used)):
        names = sorted({k for _, verts in steps for k, _ in verts})
        prog = codegen.encode_program(names, [[s, [[names.index(k), a] for k, a in verts]] for s, verts in steps])
        xch = codegen.encode_exchange([e for e in exchange_entries if e[1] == tile])
        addr, slots = CODE, []
        for name in names:
            kernels[name] = canonical.digest(objects[name])
            slots.append([name, addr, 4096, kernels[name]])
            addr += 4096
        code = {"program": prog, "exchange": xch, "addresses": {"program": addr, "exchange": addr + len(prog)}}
        images[tile] = codegen.build_image(code, data.get(tile, {}), slots)
    idle = codegen.build_image({}, {}, [])
    n_steps = 1 + max(s for steps in programs.values() for s, _ in steps)
    host = canonical.dumps({"initialize": {"phases": 1}, "run": {"phases": n_steps},
                            "steps": [f"step{s}" for s in range(n_steps)], "paired": [False] * n_steps, "horizons": horizons or [0] * n_steps,
                            "inputs": [], "outputs": outputs})
    members = {f"images/{canonical.digest(i)}.img": i for i in [*images.values(), idle]}
    members.update({f"kernels/{k}.so": objects[k] for k in kernels}, **{"host/program.json": host})
    manifest = {
        "format": FORMAT_VERSION, "compiler": __version__, "target": "synthetic", "tiles": tiles,
        "used_tiles": used, "idle_image": canonical.digest(idle),
        "tile_images": [canonical.digest(images[t]) if t in images else canonical.digest(idle) for t in range(tiles)],
        "machine": {**MACHINE, "tiles": tiles, "sram_base": MEM["sram_base"], "sram_end": MEM["sram_end"],
                    "executable_end": MEM["executable_end"], "loader_limit": MEM["loader_limit"]},
        "kernels": kernels,
        "host": {"initialize": {"phases": 1}, "run": {"phases": n_steps}, "program": canonical.digest(host)},
        "inputs": [], "outputs": outputs}
    return write_package(manifest, members)


def out(name, n, tile, addr):
    return {"name": name, "dtype": "f32", "shape": [n], "scale_exp": 0, "ranges": [[0, 4 * n, tile, addr]]}


@pytest.mark.parametrize("threads", ["1", "3"])
def test_exchange_then_vertices_and_the_profile(objects, tmp_path, monkeypatch, threads):
    monkeypatch.setenv("IPUBUILD_DEVICE_LOCK_DIR", str(tmp_path))
    monkeypatch.setenv("IPUBUILD_SIMULATOR_THREADS", threads)
    a, b = np.arange(8, dtype=np.float32), np.full(8, 10, np.float32)
    # step 0: tile 2 sends a to tile 0 (rows of 16 bytes), tile 0 adds b in place;
    # step 1: tile 0 copies the sum to DATA + 512 on itself; tile 3 doubles its own data in step 0
    programs = {0: [[0, [["add_f32", [DATA + 64, DATA, DATA + 64, 1, 8, 1]]]],
                    [1, [["copy", [DATA + 64, DATA + 512, 1, 32, 32, 32]]]]],
                2: [[0, []]],
                3: [[0, [["add_f32", [DATA, DATA, DATA, 1, 4, 1]]]]]}
    entries = [[0, 2, DATA, 16, 0, DATA + 64, 16, 2, 16]]
    horizon = exchange.horizon_of([e[1:] for e in entries], MACHINE, False)
    pkg = package(objects, programs, entries, [out("sum", 8, 0, DATA + 512), out("twice", 4, 3, DATA)],
                  {0: {f"b@{DATA}": b}, 2: {f"a@{DATA}": a}, 3: {f"c@{DATA}": np.ones(4, np.float32)}},
                  horizons=[horizon, 0])
    run = Simulator().run(pkg, {}, tmp_path)
    np.testing.assert_array_equal(run.outputs["sum"], a + b)
    np.testing.assert_array_equal(run.outputs["twice"], np.full(4, 2, np.float32))
    assert gc.isenabled()
    reg, x = registry(), MACHINE["exchange"]
    add = reg.kernels["add_f32"].cycles([DATA + 64, DATA, DATA + 64, 1, 8, 1], MACHINE)
    cp = reg.kernels["copy"].cycles([DATA + 64, DATA + 512, 1, 32, 32, 32], MACHINE)
    add3 = reg.kernels["add_f32"].cycles([DATA, DATA, DATA, 1, 4, 1], MACHINE)
    p = run.profile
    assert p["ok"] and p["tiles_used"] == 4         # tile 1 of the target computes nothing but is loaded
    assert [s["compute"] for s in p["steps"]] == [{"0": add, "3": add3}, {"0": cp}]
    assert [s["exchange"] for s in p["steps"]] == [horizon, 0]
    assert p["total_cycles"] == horizon + max(add, add3) + cp + 2 * x["sync_cycles"]


def test_a_failing_vertex_is_reported(objects, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("IPUBUILD_DEVICE_LOCK_DIR", str(tmp_path))
    programs = {1: [[0, [["add_f32", [DATA, DATA, DATA, 4, 2, 3]]]]]}   # b_rows 3: neither 1 nor rows
    pkg = package(objects, programs, [], [out("x", 2, 1, DATA)], {1: {f"x@{DATA}": np.ones(8, np.float32)}})
    run = Simulator().run(pkg, {}, tmp_path)
    assert not run.profile["ok"]
    assert "vertex failed" in capsys.readouterr().err


def test_output_on_an_idle_tile_is_a_package_error(objects, tmp_path, monkeypatch):
    monkeypatch.setenv("IPUBUILD_DEVICE_LOCK_DIR", str(tmp_path))
    programs = {0: [[0, [["copy", [DATA, DATA + 64, 1, 16, 16, 16]]]]]}
    pkg = package(objects, programs, [], [out("y", 4, 3, DATA)], {0: {f"x@{DATA}": np.ones(4, np.float32)}})
    with pytest.raises(UserError, match="tile 3: that tile runs the idle image") as info:
        Simulator().run(pkg, {}, tmp_path)
    assert "\n" not in str(info.value)
    assert gc.isenabled()


@pytest.mark.parametrize("value", ["0", "two", "-1"])
def test_bad_thread_count_is_a_one_line_error(objects, tmp_path, monkeypatch, value):
    monkeypatch.setenv("IPUBUILD_DEVICE_LOCK_DIR", str(tmp_path))
    monkeypatch.setenv("IPUBUILD_SIMULATOR_THREADS", value)
    programs = {0: [[0, [["copy", [DATA, DATA + 64, 1, 16, 16, 16]]]]]}
    pkg = package(objects, programs, [], [out("y", 4, 0, DATA + 64)], {0: {f"x@{DATA}": np.ones(4, np.float32)}})
    with pytest.raises(UserError, match="IPUBUILD_SIMULATOR_THREADS: .* is not a positive whole number") as info:
        Simulator().run(pkg, {}, tmp_path)
    assert "\n" not in str(info.value)


# the checked build: preconditions, traps, exchanges outside data memory, read-back ---------------
@pytest.fixture(scope="module")
def checked(objects):
    """The kernels as ipubuild compiles them: the checked build."""
    cc, cflags = compiler()
    header = (KERNEL_DIR / "ipu_kernel.h").read_bytes()
    return {name: compile_kernel(name, src, (KERNEL_DIR / src).read_bytes(), {"ipu_kernel.h": header},
                                 [*defines, ("IPU_CHECKED", 1)], cc, cflags, src)[0]
            for name, (src, defines) in KERNELS.items()}


def test_a_checked_package_runs_as_the_unchecked_one(checked, objects, tmp_path, monkeypatch):
    monkeypatch.setenv("IPUBUILD_DEVICE_LOCK_DIR", str(tmp_path))
    programs = {0: [[0, [["add_f32", [DATA, DATA, DATA + 64, 2, 4, 1]]]],
                    [1, [["copy", [DATA + 64, DATA + 128, 2, 16, 16, 16]]]]]}
    data = {0: {f"x@{DATA}": np.arange(8, dtype=np.float32)}}
    outputs = [out("y", 8, 0, DATA + 128)]
    runs = [Simulator().run(package(objs, programs, [], outputs, data), {}, tmp_path) for objs in (checked, objects)]
    assert all(r.profile["ok"] and r.profile["failures"] == [] for r in runs)
    np.testing.assert_array_equal(runs[0].outputs["y"], runs[1].outputs["y"])


def test_a_vertex_refusing_a_buffer_outside_data_memory_names_tile_vertex_and_kernel(checked, tmp_path, monkeypatch):
    monkeypatch.setenv("IPUBUILD_DEVICE_LOCK_DIR", str(tmp_path))
    # tile 1's second vertex writes its sum over the tile's code (its kernels' reserved space)
    programs = {1: [[0, [["copy", [DATA, DATA + 64, 1, 16, 16, 16]], ["add_f32", [DATA, DATA, CODE, 1, 4, 1]]]]]}
    pkg = package(checked, programs, [], [out("x", 4, 1, DATA)], {1: {f"x@{DATA}": np.ones(4, np.float32)}})
    run = Simulator().run(pkg, {}, tmp_path)
    assert not run.profile["ok"] and run.profile["failure_count"] == 1
    f, = run.profile["failures"]
    assert {k: f[k] for k in ("kind", "step", "tile", "vertex", "kernel", "code")} == \
        {"kind": "vertex", "step": 0, "tile": 1, "vertex": 1, "kernel": "add_f32", "code": 3}
    assert f["reason"] == "c[rows*cols] lies outside the tile's data memory", f
    assert f["args"] == [DATA, DATA, CODE, 1, 4, 1]


@pytest.mark.parametrize("args,code,reason", [
    ([DATA + 2, DATA + 2, DATA + 2, 1, 4, 1], 4, "a[rows*cols] is not aligned to its element size"),
    ([MEM["sram_end"] - 8, DATA, DATA, 1, 4, 1], 3, "a[rows*cols] lies outside the tile's data memory"),
    ([DATA, DATA, DATA, 2, 4, 3], 1, "b_rows is neither 1 nor rows"),
])
def test_checked_vertices_say_why_they_fail(checked, tmp_path, monkeypatch, args, code, reason):
    monkeypatch.setenv("IPUBUILD_DEVICE_LOCK_DIR", str(tmp_path))
    pkg = package(checked, {0: [[0, [["add_f32", args]]]]}, [], [out("x", 4, 0, DATA)],
                  {0: {f"x@{DATA}": np.ones(16, np.float32)}})
    f, = Simulator().run(pkg, {}, tmp_path).profile["failures"]
    assert (f["code"], f["reason"]) == (code, reason)


def test_an_exchange_outside_data_memory_is_a_device_failure(checked, tmp_path, monkeypatch):
    monkeypatch.setenv("IPUBUILD_DEVICE_LOCK_DIR", str(tmp_path))
    # step 0: tile 2 sends 16 bytes into tile 0's code (its kernels' reserved space)
    programs = {0: [[0, [["add_f32", [DATA, DATA, DATA, 1, 4, 1]]]]], 2: [[0, []]]}
    entries = [[0, 2, DATA, 16, 0, CODE + 64, 16, 1, 16]]
    pkg = package(checked, programs, entries, [out("x", 4, 0, DATA)],
                  {0: {f"x@{DATA}": np.ones(4, np.float32)}, 2: {f"y@{DATA}": np.ones(4, np.float32)}})
    run = Simulator().run(pkg, {}, tmp_path)
    assert not run.profile["ok"]
    f, = run.profile["failures"]
    assert {k: f[k] for k in ("kind", "step", "tile", "from", "to")} == \
        {"kind": "exchange", "step": 0, "tile": 0, "from": 2, "to": 0}
    assert f["reason"] == (f"the exchange from tile 2 to tile 0 writes [{CODE + 64}, {CODE + 80}) "
                           "outside tile 0's data memory")


def test_probes_read_each_value_after_the_step_that_wrote_it(checked, tmp_path, monkeypatch):
    monkeypatch.setenv("IPUBUILD_DEVICE_LOCK_DIR", str(tmp_path))
    # step 0 doubles x in place; step 1 doubles it again: the probe of step 0 sees 2x, the output 4x
    programs = {0: [[0, [["add_f32", [DATA, DATA, DATA, 2, 4, 2]]]], [1, [["add_f32", [DATA, DATA, DATA, 2, 4, 2]]]]]}
    x = np.arange(8, dtype=np.float32).reshape(2, 4)
    pkg = package(checked, programs, [], [out("x", 8, 0, DATA)], {0: {f"x@{DATA}": x}})
    probe = {"name": "v1", "dtype": "f32", "shape": [2, 4], "blocks": [[0, DATA, 0, 1, 0, 4], [0, DATA + 16, 1, 2, 0, 4]]}
    run = Simulator().run(pkg, {}, tmp_path, probes={0: [probe]})
    np.testing.assert_array_equal(run.values["v1"], 2 * x)
    np.testing.assert_array_equal(run.outputs["x"], 4 * x.reshape(-1))


def test_the_device_lock_folder_is_made_or_named_in_one_line(tmp_path, monkeypatch):
    from ipubuild.device import device_ownership
    monkeypatch.setenv("IPUBUILD_DEVICE_LOCK_DIR", str(tmp_path / "not" / "yet"))
    with device_ownership("ipumodel") as path:
        assert path == tmp_path / "not" / "yet" / "ipubuild-ipumodel-device.lock" and path.exists()
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    monkeypatch.setenv("IPUBUILD_DEVICE_LOCK_DIR", str(blocked / "below"))
    with pytest.raises(UserError, match=r"^IPUBUILD_DEVICE_LOCK_DIR: cannot create the device's lock file .*"
                                        r"point it at a writable folder$"):
        with device_ownership("ipumodel"):
            pass


@pytest.mark.parametrize("events", [
    [],
    [{"name": "a", "ph": "X", "pid": 0, "tid": 1, "ts": 0.0, "dur": 5e-05, "args": {"cycles": 3}}],  # orjson: 0.00005
    [{"name": "tiny", "ts": 1e-07}, {"name": "huge", "ts": 1e16}],
    [{"name": "é"}, {"name": "del\x7f"}, {"name": "ctl\x1f\n"}],                                   # json escapes them
    [{"name": "x", "args": {"list": [1.5, 5e-05]}}, {"big": 2 ** 70}, {"none": None, "flag": True}],
])
def test_the_trace_artifact_is_the_canonical_json_of_its_document(events):
    """``trace_bytes`` (orjson where it writes what json does) gives ``canonical.dumps``'s bytes,
    on the simulator's kind of trace and on what orjson writes differently."""
    from ipubuild.device.device import trace_bytes
    rng = np.random.default_rng(5)
    events = events + [{"name": f"op{i % 7}", "ph": "X", "pid": 0, "tid": int(t), "ts": round(float(ts), 3),
                        "dur": round(float(d), 3), "args": {"cycles": int(c)}}
                       for i, (t, ts, d, c) in enumerate(zip(rng.integers(0, 1472, 2000), rng.uniform(0, 1e6, 2000),
                                                            rng.uniform(0, 10, 2000), rng.integers(0, 10**6, 2000)))]
    assert trace_bytes(events) == canonical.dumps({"traceEvents": events, "displayTimeUnit": "ns"})
