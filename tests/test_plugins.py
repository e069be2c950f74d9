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
