"""Tests for the phase engine (ipubuild/engine.py), code fingerprints (ipubuild/fingerprint.py)
and canonical serialisation (ipubuild/canonical.py)."""

from __future__ import annotations

import collections
import importlib
import json
import math
import os
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import ipubuild.build.analysis  # noqa: F401 - with ipubuild.build.build: every built-in phase registered before
import ipubuild.build.build  # noqa: F401   _isolate_phases takes its snapshot of the registry
from ipubuild.engine import canonical, engine, fingerprint
from ipubuild.engine.engine import PHASES, Engine, config_subset, phase
from ipubuild.errors import UserError
from ipubuild.engine.store import Store

ROOT = Path(__file__).resolve().parents[1]
BIG = 100 * 1024

CALLS: collections.Counter = collections.Counter()


@pytest.fixture(autouse=True)
def _isolate_phases():
    """Phases registered by a test are removed afterwards; counters and fingerprints reset."""
    before = dict(PHASES)
    CALLS.clear()
    fingerprint.clear()
    yield
    PHASES.clear()
    PHASES.update(before)
    fingerprint.clear()


@pytest.fixture
def eng(tmp_path):
    store = Store(tmp_path / "cache")
    yield Engine(store)
    store.close()


def _name(stem: str) -> str:
    return f"{stem}_{uuid.uuid4().hex[:8]}"


def _val_file(store: Store, digest: str) -> Path:
    """The on-disk file of a big blob."""
    con = store.blobs._sql("SELECT filename FROM Cache WHERE key = ?", (digest,)).fetchone()
    assert con and con[0], "blob is not stored as a file"
    return Path(store.blobs.directory) / con[0]


# --- hit / miss -------------------------------------------------------------------------------

def _register_upper(name, config=()):
    @phase(name, inputs=("text",), outputs=("upper",), config=config)
    def fn(ctx):
        CALLS[name] += 1
        suffix = json.dumps(config_subset(ctx.config, config), sort_keys=True).encode()
        return {"upper": ctx.bytes("text").upper() + suffix}
    return fn


def test_second_run_is_a_hit_and_does_not_call(eng):
    name = _name("upper")
    _register_upper(name)
    d = eng.store.put(b"abc")
    r1 = eng.run(name, {"text": d}, {})
    assert not r1.hit and CALLS[name] == 1
    assert eng.fetch(r1.outputs["upper"]) == b"ABC{}"
    r2 = eng.run(name, {"text": d}, {})
    assert r2.hit and CALLS[name] == 1
    assert r2.outputs == r1.outputs and r2.key == r1.key
    assert r1.key == eng.action_key(PHASES[name], {"text": d}, {})
    # a fresh engine over the same store (a new process, say) hits too
    assert Engine(eng.store).run(name, {"text": d}, {}).hit
    # force re-runs
    r3 = eng.run(name, {"text": d}, {}, force=True)
    assert not r3.hit and CALLS[name] == 2 and r3.outputs == r1.outputs


def test_records_provenance_of_outputs(eng):
    name = _name("upper")
    _register_upper(name, config=("a.b",))
    d = eng.store.put(b"abc")
    r = eng.run(name, {"text": d}, {"a": {"b": 2, "c": 3}, "z": 1})
    assert eng.store.get_provenance(r.outputs["upper"]) == [{
        "phase": name, "inputs": {"text": d}, "config": {"a.b": 2}, "output": "upper"}]


def test_input_digest_change_is_a_miss(eng):
    name = _name("upper")
    _register_upper(name)
    d1, d2 = eng.store.put(b"abc"), eng.store.put(b"abd")
    r1 = eng.run(name, {"text": d1}, {})
    r2 = eng.run(name, {"text": d2}, {})
    assert not r2.hit and CALLS[name] == 2 and r1.key != r2.key
    assert eng.fetch(r2.outputs["upper"]) == b"ABD{}"
    assert eng.run(name, {"text": d1}, {}).hit  # the old record is still there


@pytest.mark.parametrize("key", ["rounds", "search.rounds"])
def test_config_subset_declared_key_misses_undeclared_hits(eng, key):
    name = _name("upper")
    _register_upper(name, config=(key,))
    d = eng.store.put(b"abc")

    def cfg(value, other):
        nested = {"search": {"rounds": value, "seed": other}, "unrelated": other}
        return nested if "." in key else {"rounds": value, "unrelated": other}

    assert not eng.run(name, {"text": d}, cfg(3, "x")).hit
    assert eng.run(name, {"text": d}, cfg(3, "y")).hit          # undeclared key changed
    assert eng.run(name, {"text": d}, {**cfg(3, "x"), "new": 1}).hit  # key added
    assert CALLS[name] == 1
    r = eng.run(name, {"text": d}, cfg(4, "x"))                  # declared key changed
    assert not r.hit and CALLS[name] == 2
    assert eng.fetch(r.outputs["upper"]).endswith(json.dumps({key: 4}).encode())


def test_a_phase_sees_only_the_configuration_it_declares(eng):
    """What a phase reads must be in its key: the engine hands it only its declared leaves, so a
    read of any other fails at once instead of giving a result the key does not cover."""
    name = _name("reads")
    seen = []

    @phase(name, inputs=("text",), outputs=("out",), config=("search.rounds",))
    def fn(ctx):
        seen.append(ctx.config)
        return {"out": json.dumps(ctx.config["numerics"]["compare"]).encode()}
    d = eng.store.put(b"abc")
    with pytest.raises(KeyError):
        eng.run(name, {"text": d}, {"search": {"rounds": 1, "seed": 2}, "numerics": {"compare": "outputs"}})
    assert seen == [{"search": {"rounds": 1}}]


def test_config_subset_helper():
    cfg = {"a": {"b": {"c": 1}}, "x": 5, "s": "str"}
    assert config_subset(cfg, ("a.b.c", "x", "a.zz", "s.t", "nope")) == {
        "a.b.c": 1, "x": 5, "a.zz": None, "s.t": None, "nope": None}
    assert engine._unflatten({"a.b.c": 1, "a.d": 2, "x": 5}) == {"a": {"b": {"c": 1}, "d": 2}, "x": 5}
    flat = {"a.b.c": 1, "a.d": None, "x": [1, 2]}
    assert config_subset(engine._unflatten(flat), flat) == flat


def test_missing_input_raises_keyerror(eng):
    name = _name("upper")
    _register_upper(name)
    with pytest.raises(KeyError, match="lacks inputs"):
        eng.run(name, {}, {})
    assert CALLS[name] == 0


def test_undeclared_output_raises(eng):
    name = _name("bad")

    @phase(name, outputs=("a",))
    def fn(ctx):
        return {"a": b"1", "b": b"2"}

    with pytest.raises(KeyError, match="undeclared output b"):
        eng.run(name, {}, {})
    assert eng.store.get_action(eng.action_key(PHASES[name], {}, {})) is None


def test_phase_name_is_part_of_the_key(eng):
    n1, n2 = _name("upper"), _name("upper")
    _register_upper(n1)
    _register_upper(n2)
    d = eng.store.put(b"abc")
    r1, r2 = eng.run(n1, {"text": d}, {}), eng.run(n2, {"text": d}, {})
    assert not r2.hit and r1.key != r2.key


def test_plugin_fingerprints_are_part_of_the_key(tmp_path):
    name = _name("hooked")

    @phase(name, outputs=("o",), hooks=("some_hook",))
    def fn(ctx):
        CALLS[name] += 1
        return {"o": b"x"}

    prints = {"v": "plugin==1"}
    store = Store(tmp_path / "cache")
    try:
        e = Engine(store, lambda hooks: {"p": prints["v"], "hooks": list(hooks)})
        assert not e.run(name, {}, {}).hit
        assert e.run(name, {}, {}).hit
        prints["v"] = "plugin==2"
        assert not e.run(name, {}, {}).hit
        assert CALLS[name] == 2
    finally:
        store.close()


def test_the_last_large_blob_is_handed_to_its_reader_without_the_store(eng, monkeypatch):
    """A blob too large for the recent blobs (a package) is read back by the next phase from
    memory, not re-read and re-verified from the store; only the last one is kept, and
    ``forget_values`` lets it go."""
    monkeypatch.setattr(Engine, "RECENT_BLOB_MAX", 1000)
    first, second = b"a" * 5000, b"b" * 5000
    d1 = eng.put(first)
    reads = []
    monkeypatch.setattr(eng.store, "get", lambda d: reads.append(d) or Store.get(eng.store, d))
    assert eng.fetch(d1) is first and reads == []
    d2 = eng.put(second)
    assert eng.fetch(d2) is second and reads == []
    assert eng.fetch(d1) == first and reads == [d1]         # replaced: read from the store
    eng.forget_values()
    assert eng.fetch(d2) == second and reads == [d1, d2]
    valued = canonical.encode({"x": "y" * 5000})              # a decoded value stands for it: not kept
    d3 = eng.put(valued)
    assert eng.fetch(d3) == bytes(valued) and reads == [d1, d2, d3]


# --- family outputs ---------------------------------------------------------------------------

def test_family_outputs_and_family_inputs(eng):
    split, join = _name("split"), _name("join")

    @phase(split, inputs=("text",), outputs=("tile/*", "count"))
    def fsplit(ctx):
        CALLS[split] += 1
        words = ctx.bytes("text").split()
        out = {f"tile/{i}": w for i, w in enumerate(words)}
        out["count"] = canonical.dumps(len(words))
        return out

    @phase(join, inputs=("tile/*", "count"), outputs=("joined",))
    def fjoin(ctx):
        CALLS[join] += 1
        fam = ctx.family("tile")
        assert len(fam) == ctx.json("count")
        return {"joined": b"-".join(ctx.engine.fetch(fam[k]) for k in sorted(fam, key=int))}

    d = eng.store.put(b"alpha beta gamma")
    r = eng.run(split, {"text": d}, {})
    assert sorted(r.outputs) == ["count", "tile"]     # the family as one index blob
    members = eng.decoded(r.outputs["tile"])
    assert sorted(members) == ["0", "1", "2"]
    assert [eng.fetch(members[str(i)]) for i in range(3)] == [b"alpha", b"beta", b"gamma"]
    assert eng.run(split, {"text": d}, {}).outputs == r.outputs

    j = eng.run(join, dict(r.outputs), {})
    assert eng.fetch(j.outputs["joined"]) == b"alpha-beta-gamma"
    assert eng.run(join, dict(r.outputs), {}).hit
    assert CALLS == {split: 1, join: 1}

    # a family member's provenance names its own slot, so it can be healed alone
    assert eng.store.get_provenance(members["1"])[0]["output"] == "tile/1"
    eng.store.drop(members["1"])
    assert Engine(eng.store).fetch(members["1"]) == b"beta"
    assert CALLS[split] == 2


def test_family_prefix_must_match(eng):
    name = _name("fam")

    @phase(name, outputs=("tile/*",))
    def fn(ctx):
        return {"tiles": b"not a member"}

    with pytest.raises(KeyError, match="undeclared output tiles"):
        eng.run(name, {}, {})


# --- healing ----------------------------------------------------------------------------------

def _register_big(name, config=()):
    @phase(name, inputs=("seed",), outputs=("big",), config=config)
    def fn(ctx):
        CALLS[name] += 1
        seed = ctx.bytes("seed") + json.dumps(config_subset(ctx.config, config)).encode()
        return {"big": (seed * (BIG // len(seed) + 1))[:BIG]}
    return fn


def test_corrupt_output_blob_is_healed_by_fetch(eng, capsys):
    name = _name("big")
    _register_big(name, config=("k.v",))
    seed = eng.store.put(b"seed-bytes")
    r = eng.run(name, {"seed": seed}, {"k": {"v": 7}, "other": 1})
    digest = r.outputs["big"]
    good = eng.fetch(digest)
    assert CALLS[name] == 1

    val = _val_file(eng.store, digest)
    raw = bytearray(val.read_bytes())
    raw[1234] ^= 0xFF
    val.write_bytes(bytes(raw))

    eng = Engine(eng.store)          # another process: it has not made the blob itself
    assert eng.fetch(digest) == good
    assert CALLS[name] == 2  # re-ran the producer (with its recorded config subset)
    err = capsys.readouterr().err
    assert "corrupt cache blob" in err and "rebuilding missing cache blob" in err
    assert eng.store.get(digest) == good  # stored again, verified
    assert eng.fetch(digest) == good and CALLS[name] == 2


def test_consumer_heals_evicted_input_via_provenance(eng):
    a, b = _name("big"), _name("consume")
    _register_big(a)

    @phase(b, inputs=("big",), outputs=("len",))
    def fb(ctx):
        CALLS[b] += 1
        return {"len": str(len(ctx.bytes("big"))).encode()}

    seed = eng.store.put(b"s")
    ra = eng.run(a, {"seed": seed}, {})
    eng = Engine(eng.store)          # another process
    eng.store.drop(ra.outputs["big"])
    eng.store.drop(seed)
    eng.store.add_provenance(seed, {"phase": "nope-unknown", "inputs": {}, "config": {},
                                    "output": "x"})
    # seed is a source blob with no known producer: consuming it fails cleanly
    with pytest.raises(UserError, match="no recorded producer can rebuild it"):
        eng.run(b, {"big": ra.outputs["big"]}, {})
    eng.store.put(b"s")
    rb = eng.run(b, {"big": ra.outputs["big"]}, {})
    assert eng.fetch(rb.outputs["len"]) == str(BIG).encode()
    assert CALLS == {a: 3, b: 2}  # a: first run, failed heal, successful heal


def test_missing_blob_file_is_healed_by_fetch(eng):
    name = _name("big")
    _register_big(name)
    seed = eng.store.put(b"seed-bytes")
    r = eng.run(name, {"seed": seed}, {})
    digest = r.outputs["big"]
    good = eng.fetch(digest)
    _val_file(eng.store, digest).unlink()
    assert eng.fetch(digest) == good


def test_missing_blob_without_provenance_is_a_user_error(eng):
    digest = eng.store.put(b"a source, not produced by a phase")
    eng.store.drop(digest)
    with pytest.raises(UserError, match="producer is unknown"):
        eng.fetch(digest)


def test_missing_blob_whose_producer_is_unregistered_is_a_user_error(eng):
    name = _name("big")
    _register_big(name)
    r = eng.run(name, {"seed": eng.store.put(b"q")}, {})
    eng.store.drop(r.outputs["big"])
    del PHASES[name]
    with pytest.raises(UserError, match="producer is unknown"):
        Engine(eng.store).fetch(r.outputs["big"])


def test_nondeterministic_producer_is_a_user_error(eng):
    name = _name("nondet")

    @phase(name, outputs=("o",))
    def fn(ctx):
        CALLS[name] += 1
        return {"o": os.urandom(16)}

    r = eng.run(name, {}, {})
    eng.store.drop(r.outputs["o"])
    with pytest.raises(UserError, match="non-deterministic"):
        Engine(eng.store).fetch(r.outputs["o"])


def test_decoded_memoises_json(eng):
    d = eng.store.put(canonical.dumps({"a": [1, 2]}))
    v = eng.decoded(d)
    assert v == {"a": [1, 2]}
    assert eng.decoded(d) is v


# --- code fingerprints ------------------------------------------------------------------------

IMPORT_STYLES = {
    "from_dot_import": ("from . import helper", "helper.transform"),
    "from_dot_helper": ("from .helper import transform", "transform"),
    "absolute": ("import {pkg}.helper", "{pkg}.helper.transform"),
    "from_pkg_import": ("from {pkg} import helper", "helper.transform"),
}


def _make_toy_package(tmp_path: Path, style: str) -> tuple[str, str, Path]:
    """A throwaway package with a phase in a.py importing helper.py (which imports deep.py),
    and unrelated.py that a.py never imports. Returns (package, phase name, package dir)."""
    pkg = f"toyphases_{uuid.uuid4().hex[:10]}"
    name = f"{pkg}_phase"
    imp, call = (s.format(pkg=pkg) for s in IMPORT_STYLES[style])
    d = tmp_path / pkg
    d.mkdir()
    (d / "__init__.py").write_text("")
    (d / "deep.py").write_text("FACTOR = 2\n")
    (d / "helper.py").write_text("from .deep import FACTOR\n\n"
                                 "def transform(b):\n    return b * FACTOR\n")
    (d / "unrelated.py").write_text("from . import helper  # imports helper, not imported by a\n"
                                    "X = 1\n")
    (d / "a.py").write_text(textwrap.dedent(f"""\
        from ipubuild.engine import phase
        {imp}

        @phase({name!r}, inputs=("x",), outputs=("y",))
        def run(ctx):
            return {{"y": {call}(ctx.bytes("x"))}}
        """))
    importlib.invalidate_caches()
    return pkg, name, d


@pytest.mark.parametrize("style", sorted(IMPORT_STYLES))
def test_code_fingerprint_tracks_imported_modules_only(tmp_path, monkeypatch, style):
    monkeypatch.syspath_prepend(str(tmp_path))
    pkg, name, d = _make_toy_package(tmp_path, style)
    importlib.import_module(f"{pkg}.a")
    ph = PHASES[name]
    assert ph.fn.__module__ == f"{pkg}.a"
    closure = fingerprint.closure(f"{pkg}.a")
    assert f"{pkg}.helper" in closure and f"{pkg}.deep" in closure
    assert f"{pkg}.unrelated" not in closure
    assert not any(m.startswith("ipubuild") for m in closure)  # other packages are not followed

    store = Store(tmp_path / "cache")
    try:
        eng = Engine(store)
        x = store.put(b"ab")
        base = eng.run(name, {"x": x}, {})
        assert not base.hit and store.get(base.outputs["y"]) == b"abab"
        code0 = ph.code

        def key_after(path: Path, text: str) -> str:
            path.write_text(text)
            fingerprint.clear()
            return eng.action_key(ph, {"x": x}, {})

        # unrelated module edited: same fingerprint, still a hit
        assert key_after(d / "unrelated.py", "X = 2\n") == base.key
        assert ph.code == code0
        assert eng.run(name, {"x": x}, {}).hit

        # a comment or a docstring cannot change what the phase computes: still a hit
        a_src = (d / "a.py").read_text()
        assert key_after(d / "a.py", '"""A docstring."""\n' + a_src + "# edited\n") == base.key
        assert ph.code == code0
        # the phase's own module edited (code): a miss
        assert key_after(d / "a.py", a_src + "EDITED = 1\n") != base.key
        assert ph.code != code0
        assert not eng.run(name, {"x": x}, {}).hit
        # reverting restores the original key (content addressed, not time based)
        assert key_after(d / "a.py", a_src) == base.key
        assert eng.run(name, {"x": x}, {}).hit

        # a directly imported helper edited: a miss
        h_src = (d / "helper.py").read_text()
        assert key_after(d / "helper.py", h_src + "\n# tweak\n") == base.key      # a comment
        assert key_after(d / "helper.py", h_src + "\nTWEAK = 1\n") != base.key
        key_after(d / "helper.py", h_src)

        # a transitively imported module edited: a miss
        assert key_after(d / "deep.py", "FACTOR = 3\n") != base.key
        key_after(d / "deep.py", "FACTOR = 2\n")
        assert ph.code == code0  # everything restored
    finally:
        store.close()


def test_fingerprint_needs_clear_to_see_edits(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    pkg, name, d = _make_toy_package(tmp_path, "from_dot_import")
    importlib.import_module(f"{pkg}.a")
    before = PHASES[name].code
    (d / "helper.py").write_text("def transform(b):\n    return b\n")
    assert PHASES[name].code == before  # memoised until clear()
    fingerprint.clear()
    after = PHASES[name].code
    assert after != before
    # editing helper dropped its import of deep: deep leaves the closure
    assert f"{pkg}.deep" not in fingerprint.closure(f"{pkg}.a")


def test_fingerprint_of_unknown_module_is_stable():
    assert fingerprint.closure("no_such_module_xyz") == []
    assert fingerprint.code_fingerprint("no_such_module_xyz") == canonical.digest(b"")


PREFETCH = """
import concurrent.futures, json, os, sys
from pathlib import Path
from ipubuild.engine import fingerprint
files, out = json.loads(sys.argv[1]), Path(sys.argv[2])
pools = []
class Pool(concurrent.futures.ProcessPoolExecutor):
    def __init__(self, workers, **kw):
        pools.append(workers)
        super().__init__(workers, **kw)
concurrent.futures.ProcessPoolExecutor = Pool
os.cpu_count = lambda: 2
analyse = fingerprint._analyse
def counted(path):
    (out / "pids" / str(os.getpid())).touch()
    return analyse(path)
fingerprint._analyse = counted
fingerprint.use_memo(out / "memo.json")
fingerprint.prefetch(files)
fingerprint.save_memo()
left = [m[0] for m in fingerprint._memo.missing(files, fingerprint.AST_KIND)]
facts = {f: fingerprint._memo.get(f, lambda _: "analysed again", kind=fingerprint.AST_KIND) for f in files}
fingerprint.prefetch(files)
fingerprint.finish_prefetch()
print(json.dumps({"pools": pools, "pid": os.getpid(), "left": left, "facts": facts}))
"""


def test_a_fresh_trees_modules_are_analysed_on_every_core_to_the_same_facts(tmp_path):
    """``prefetch`` (a fresh clone's ~100 modules, 0.6 s on one core) analyses them in a pool of
    a process per core, and remembers for each the facts ``_analyse`` gives one at a time; a file
    that does not parse is left to its importer; a memo that holds them all starts no pool. (In
    a process of its own: the prefetch forks only from a process with one thread.)"""
    sources = sorted(Path(fingerprint.__file__).parent.parent.rglob("*.py"))[:40]
    (tmp_path / "src").mkdir()
    (tmp_path / "pids").mkdir()
    files = []
    for i, src in enumerate(sources):
        f = tmp_path / "src" / f"m{i}.py"
        f.write_bytes(src.read_bytes())
        files.append(str(f))
    broken = tmp_path / "src" / "broken.py"
    broken.write_text("def f(:\n")
    root = Path(__file__).resolve().parent.parent
    run = subprocess.run([sys.executable, "-c", PREFETCH, json.dumps(files + [str(broken)]), str(tmp_path)],
                         cwd=root, env=dict(os.environ, PYTHONPATH=str(root)), capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout)
    assert got["pools"] == [2]
    workers = {p.name for p in (tmp_path / "pids").iterdir()}
    assert workers and str(got["pid"]) not in workers
    assert got["left"] == [str(broken)]
    assert got["facts"] == {f: fingerprint._analyse(f) for f in files} | {str(broken): "analysed again"}


def test_a_process_running_native_threads_never_forks_to_prefetch(tmp_path):
    """With OpenBLAS's thread pool running (numpy loaded, a product computed: threads Python does
    not count), ``prefetch`` forks nothing, and BLAS still works after it: a fork beside the pool
    left OpenBLAS spinning forever on the parent's next product."""
    files = []
    for i, src in enumerate(sorted(Path(fingerprint.__file__).parent.parent.rglob("*.py"))[:40]):
        f = tmp_path / f"m{i}.py"
        f.write_bytes(src.read_bytes())
        files.append(str(f))
    (tmp_path / "pids").mkdir()
    script = "import numpy as np\nnp.ones((256, 256)) @ np.ones((256, 256))\n" + PREFETCH.replace(
        "print(json.dumps(", "np.ones((256, 256)) @ np.ones((256, 256))\nprint(json.dumps(")
    root = Path(__file__).resolve().parent.parent
    run = subprocess.run([sys.executable, "-c", script, json.dumps(files), str(tmp_path)], cwd=root,
                         env=dict(os.environ, PYTHONPATH=str(root), OPENBLAS_NUM_THREADS="2"),
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout)
    assert got["pools"] == [] and not list((tmp_path / "pids").iterdir()) and got["left"] == files


def test_the_analysis_prefetches_the_files_fingerprints_read():
    """The files ``prefetch`` is given (every module of ipubuild, as the analysis lists them) are
    the ones the fingerprints read, by the same names: else it parses for nothing."""
    import ipubuild
    from ipubuild.build.analysis import python_files
    listed = set(python_files(Path(ipubuild.__file__).parent))
    read = {f for ph in PHASES.values() if ph.fn.__module__.startswith("ipubuild.")
            for f in fingerprint.files_of(ph.fn.__module__)}
    assert read and read <= listed


# --- canonical serialisation ------------------------------------------------------------------

NESTED = {
    "zeta": [1, 2.5, -0.125, 1e300, True, None, "ü—☃"],
    "alpha": {"b": {"c": [{"y": 1, "x": 2}], "a": 0.1}, "tiles": list(range(20))},
    "mid": {str(i): i * 1.5 for i in range(50)},
    "unicode-key-é": "\x00\n\t\"",
}

_SCRIPT = ("import json, sys; from ipubuild.engine import canonical; "
           "v = json.loads(sys.stdin.read()); "
           "v = {k: v[k] for k in sorted(v, key=hash)}; "  # insertion order varies with the seed
           "sys.stdout.write(canonical.dumps(v).decode() + '\\n' + canonical.digest_of(v))")


@pytest.mark.parametrize("seed", ["0", "1", "4242"])
def test_canonical_stable_across_processes(seed):
    env = {**os.environ, "PYTHONHASHSEED": seed,
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", _SCRIPT], input=json.dumps(NESTED), env=env,
                         capture_output=True, text=True, check=True, timeout=60).stdout
    dumped, digest = out.rsplit("\n", 1)
    assert dumped.encode() == canonical.dumps(NESTED)
    assert digest == canonical.digest_of(NESTED)


def test_canonical_known_bytes():
    assert canonical.dumps({"b": [1, 2.5], "a": "é", "c": None}) == b'{"a":"\\u00e9","b":[1,2.5],"c":null}'
    assert canonical.digest_of({}) == canonical.digest(b"{}")


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=8)
    | st.floats(allow_nan=False, allow_infinity=False),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=6), children, max_size=4),
    max_leaves=25)


def _reorder(v):
    if isinstance(v, dict):
        return {k: _reorder(v[k]) for k in reversed(list(v))}
    if isinstance(v, list):
        return [_reorder(x) for x in v]
    return v


@settings(max_examples=150, deadline=None)
@given(json_values)
def test_canonical_insertion_order_irrelevant_and_round_trips(v):
    assert canonical.dumps(_reorder(v)) == canonical.dumps(v)
    assert canonical.loads(canonical.dumps(v)) == v
    assert canonical.dumps(canonical.loads(canonical.dumps(v))) == canonical.dumps(v)


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_canonical_refuses_nan_and_infinity(bad):
    with pytest.raises(ValueError):
        canonical.dumps({"a": [1, {"b": bad}]})
    with pytest.raises(ValueError):
        canonical.digest_of(bad)


def test_canonical_refuses_non_json():
    with pytest.raises(TypeError):
        canonical.dumps({"a": b"bytes"})
    with pytest.raises(TypeError):
        canonical.dumps({"a": {1, 2}})


def test_values_phases_hand_over_in_process_equal_what_their_bytes_decode_to(tmp_path, monkeypatch):
    """Phases return canonical.Json outputs, whose values the engine hands to readers in the same
    process instead of decoding the bytes again: those values must be JSON-normal (no tuples, only
    str keys), or a build in one process would compute from other values than a build that reads
    the cache."""
    from buildtree import SMALL, make_tree
    from ipubuild.build.build import build_in_process
    from ipubuild.build.pipeline import Workspace
    tree = make_tree(tmp_path / "tree", {"small": SMALL.replace("rounds = 3", "rounds = 1")})
    monkeypatch.chdir(tree)
    build_in_process(tree, "targets/small.toml")
    eng = Workspace.at(tree).engine
    from ipubuild.graph.artifacts import from_plan_blob
    remembered = {d: v for d, (v, _) in eng._decoded.items()}
    assert len(remembered) > 20
    plans = 0
    for digest, value in remembered.items():
        data = eng.store.get(digest)
        if data.startswith(canonical.PLAN_MAGIC):      # JSON with arrays: arrays of the same bytes
            plans += 1
            assert _same_plan(from_plan_blob(data), value), digest
            continue
        assert canonical.is_normal(value), digest
        assert canonical.loads(data) == value, digest
    assert plans >= 2             # the program, before and after its values are bound


def _same_plan(a, b) -> bool:
    import numpy as np
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return (isinstance(a, np.ndarray) and isinstance(b, np.ndarray) and a.dtype == b.dtype
                and a.shape == b.shape and a.tobytes() == b.tobytes())
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same_plan(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return isinstance(b, list) and len(a) == len(b) and all(map(_same_plan, a, b))
    return canonical.is_normal(a) and type(a) is type(b) and a == b


def test_a_plan_blobs_memory_estimate_is_what_its_decoded_value_holds():
    """The decoded-value cache is bounded by real memory: a plan blob's estimate is within 1.5 x of
    the blob plus what decoding it allocates — mostly its JSON skeleton's objects (a program's buffer
    dicts), not its arrays, which are views of the blob."""
    import gc
    import tracemalloc
    import numpy as np
    from ipubuild.graph.artifacts import from_plan_blob, plan_blob_memory, to_plan_blob
    value = {"buffers": [{"name": f"t{i}.{j}", "tile": i, "bytes": 64 * j} for i in range(2000) for j in range(10)],
             "steps": [{"transfers": np.arange(1200, dtype=np.int32).reshape(-1, 4) + s} for s in range(100)]}
    data = bytes(to_plan_blob(value, (("steps", "*", "transfers"),)))
    gc.collect()
    tracemalloc.start()
    try:
        decoded = from_plan_blob(data)
        held = len(data) + tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert len(decoded["buffers"]) == 20000
    assert held / 1.5 <= plan_blob_memory(data) <= held * 1.5, (plan_blob_memory(data), held)


def test_doit_and_the_action_cache_share_one_signature(tmp_path, monkeypatch):
    """Every ingredient of a phase's signature — name, code, toolchain, plugins, configuration read
    — moves both doit's up-to-date value (``analysis.step_entry``) and the action key; inputs move
    the action key, the cache's identity doit's value."""
    from ipubuild.build.analysis import step_entry
    from ipubuild.build.pipeline import Step, Workspace
    name = _name("sig")
    _register_upper(name, config=("a.b",))
    ws = Workspace(tmp_path)
    step = Step("t", "x", name, config={"a": {"b": 1}, "other": 1})
    inputs = {"text": "0" * 64}

    def both(**kw):
        s = kw.get("step", step)
        ph = PHASES[s.phase]
        return (step_entry(ws, s, kw.get("cache", "c1"))["signature"],
                ws.engine.action_key(ph, kw.get("inputs", inputs), s.config))

    base = both()
    assert both(step=Step("t", "x", name, config={"a": {"b": 1}, "other": 2})) == base   # undeclared key
    changed = {
        "config": both(step=Step("t", "x", name, config={"a": {"b": 2}, "other": 1})),
    }
    monkeypatch.setattr(engine, "toolchain", lambda: {"python": "9.9", "numpy": "0"})
    changed["toolchain"] = both()
    monkeypatch.undo()
    ws.engine.plugin_fingerprints = lambda hooks: {"p": "dist==2:abc"}
    PHASES[name] = dataclasses_replace(PHASES[name], hooks=("ipubuild_operators",))
    changed["plugins"] = both()
    PHASES[name] = dataclasses_replace(PHASES[name], hooks=())
    ws.engine.plugin_fingerprints = lambda hooks: {}
    code = PHASES[name].fn.__module__
    monkeypatch.setattr(type(PHASES[name]), "code", property(lambda self: "edited" + code))
    changed["code"] = both()
    monkeypatch.undo()
    other = _name("sig")
    _register_upper(other, config=("a.b",))
    changed["name"] = both(step=Step("t", "x", other, config=step.config))
    for what, (sig, key) in changed.items():
        assert sig != base[0] and key != base[1], what
    assert both(inputs={"text": "1" * 64}) == (base[0], both(inputs={"text": "1" * 64})[1])
    assert both(inputs={"text": "1" * 64})[1] != base[1]
    assert both(cache="c2")[0] != base[0] and both(cache="c2")[1] == base[1]
    ws.store.close()


def dataclasses_replace(obj, **kw):
    import dataclasses
    return dataclasses.replace(obj, **kw)


# --- the action key and doit's signature over the real registry ---------------------------------------

def _leaves(tree, prefix=""):
    """``{dotted key: value}`` of every leaf of a nested configuration."""
    out = {}
    for k, v in tree.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            out.update(_leaves(v, key + "."))
        else:
            out[key] = v
    return out


def _with_leaf(config, key, value):
    """A deep copy of ``config`` with the dotted ``key`` set to ``value`` (made if absent)."""
    import copy
    out = copy.deepcopy(config)
    node = out
    *parents, last = key.split(".")
    for p in parents:
        node = node.setdefault(p, {})
    node[last] = value
    return out


def _other(value):
    """A value of a configuration leaf that differs from ``value``."""
    if isinstance(value, bool):
        return not value
    if isinstance(value, (int, float)):
        return value + 1
    if isinstance(value, str):
        return value + "_changed"
    if isinstance(value, list):
        return [*value, "changed"]
    return "changed"


def _declares(ph, key):
    return any(key == d or key.startswith(d + ".") for d in ph.config)


def test_every_declared_leaf_of_every_phase_moves_its_key_and_doit_signature(tmp_path, monkeypatch):
    """For every step of a real target (the suite's small ViT, as ``doit`` analyses it: every
    registered phase it runs) and every configuration leaf its phase declares, a changed value
    changes both the action key and doit's up-to-date signature (``analysis.step_entry``); a
    changed leaf the phase does not declare changes neither. (A key that leaves out a leaf —
    ``[numerics] compare`` switched and ``map_values`` reused — fails here.)"""
    from buildtree import SMALL, make_tree

    from ipubuild.build import build as b
    from ipubuild.build.analysis import _known_names, step_entry
    from ipubuild.build.pipeline import Workspace
    from ipubuild.targets import load_target
    tree = make_tree(tmp_path / "tree", {"small": SMALL})
    monkeypatch.chdir(tree)
    ws = Workspace.at(tree)
    target = load_target("targets/small.toml", known=_known_names(ws.plugins), root=tree)
    compiler_cfg, _ = b.compiler_config()
    steps = [b.machine_step(target["target"]["machine"], tree)] + b.target_steps(target, tree, compiler_cfg)
    phases = {s.phase for s in steps}
    # the steps cover the phases a build runs; those the search runs inside plan_package too
    from ipubuild.search import EVALUATION
    assert {"map_values", "check_numerics", "plan_package", "compile_kernels", "run_device"} <= phases, phases
    inputs_of = {s.task_name: {slot: canonical.digest(slot.encode()) for slot in PHASES[s.phase].inputs}
                 for s in steps}

    def both(s, config):
        from ipubuild.build.pipeline import Step
        changed = Step(s.task, s.name, s.phase, s.inputs, s.outputs, s.sources, s.files, config, s.spans, s.doc)
        return (step_entry(ws, changed, "cache")["signature"],
                ws.engine.action_key(PHASES[s.phase], inputs_of[s.task_name], config))

    declared_checked = undeclared_checked = 0
    for s in steps:
        ph = PHASES[s.phase]
        base = both(s, s.config)
        leaves = _leaves(s.config)
        # every declared key, leaf by leaf (a declared table: each of its leaves; absent: made)
        for d in ph.config:
            under = {k: v for k, v in leaves.items() if k == d or k.startswith(d + ".")} or {d: None}
            for key, value in under.items():
                sig, key_ = both(s, _with_leaf(s.config, key, _other(value)))
                assert sig != base[0], f"{s.task_name}: {key} does not move doit's signature"
                assert key_ != base[1], f"{s.task_name}: {key} does not move the action key"
                declared_checked += 1
        for key, value in leaves.items():
            if not _declares(ph, key):
                assert both(s, _with_leaf(s.config, key, _other(value))) == base, \
                    f"{s.task_name}: undeclared {key} moves its key"
                undeclared_checked += 1
        # an undeclared leaf that no target has
        assert both(s, _with_leaf(s.config, "zz_unknown.leaf", 1)) == base, s.task_name
    assert declared_checked > 30 and undeclared_checked > 100, (declared_checked, undeclared_checked)
    # the phases the search evaluates run with the target's configuration too
    for name in EVALUATION:
        ph = PHASES[name]
        cfg = steps[1].config
        base = ws.engine.action_key(ph, {}, cfg)
        for d in ph.config:
            assert ws.engine.action_key(ph, {}, _with_leaf(cfg, d, _other(config_subset(cfg, [d])[d]))) != base, (name, d)
    ws.store.close()


# --- work left running: executors.run_phases(then=...) ---------------------------------------------

def test_calls_started_behind_others_keep_running_and_are_not_run_twice(eng):
    """``compile_kernels`` starts the counted builds behind its own compiles and returns without
    them; they go on while the build does, and the later step that needs them waits for them
    instead of compiling them again."""
    import threading
    from ipubuild.engine.executors import run_phases
    name, slow = _name("upper"), _name("slow")
    _register_upper(name)
    release, entered = threading.Event(), threading.Event()

    @phase(slow, inputs=("text",), outputs=("upper",))
    def fn(ctx):
        CALLS[slow] += 1
        entered.set()
        assert release.wait(10), "the test never let the call finish"
        return {"upper": ctx.bytes("text").upper()}

    texts = [eng.store.put(t) for t in (b"a", b"b")]
    started = [(slow, {"text": d}, {}) for d in texts]
    first = run_phases(eng, [(name, {"text": texts[0]}, {})], threads=2, then=started)
    assert [eng.fetch(r.outputs["upper"]) for r in first] == [b"A{}"]      # returned while they run
    assert entered.wait(10) and eng.store.get_action(eng.action_key(PHASES[slow], {"text": texts[0]}, {})) is None
    release.set()
    later = run_phases(eng, started, threads=2)
    assert [eng.fetch(r.outputs["upper"]) for r in later] == [b"A", b"B"]
    assert CALLS[slow] == 2 and not any(r.hit for r in later)   # each ran once, and these are those runs


def test_a_phase_writes_its_records_in_one_batch_and_its_files_before_it(eng):
    """A phase's small outputs, their provenance and its action record commit together, one
    transaction per index; a blob big enough to be a file of its own is written first, in its
    own transaction, so a batch never holds the index's write lock while it writes a file."""
    name = _name("outputs")
    big = eng.store.inline_max
    statements = []

    @phase(name, inputs=("text",), outputs=("a", "b", "c", "big"))
    def fn(ctx):
        text = ctx.bytes("text")
        for cache in (eng.store.blobs, eng.store.meta):       # this thread's connections
            cache._con.set_trace_callback(lambda s, c=cache: statements.append((c is eng.store.meta, s)))
        return {"a": text + b"a", "b": text + b"b", "c": text + b"c", "big": os.urandom(big)}

    r = eng.run(name, {"text": eng.store.put(b"x")}, {})
    tx = [(meta, s) for meta, s in statements if s in ("BEGIN IMMEDIATE", "COMMIT")]
    assert [s for meta, s in tx if meta] == ["BEGIN IMMEDIATE", "COMMIT"]
    assert [s for meta, s in tx if not meta] == ["BEGIN IMMEDIATE", "COMMIT"] * 2
    first_commit = next(i for i, (meta, s) in enumerate(tx) if s == "COMMIT")
    assert tx[first_commit] == (False, "COMMIT") and all(s == "BEGIN IMMEDIATE" for _, s in tx[first_commit + 1:first_commit + 3])
    assert eng.store.get_action(r.key) == r.outputs and len(eng.fetch(r.outputs["big"])) == big
    assert all(eng.store.get_provenance(d)[0]["phase"] == name for d in r.outputs.values())
