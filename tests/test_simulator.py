"""The ipumodel simulator on small hand-made packages with real kernels: host calls, exchange,
vertices, the profile, failing vertices and corrupt bindings."""
from __future__ import annotations

import gc
import shutil

import numpy as np
import pytest

from ipubuild import __version__, canonical
from ipubuild.builtin.simulator import Simulator
from ipubuild.errors import UserError
from ipubuild.kernels import KERNEL_DIR, compile_kernel, compiler
from ipubuild.machine import load_machine
from ipubuild.operators import registry
from ipubuild.package import FORMAT_VERSION, write_package
from ipubuild.planning import codegen, exchange
from ipubuild.planning.storage import tile_ranges

pytestmark = pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler")

MACHINE = load_machine("ipu21")
MEM = MACHINE["memory"]
CODE = tile_ranges(MACHINE, 0)["code_address"]
DATA = 393216
KERNELS = {"add_f32": ("add.c", []), "copy": ("copy.c", [])}


@pytest.fixture(scope="module")
def objects():
    cc, cflags = compiler()
    header = (KERNEL_DIR / "ipu_kernel.h").read_bytes()
    return {name: compile_kernel(name, src, (KERNEL_DIR / src).read_bytes(), {"ipu_kernel.h": header},
                                 defines, cc, cflags, src)[0]
            for name, (src, defines) in KERNELS.items()}


def package(objects, programs: dict, exchange_entries: list, outputs: list, data: dict, tiles=4) -> bytes:
    """A package: ``programs[tile] = [[step, [[kernel, args], ...]], ...]`` (tiles without a program
    are idle), every tile's exchange entries, output bindings and initial data by tile."""
    images, kernels = {}, {}
    for tile, steps in programs.items():
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
                            "steps": [f"step{s}" for s in range(n_steps)], "paired": [False] * n_steps,
                            "inputs": [], "outputs": outputs})
    members = {f"images/{canonical.digest(i)}.img": i for i in [*images.values(), idle]}
    members.update({f"kernels/{k}.so": objects[k] for k in kernels}, **{"host/program.json": host})
    manifest = {
        "format": FORMAT_VERSION, "compiler": __version__, "target": "synthetic", "tiles": tiles,
        "used_tiles": tiles, "idle_image": canonical.digest(idle),
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
    pkg = package(objects, programs, entries, [out("sum", 8, 0, DATA + 512), out("twice", 4, 3, DATA)],
                  {0: {f"b@{DATA}": b}, 2: {f"a@{DATA}": a}, 3: {f"c@{DATA}": np.ones(4, np.float32)}})
    run = Simulator().run(pkg, {}, tmp_path)
    np.testing.assert_array_equal(run.outputs["sum"], a + b)
    np.testing.assert_array_equal(run.outputs["twice"], np.full(4, 2, np.float32))
    assert gc.isenabled()
    reg, x = registry(), MACHINE["exchange"]
    add = reg.kernels["add_f32"].cycles([DATA + 64, DATA, DATA + 64, 1, 8, 1], MACHINE)
    cp = reg.kernels["copy"].cycles([DATA + 64, DATA + 512, 1, 32, 32, 32], MACHINE)
    horizon = exchange.horizon_of([e[1:] for e in entries], MACHINE, False)
    add3 = reg.kernels["add_f32"].cycles([DATA, DATA, DATA, 1, 4, 1], MACHINE)
    p = run.profile
    assert p["ok"] and p["tiles_used"] == 3
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
