"""The plugin contract's guard rails: malformed or duplicate registrations are one-line errors
naming the plugin and the hook; plugin fingerprints name distribution, version and code."""
import types

import pytest

from ipubuild import hookimpl
from ipubuild.errors import UserError
from ipubuild.plugins import PluginManager
from ipubuild.search import Heuristic


def manager(*modules):
    pm = PluginManager()
    for m in modules:
        pm.register(m, name=m.__name__)
    return pm


def plugin(name, **hooks):
    m = types.ModuleType(name)
    for hook, fn in hooks.items():
        setattr(m, hook, hookimpl(fn))
    return m


def test_a_heuristics_hook_returning_a_non_list_names_the_plugin():
    pm = manager(plugin("bad_heuristics", ipubuild_search_heuristics=lambda: Heuristic("x", None)))
    with pytest.raises(UserError) as info:
        pm.collect("ipubuild_search_heuristics", lambda h: isinstance(h, Heuristic), "a list of Heuristic")
    assert str(info.value) == "plugin bad_heuristics: hook ipubuild_search_heuristics must return a list of Heuristic"


def test_a_device_name_declared_twice_names_both_plugins():
    a = plugin("dev_a", ipubuild_device_backends=lambda: {"ipumodel": object})
    b = plugin("dev_b", ipubuild_device_backends=lambda: {"ipumodel": object})
    with pytest.raises(UserError, match="'ipumodel' is already registered by dev_a"):
        manager(a, b).collect("ipubuild_device_backends", callable, "a dict", mapping=True)


def test_a_raising_hook_names_the_plugin_and_hook():
    def boom():
        raise RuntimeError("no")
    pm = manager(plugin("raising", ipubuild_cast_policies=boom))
    with pytest.raises(UserError) as info:
        pm.collect("ipubuild_cast_policies", callable, "a dict", mapping=True)
    assert str(info.value) == "plugin raising: hook ipubuild_cast_policies raised RuntimeError: no"


def test_a_mapping_with_a_wrong_value_is_refused():
    pm = manager(plugin("bad_policy", ipubuild_cast_policies=lambda: {"f143": "not callable"}))
    with pytest.raises(UserError, match="plugin bad_policy: hook ipubuild_cast_policies must return"):
        pm.collect("ipubuild_cast_policies", callable, "a dict of callables", mapping=True)


def test_unknown_hook_names_are_caught():
    pm = PluginManager()
    pm.register(plugin("typo", ipubuild_operatorz=lambda: []), name="typo")
    with pytest.raises(Exception, match="ipubuild_operatorz"):
        pm.check_pending()


def test_fingerprints_name_distribution_version_and_code():
    from ipubuild.plugins import get_plugin_manager
    fps = get_plugin_manager().fingerprints(("ipubuild_operators",))
    assert "ipubuild.builtin.operators" in fps
    dist, _, code = fps["ipubuild.builtin.operators"].partition(":")
    assert dist.startswith("ipubuild==") and len(code) == 64


def test_a_plugin_logger_writes_into_the_targets_build_log(tmp_path, monkeypatch):
    import re

    import ipubuild.log as logmod
    fresh = logmod.Logger()
    fresh.configure(tmp_path, level=2)
    monkeypatch.setattr(logmod, "log", fresh)
    with logmod.span("build", target="t"):
        logmod.get_logger("myplugin").info("proposed", count=3)
        logmod.get_logger("myplugin").warning("odd", op="x")
    text = (tmp_path / "artifacts" / "t" / "build.log").read_text()
    assert re.search(r'^\S+Z  INFO ipubuild\.build\{target="t"\}: myplugin: proposed count=3$', text, re.M), text
    assert re.search(r"^\S+Z  WARN .*: myplugin: odd op=x$", text, re.M), text


def test_doit_plugins_shows_what_each_plugin_registers(tmp_path):
    from buildtree import ROOT, doit, env, make_tree
    tree = make_tree(tmp_path)
    e = env(tree, IPUBUILD_PLUGINS="ipubuild_throwaway", IPUBUILD_DISABLE_PLUGIN_AUTOLOAD="1")
    e["PYTHONPATH"] = f"{ROOT / 'tests' / 'throwaway'}:{e['PYTHONPATH']}"
    run = doit(tree, "plugins", environ=e)
    assert run.returncode == 0, run.tail()
    out = run.stdout
    assert "ipubuild_throwaway  ipubuild_throwaway==0  hooks: ipubuild_build_model, ipubuild_cache_backends" in out
    for line in ("operators: throwaway_square", "model families: throwaway_vit", "cast policies: throwaway_f152",
                 "graph passes: throwaway_gelu_to_square (float)", "search heuristics: throwaway_square_only",
                 "devices: throwaway_device", "cache backends: throwaway://", "targets: throwaway_small"):
        assert f"\n    {line}\n" in out, (line, out)
    assert "\n    graph passes: fold_casts (cast, default)\n" in out and "\n    devices: ipumodel\n" in out
    assert "ipubuild.builtin.operators  ipubuild==" in out


def test_plugin_autoload_can_be_switched_off(tmp_path):
    import subprocess
    import sys

    from test_plugin_isolation import install
    e = install(tmp_path / "site")
    code = "from ipubuild.plugins import get_plugin_manager as g; print(sorted(n for n, _ in g().list_name_plugin()))"
    on = subprocess.run([sys.executable, "-c", code], env=e, capture_output=True, text=True, check=True).stdout
    off = subprocess.run([sys.executable, "-c", code], env=dict(e, IPUBUILD_DISABLE_PLUGIN_AUTOLOAD="1"),
                         capture_output=True, text=True, check=True).stdout
    named = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           env=dict(e, IPUBUILD_DISABLE_PLUGIN_AUTOLOAD="1", IPUBUILD_PLUGINS="ipubuild_throwaway")).stdout
    assert "ipubuild_throwaway" in on and "ipubuild_rmsnorm.plugin" in on
    assert "ipubuild_throwaway" not in off and "ipubuild_rmsnorm" not in off and "ipubuild.builtin.vit" in off
    assert "ipubuild_throwaway" in named and "ipubuild_rmsnorm" not in named


def test_the_machine_file_adds_vector_throughput_by_dtype_and_keeps_every_cost_constant():
    from ipubuild.compiler.machine import load_machine
    m = load_machine("ipu21")
    x, c = m["exchange"], m["compute"]
    assert (x["bytes_per_cycle"], x["paired_bytes_per_cycle"], x["sync_cycles"], x["transfer_setup_cycles"]) \
        == (4, 8, 600, 6)
    assert c["amp_macs_per_cycle"] == {"f143": 128, "f152": 128, "f16": 64, "f32": 16}
    assert (c["vertex_overhead_cycles"], c["vector_flops_per_cycle"]) == (40, 12)
    by = c["vector_flops_per_cycle_by_dtype"]
    assert set(by) == {"f32", "f16", "f143", "f152"} and by["f32"] == c["vector_flops_per_cycle"]
    assert by["f16"] == 2 * by["f32"] and by["f143"] == by["f152"] == by["f16"]


def test_the_device_interface_is_the_same_in_the_code_the_hookspec_and_the_docs():
    import inspect
    from pathlib import Path

    from ipubuild import hookspecs
    from ipubuild.builtin.simulator import Simulator
    root = Path(__file__).resolve().parent.parent
    params = inspect.signature(Simulator.run).parameters
    assert list(params)[:4] == ["self", "package", "inputs", "workdir"]
    # anything more is optional (``probes``: a backend that can read operations' outputs back)
    assert all(p.default is not inspect.Parameter.empty for p in list(params.values())[4:])
    assert list(params)[4:] == ["probes"] and "``probes``" in hookspecs.ipubuild_device_backends.__doc__
    assert "run(package: bytes,\n    inputs: dict[str, numpy array], workdir: Path)" in hookspecs.ipubuild_device_backends.__doc__
    for doc in ("docs/plugins.md", "docs/reference.md"):
        text = (root / doc).read_text()
        assert "run(package: bytes, inputs" in text and "package_path" not in text, doc


def test_testing_runs_a_vertex_as_lower_writes_it_and_reports_compile_errors(tmp_path):
    import numpy as np

    from ipubuild import testing
    from ipubuild.errors import UserError
    add = testing.load_variant("add_f32")            # a built-in variant, by name
    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    b = np.full((1, 4), 0.5, np.float32)
    run = testing.run_vertex(add, [("r", 0, 0), ("r", 1, 0), ("w", 0, 0), 3, 4, 1], reads=[a, b],
                             writes=[((3, 4), "f32")], offset=3)
    assert run.status == 0 and np.array_equal(run.outputs[0], a + b)
    assert run.tile.mem.size == 0xE8000                       # the machine's tile memory
    shifted = testing.run_vertex(add, [("r", 0, 16), ("r", 1, 0), ("w", 0, 0), 2, 4, 1], reads=[a, b],
                                 writes=[((2, 4), "f32")])    # a byte offset into a buffer
    assert np.array_equal(shifted.outputs[0], a[1:] + b)
    assert testing.run_vertex(add, [("r", 0, 0), ("r", 1, 0), ("w", 0, 0), 3, 4, 2], reads=[a, b],
                              writes=[((3, 4), "f32")]).status != 0
    with pytest.raises(UserError, match="kernel variant 'nope'.*known: .*add_f32"):
        testing.load_variant("nope")
    bad = tmp_path / "bad.c"
    bad.write_text("int ipu_vertex(void) { return undefined_name; }\n")
    with pytest.raises(UserError, match=r"kernel bad \(.*bad.c\): compile failed"):
        testing.compile_source(bad, tmp_path)
    warns = tmp_path / "warns.c"
    warns.write_text("#include <stdint.h>\nint ipu_vertex(uint8_t *m, const uint32_t *a) { int unused; return 0; }\n")
    with pytest.raises(UserError, match="compile failed"):
        testing.compile_source(warns, tmp_path)                          # -Werror by default
    assert testing.compile_source(warns, tmp_path, werror=False).is_file()


def test_testing_gives_the_checked_build_the_device_runs():
    import numpy as np

    from ipubuild import testing
    checked = testing.load_variant("add_f32", checked=True)
    assert checked is not testing.load_variant("add_f32")
    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    args = [("r", 0, 0), ("r", 1, 0), ("w", 0, 0), 3, 4, 1]
    ok = testing.run_vertex(checked, args, reads=[a, a[:1]], writes=[((3, 4), "f32")])
    assert ok.status == 0 and np.array_equal(ok.outputs[0], a + a[:1])
    # a misaligned buffer, which the plain build takes, the checked one refuses and says why
    assert testing.run_vertex(checked, args, reads=[a, a[:1]], writes=[((3, 4), "f32")], offset=3).status == 4
    assert checked.reason() == "a[rows*cols] is not aligned to its element size"


def test_testing_builds_a_target_in_process_with_overrides(tmp_path, monkeypatch, capfd):
    from buildtree import SMALL

    from ipubuild import testing
    monkeypatch.setenv("IPUBUILD_LOG", "error")        # obeyed in-process too: nothing of the log shown
    built = testing.build_target(SMALL, tmp_path / "tree", name="tiny", overrides={"search": {"rounds": 0}})
    assert capfd.readouterr().err == ""
    assert built.passed and built.name == "tiny"
    assert (tmp_path / "tree" / "artifacts" / "tiny" / "tiny.ipuexe").is_file()
    assert "rounds = 0" in (tmp_path / "tree" / "targets" / "tiny.toml").read_text()
    assert testing.merged({"a": {"b": 1, "c": 2}}, {"a": {"b": 3}, "d": 4}) == {"a": {"b": 3, "c": 2}, "d": 4}
