"""End to end: the build passes, the device profile equals the cost model, the simulator's
exchange copies exactly what the tables say, and the kernel developer's loop re-runs only what a
kernel edit touches."""
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from ipubuild.graph.program_buffers import buffers_of
from ipubuild.engine import canonical
from ipubuild.build.build import build_in_process
from ipubuild.builtin.simulator import run_exchange
from ipubuild.errors import UserError
from ipubuild.operators import registry
from ipubuild.build.pipeline import Workspace

from buildtree import SMALL, copy_ipubuild, make_tree

ROOT = Path(__file__).resolve().parent.parent
ONE_ROUND = SMALL.replace("rounds = 3", "rounds = 1")


def small_tree(root: Path, with_ipubuild=False, text=ONE_ROUND) -> Path:
    make_tree(root, {"small": text})
    if with_ipubuild:
        copy_ipubuild(root)
    return root


def doit(tree: Path, *args):
    env = dict(os.environ, PYTHONPATH=str(tree), IPUBUILD_CONSOLE="tasks", IPUBUILD_LOG="debug")
    p = subprocess.run([sys.executable, "-m", "doit", *args], cwd=tree, env=env, capture_output=True,
                       text=True, timeout=600)
    return p.returncode, p.stdout + p.stderr


def executed(log: str) -> list[str]:
    return sorted({line[3:] for line in log.splitlines() if line.startswith(".  ")})


def test_build_passes_and_profile_equals_cost_model(tmp_path, monkeypatch):
    tree = small_tree(tmp_path)
    monkeypatch.chdir(tree)
    out = build_in_process(tree, "targets/small.toml")
    ws = Workspace.at(tree)
    verdict = canonical.loads(ws.engine.fetch(out["small/verdict"]))
    cost = canonical.loads(ws.engine.fetch(out["small/cost"]))
    profile = canonical.loads(ws.engine.fetch(out["small/profile"]))
    assert verdict["pass"] and verdict["device_ok"]
    assert float(verdict["min_cosine"]) > 0.999
    assert profile["total_cycles"] == cost["final_cycles"]
    assert [s["exchange"] for s in profile["steps"]] == [s["exchange"] for s in cost["steps"]]
    assert [s["slowest"] for s in profile["steps"]] == [s["compute"] for s in cost["steps"]]
    assert profile["tiles"] == 1472
    assert (tree / "artifacts" / "small" / "small.ipuexe").stat().st_size > 0


def test_the_build_readies_the_device_on_a_thread_of_its_own_before_it_runs(tmp_path, monkeypatch):
    """A build's first phase starts the device's optional ``prepare()`` (the simulator compiles
    its C helpers there on a new machine) in the background, so that the device run does not
    wait for a compiler."""
    import threading

    from ipubuild.builtin.simulator import Simulator
    seen = []
    real_prepare, real_run = Simulator.prepare, Simulator.run

    def prepare(self):
        seen.append(("prepare", threading.current_thread().name))
        real_prepare(self)

    def run(self, *args, **kwargs):
        seen.append(("run", threading.current_thread().name))
        return real_run(self, *args, **kwargs)

    monkeypatch.setattr(Simulator, "prepare", prepare)
    monkeypatch.setattr(Simulator, "run", run)
    tree = small_tree(tmp_path)
    monkeypatch.chdir(tree)
    out = build_in_process(tree, "targets/small.toml")
    assert canonical.loads(Workspace.at(tree).engine.fetch(out["small/verdict"]))["pass"]
    assert [what for what, _ in seen] == ["prepare", "run"], seen
    assert seen[0][1].startswith("ipubuild-background") and seen[1][1] != seen[0][1]


@pytest.fixture(params=["C", "numpy"])
def exchange_form(request, monkeypatch):
    """Each exchange test runs on the simulator's C copier and on its numpy form."""
    from ipubuild.builtin import exchange_copy
    monkeypatch.setenv("IPUBUILD_NATIVE_SIM_EXCHANGE", "1" if request.param == "C" else "0")
    if request.param == "C" and exchange_copy.library() is None:
        pytest.fail("the simulator's exchange copier does not compile here")
    return request.param


def tile_memory(*rows):
    """The simulator's memory (one row per loaded tile) and its tile-to-row map (tile i on row i)."""
    return np.stack(rows), np.arange(len(rows))


def test_exchange_copies_exactly_what_the_tables_say(exchange_form):
    rng = np.random.default_rng(0)
    memory, row_of = tile_memory(*(rng.integers(0, 256, 4096, dtype=np.uint8) for _ in range(4)))
    before = memory.copy()
    entries = [[0, 100, 64, 1, 2000, 16, 5, 16],   # strided gather: 5 rows of 16 bytes
               [2, 0, 300, 2, 3000, 300, 1, 300],   # on-tile copy
               [3, 4000, 96, 0, 10, 40, 1, 40],     # unaligned: moved as bytes
               [1, 8, 24, 3, 64, 8, 3, 8],          # aligned rows: moved as 8-byte words
               [2, 3, 0, 3, 7, 0, 0, 5]]            # no rows: nothing
    run_exchange(memory, row_of, entries)
    want = before.copy()
    for st, sa, ss, dt, da, ds, rows, rb in entries:
        for r in range(rows):
            want[dt, da + r * ds:da + r * ds + rb] = before[st, sa + r * ss:sa + r * ss + rb]
    assert np.array_equal(memory, want)


def test_a_broadcast_copies_the_same_rows_to_every_destination(exchange_form):
    rng = np.random.default_rng(1)
    memory, row_of = tile_memory(*(rng.integers(0, 256, 4096, dtype=np.uint8) for _ in range(5)))
    before = memory.copy()
    # tile 0 sends 3 rows of 24 bytes (stride 40) once, to tiles 1, 2 and 4 at their own
    # addresses and strides; tile 3 sends a plain entry in the same phase
    run_exchange(memory, row_of, [[0, 100, 40, 1, 1000, 24, 3, 24, 2, 3000, 32, 4, 10, 64],
                                  [3, 0, 16, 0, 2000, 16, 1, 16]])
    want = before.copy()
    for dt, da, ds in [(1, 1000, 24), (2, 3000, 32), (4, 10, 64)]:
        for r in range(3):
            want[dt, da + r * ds:da + r * ds + 24] = before[0, 100 + r * 40:100 + r * 40 + 24]
    want[0, 2000:2016] = before[3, 0:16]
    assert np.array_equal(memory, want)


def test_a_broadcast_out_of_range_is_an_error(exchange_form):
    memory, row_of = tile_memory(np.zeros(64, dtype=np.uint8), np.zeros(64, dtype=np.uint8))
    with pytest.raises(UserError, match="tile 1 address 60 is out of range"):
        run_exchange(memory, row_of, [[0, 0, 8, 1, 0, 8, 1, 8, 1, 60, 8]])


def test_exchange_reads_before_it_writes(exchange_form):
    memory, row_of = tile_memory(np.arange(64, dtype=np.uint8), np.zeros(64, dtype=np.uint8))
    # swap two halves of tile 0 in one phase
    run_exchange(memory, row_of, [[0, 0, 32, 0, 32, 32, 1, 32], [0, 32, 32, 0, 0, 32, 1, 32]])
    assert list(memory[0]) == list(range(32, 64)) + list(range(32))


@pytest.mark.parametrize("entry", [[0, 0, 32, 0, 40, 32, 1, 32],     # past the end of tile memory
                                   [0, 0, 8, 1, 0, 8, 1, 8],         # to a tile that is not loaded
                                   [5, 0, 8, 0, 0, 8, 1, 8]])        # from a tile the machine lacks
def test_exchange_out_of_range_is_an_error(entry, exchange_form):
    memory, _ = tile_memory(np.zeros(64, dtype=np.uint8), np.zeros(64, dtype=np.uint8))
    row_of = np.array([0, -1, 1])
    before = memory.copy()
    with pytest.raises(UserError, match="out of range"):
        run_exchange(memory, row_of, [entry])
    assert np.array_equal(memory, before)


def test_exchange_writing_a_byte_twice_is_an_error(exchange_form):
    memory, row_of = tile_memory(np.arange(64, dtype=np.uint8), np.zeros(64, dtype=np.uint8))
    with pytest.raises(UserError, match="write the same bytes"):
        run_exchange(memory, row_of, [[0, 0, 16, 1, 0, 16, 2, 16], [0, 40, 8, 1, 20, 8, 1, 8]])
    assert not memory[1].any()


def _random_phase(rng, tiles: int, size: int, entries: int):
    """A phase's entries of random shapes; whether two of them write one byte is left to chance."""
    out = []
    for _ in range(entries):
        rows, rb = int(rng.integers(0, 6)), int(rng.integers(0, 40))
        ss, ds = rb + int(rng.integers(0, 9)), rb + int(rng.integers(0, 9))
        reach = max(0, (rows - 1)) * max(ss, ds) + rb
        out.append([int(rng.integers(0, tiles)), int(rng.integers(0, size - reach)), ss,
                    int(rng.integers(0, tiles)), int(rng.integers(0, size - reach)), ds, rows, rb])
    return out


def _outcome(memory, row_of, entries, pool=None) -> tuple[str, bytes]:
    """One phase run over a copy of ``memory``: ``("done" or the error, the memory after)``."""
    mem = memory.copy()
    try:
        run_exchange(mem, row_of, entries, pool)
        return "done", mem.tobytes()
    except UserError as exc:
        return str(exc), mem.tobytes()


def test_the_c_copier_does_what_the_numpy_form_does(monkeypatch):
    """Random phases, some writing a byte twice: the same memory after, or the same error."""
    from ipubuild.builtin import exchange_copy
    if exchange_copy.library() is None:
        pytest.fail("the simulator's exchange copier does not compile here")
    rng = np.random.default_rng(7)
    outcomes = set()
    for trial in range(200):
        memory, row_of = tile_memory(*(rng.integers(0, 256, 512, dtype=np.uint8) for _ in range(3)))
        entries = _random_phase(rng, 3, 512, int(rng.integers(1, 8)))
        results = []
        for switch in ("1", "0"):
            monkeypatch.setenv("IPUBUILD_NATIVE_SIM_EXCHANGE", switch)
            results.append(_outcome(memory, row_of, entries))
        assert results[0] == results[1], entries
        outcomes.add(results[0][0] == "done")
    assert outcomes == {True, False}          # both kinds of phase were met


def test_the_c_copier_on_two_threads_does_what_it_does_on_one(monkeypatch):
    """Random phases over many tiles, some writing a byte twice, copied in two halves on a
    thread pool (every phase, whatever its size): the same memory after, or the same error."""
    from concurrent.futures import ThreadPoolExecutor
    from ipubuild.builtin import exchange_copy
    if exchange_copy.library() is None:
        pytest.fail("the simulator's exchange copier does not compile here")
    monkeypatch.setenv("IPUBUILD_NATIVE_SIM_EXCHANGE", "1")
    monkeypatch.setattr(exchange_copy, "PARALLEL_BYTES", 0)
    rng = np.random.default_rng(11)
    outcomes = set()
    with ThreadPoolExecutor(1) as pool:
        for trial in range(200):
            memory, row_of = tile_memory(*(rng.integers(0, 256, 512, dtype=np.uint8) for _ in range(6)))
            entries = _random_phase(rng, 6, 512, int(rng.integers(1, 12)))
            results = [_outcome(memory, row_of, entries, threads) for threads in (None, pool)]
            assert results[0] == results[1], entries
            outcomes.add(results[0][0] == "done")
    assert outcomes == {True, False}          # both kinds of phase were met


def test_the_c_copier_tells_tiles_apart_past_255_destinations(monkeypatch):
    """The copier marks each destination tile's bytes with a count that wraps at 255: 600 tiles
    each written at the same addresses is no double write, a second write on the last tile is."""
    tiles = 600
    memory, row_of = tile_memory(*(np.full(64, t % 256, np.uint8) for t in range(tiles)))
    same = [[t, 0, 8, (t + 1) % tiles, 16, 8, 2, 8] for t in range(tiles)]
    for switch in ("1", "0"):
        monkeypatch.setenv("IPUBUILD_NATIVE_SIM_EXCHANGE", switch)
        mem = memory.copy()
        run_exchange(mem, row_of, same)
        assert (mem[np.arange(tiles), 16] == np.arange(-1, tiles - 1) % tiles % 256).all()
        with pytest.raises(UserError, match="write the same bytes"):
            run_exchange(memory.copy(), row_of, same + [[0, 0, 8, tiles - 1, 20, 8, 1, 4]])


def test_the_c_data_range_check_does_what_the_numpy_form_does(monkeypatch):
    """Random entries against random data ranges (some tiles past the table, some entries moving
    nothing): the same rows found outside on both sides."""
    from ipubuild.builtin import exchange_copy
    from ipubuild.builtin.simulator import _inside, data_bounds
    if exchange_copy.library() is None:
        pytest.fail("the simulator's exchange copier does not compile here")
    rng = np.random.default_rng(5)
    seen = set()
    for trial in range(100):
        data = {t: sorted([int(a), int(a) + int(rng.integers(0, 200))] for a in rng.integers(0, 400, int(rng.integers(0, 4))))
                for t in range(3)}
        bounds = data_bounds(data, 3)
        entries = np.array(_random_phase(rng, 4, 512, 20), dtype=np.int64).reshape(-1, 8)
        found = []
        for switch in ("1", "0"):
            monkeypatch.setenv("IPUBUILD_NATIVE_SIM_EXCHANGE", switch)
            found.append(_inside(entries, bounds))
        assert (found[0] == found[1]).all(), trial
        seen.update(found[0].ravel().tolist())
    assert seen == {True, False}


def test_kernel_loop_through_doit(tmp_path):
    tree = small_tree(tmp_path, with_ipubuild=True)
    rc, log = doit(tree, "build:small")
    assert rc == 0 and "numericalTest=PASS" in log, log[-3000:]
    package = (tree / "artifacts" / "small" / "small.ipuexe").read_bytes()
    kernel = tree / "ipubuild" / "kernels" / "matmul.c"
    original = kernel.read_text()

    kernel.write_text(original + "\n/* a comment-only edit */\n")
    rc, log = doit(tree, "build:small")
    assert rc == 0, log[-3000:]
    ran = executed(log)
    assert "compile_kernels:small" in ran and "compiled kernel variant variant=matmul_" in log, log[-3000:]
    assert all(t.startswith(("compile_kernels:", "compile_kernels_counted:", "build:")) for t in ran), ran
    assert (tree / "artifacts" / "small" / "small.ipuexe").read_bytes() == package

    kernel.write_text(original + "\nint ipubuild_probe(int x) { return 3 * x + 1; }\n")
    rc, log = doit(tree, "build:small")
    assert rc == 0 and "numericalTest=PASS" in log, log[-3000:]
    ran = executed(log)
    assert any(t.startswith("build_tile_images:") for t in ran)
    assert "write_package:small" in ran and "run_device:small" in ran
    allowed = ("compile_kernels:", "compile_kernels_counted:", "link_kernels:", "build_tile_images:",
               "write_package:", "run_device:", "measure_kernels:", "check_numerics:", "build:")
    assert all(t.startswith(allowed) for t in ran), [t for t in ran if not t.startswith(allowed)]
    assert (tree / "artifacts" / "small" / "small.ipuexe").read_bytes() != package


def test_inplace_cast_storage_saves_memory_and_passes(tmp_path, monkeypatch):
    """CastStoragePolicy { default: InPlace }: narrowing casts overwrite their input buffers (the
    softmax's, kept a separate operation here: every other cast folds into its producer)."""
    from ipubuild.compiler.targets import CAST_FUSIBLE
    fuse = ", ".join(f'"{o}"' for o in CAST_FUSIBLE if o != "softmax")
    sizes = {}
    for mode in ("separate", "inplace"):
        tree = tmp_path / mode
        text = (SMALL.replace("rounds = 3", "rounds = 0")
                + f'\n[casts]\nfuse = [{fuse}]\n[casts.storage]\ndefault = "{mode}"\n')
        small_tree(tree, text=text)
        monkeypatch.chdir(tree)
        out = build_in_process(tree, "targets/small.toml")
        ws = Workspace.at(tree)
        assert canonical.loads(ws.engine.fetch(out["small/verdict"]))["pass"]
        program = ws.engine.decoded(out["small/program"])
        sizes[mode] = sum(b["size"] for bufs in buffers_of(program).values() for b in bufs.values())
    assert sizes["inplace"] < sizes["separate"]


def test_kernel_edit_rebuilds_only_the_images_of_tiles_that_run_it(tmp_path):
    # on 64 tiles the small model's operations spread out, so not every tile runs every kernel
    tree = small_tree(tmp_path, with_ipubuild=True, text=ONE_ROUND.replace("tile_count = 16", "tile_count = 64"))
    rc, log = doit(tree, "build:small")
    assert rc == 0, log[-3000:]
    digest = (tree / ".ipubuild" / "refs" / "small" / "kernel_plan.ref").read_text().strip()
    plan = Workspace.at(tree).engine.decoded(digest)["tiles"]
    runs = {}
    for tile, ks in plan.items():
        for k in ks:
            runs.setdefault(registry().kernels[k].source.name, set()).add(tile)
    source, users = min(((src, ts) for src, ts in runs.items() if len(ts) < len(plan)), key=lambda kv: len(kv[1]))
    kernel = tree / "ipubuild" / "kernels" / source
    kernel.write_text(kernel.read_text() + "\nint ipubuild_probe(int x) { return 5 * x; }\n")
    images = Workspace.at(tree).engine.decoded(_ref(tree, "small/images"))
    rc, log = doit(tree, "build:small")
    assert rc == 0 and "numericalTest=PASS" in log, log[-3000:]
    after = Workspace.at(tree).engine.decoded(_ref(tree, "small/images"))
    assert {t for t in images if images[t] != after[t]} == users
    assert f"built tile images tiles=64 rebuilt={len(users)} " in log, log[-3000:]


def _ref(tree: Path, artifact: str) -> str:
    return (tree / ".ipubuild" / "refs" / f"{artifact}.ref").read_text().strip()


def test_a_tampered_output_file_is_restored_before_the_verdict(tmp_path):
    tree = small_tree(tmp_path)
    rc, log = doit(tree, "build:small")
    assert rc == 0, log[-3000:]
    path = tree / "artifacts" / "small" / "small.ipuexe"
    good = path.read_bytes()
    path.write_bytes(good[:1000] + bytes([good[1000] ^ 0xFF]) + good[1001:])
    rc, log = doit(tree, "build:small")
    assert rc == 0 and "numericalTest=PASS" in log, log[-3000:]
    # restored from the cache by the up-to-date check, or (when the file changed within a second
    # of its build, too recently for its stat key to be trusted) by re-running write_package
    assert set(executed(log)) <= {"write_package:small", "build:small"}, executed(log)
    assert path.read_bytes() == good
