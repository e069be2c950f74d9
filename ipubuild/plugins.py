"""Finding and loading plugins, and naming them in action keys and errors.

Built-in features and third-party plugins alike are found through the ``ipubuild`` entry-point
group; ``IPUBUILD_PLUGINS`` (comma-separated module names) adds modules by name, which is how a
test registers a plugin "the same way entry points would" without installing it.
``IPUBUILD_DISABLE_PLUGIN_AUTOLOAD=1`` loads no installed third-party plugin (only the built-in
ones and those ``IPUBUILD_PLUGINS`` names), as ``PYTEST_DISABLE_PLUGIN_AUTOLOAD`` does for
pytest: to tell whether a plugin causes a problem, or to test against the built-ins alone.
"""
from __future__ import annotations

import functools
import importlib
import importlib.metadata
import os

import pluggy

from . import hookspecs
from .engine.errors import UserError
from .engine.fingerprint import code_fingerprint

BUILTIN_MODULES = ("ipubuild.builtin.operators", "ipubuild.builtin.vit", "ipubuild.builtin.casts",
                   "ipubuild.builtin.passes", "ipubuild.builtin.heuristics", "ipubuild.builtin.simulator",
                   "ipubuild.builtin.httpcache", "ipubuild.builtin.onnx")


class PluginManager(pluggy.PluginManager):
    """pluggy's manager plus fingerprints and one-line errors that name the plugin."""

    def __init__(self):
        super().__init__("ipubuild")
        self.add_hookspecs(hookspecs)
        self.dists: dict[str, tuple[str, str]] = {}   # plugin name -> (distribution, version)

    def load(self, extra=(), autoload: bool = True):
        for name in BUILTIN_MODULES:
            self._register_module(name, ("ipubuild", _version("ipubuild")))
        for ep in sorted(importlib.metadata.entry_points(group="ipubuild"), key=lambda e: e.name):
            if ep.value in BUILTIN_MODULES or not autoload:
                continue
            try:
                module = ep.load()
            except Exception as exc:  # noqa: BLE001 - a broken plugin is named, not a traceback
                raise UserError(f"plugin {ep.name} ({ep.value})", f"failed to import: {exc}") from exc
            dist = ep.dist.name if ep.dist else ep.value
            self._register(module, (dist, ep.dist.version if ep.dist else "0"))
        for name in extra:
            self._register_module(name, (name, "0"))
        try:
            self.check_pending()
        except pluggy.PluginValidationError as exc:
            raise UserError(f"plugin {exc.plugin}", f"{exc}; see ipubuild/hookspecs.py") from exc
        return self

    def _register_module(self, name, dist):
        try:
            module = importlib.import_module(name)
        except Exception as exc:  # noqa: BLE001
            raise UserError(f"plugin {name}", f"failed to import: {exc}") from exc
        self._register(module, dist)

    def _register(self, module, dist):
        if self.is_registered(module):
            return
        try:
            self.register(module, name=module.__name__)
        except (pluggy.PluginValidationError, ValueError) as exc:
            raise UserError(f"plugin {module.__name__}", str(exc)) from exc
        self.dists[module.__name__] = dist

    @functools.lru_cache(maxsize=None)
    def fingerprints(self, hooks: tuple[str, ...]) -> dict[str, str]:
        """``{plugin: "dist==version:code"}`` for the plugins implementing any of ``hooks``."""
        out = {}
        for hook in hooks:
            for impl in getattr(self.hook, hook).get_hookimpls():
                name = impl.plugin_name
                dist, version = self.dists.get(name, (name, "0"))
                out[name] = f"{dist}=={version}:{code_fingerprint(name)}"
        return dict(sorted(out.items()))

    def collect(self, hook: str, check, expected: str, *, mapping: bool = False):
        """Every plugin's result of a registration hook (one without arguments), checked.

        List hooks give ``[(plugin, item), ...]``; mapping hooks (``mapping=True``) a merged
        ``{name: item}`` in which a name declared twice is an error naming both plugins. A
        plugin that raises, or returns something that is not a list (dict) of items passing
        ``check``, is named in a one-line error with the hook and ``expected``.
        """
        out: list | dict = {} if mapping else []
        owners: dict[str, str] = {}
        for impl in sorted(getattr(self.hook, hook).get_hookimpls(), key=lambda i: i.plugin_name):
            try:
                got = impl.function()
            except UserError:
                raise
            except Exception as exc:  # noqa: BLE001
                raise UserError(f"plugin {impl.plugin_name}",
                                f"hook {hook} raised {type(exc).__name__}: {exc}") from None
            items = got.items() if mapping and isinstance(got, dict) else got
            shape_ok = isinstance(got, dict) if mapping else isinstance(got, (list, tuple))
            if not shape_ok or not all(check(v[1] if mapping else v) and (not mapping or isinstance(v[0], str))
                                       for v in items):
                raise UserError(f"plugin {impl.plugin_name}", f"hook {hook} must return {expected}")
            if not mapping:
                out.extend((impl.plugin_name, v) for v in got)
                continue
            for name, value in got.items():
                if name in owners:
                    raise UserError(f"plugin {impl.plugin_name}", f"hook {hook}: {name!r} is already "
                                    f"registered by {owners[name]}")
                owners[name] = impl.plugin_name
                out[name] = value
        return out

    #: what each registration hook registers, as ``doit plugins`` lists it: (label, names of a result)
    REGISTRATIONS = {
        "ipubuild_operators": ("operators", lambda got: [o.name for o in got]),
        "ipubuild_model_families": ("model families", list),
        "ipubuild_cast_policies": ("cast policies", list),
        "ipubuild_graph_passes": ("graph passes", lambda got: [
            f"{p.name} ({p.stage}{', default' if p.default else ''})" for p in got]),
        "ipubuild_search_heuristics": ("search heuristics", lambda got: [h.name for h in got]),
        "ipubuild_device_backends": ("devices", list),
        "ipubuild_cache_backends": ("cache backends", lambda got: [f"{s}://" for s in got]),
        "ipubuild_targets": ("targets", lambda got: [os.path.splitext(os.path.basename(str(p)))[0] for p in got]),
    }

    def registrations(self, plugin: str) -> list[tuple[str, str]]:
        """What plugin module ``plugin`` registers: ``[(label, "name, name, …")]`` in the order
        of ``REGISTRATIONS``, for the hooks it implements (a hook that fails says so)."""
        out = []
        for hook, (label, names) in self.REGISTRATIONS.items():
            for impl in getattr(self.hook, hook).get_hookimpls():
                if impl.plugin_name != plugin:
                    continue
                try:
                    listed = ", ".join(str(n) for n in names(impl.function())) or "(none)"
                except Exception as exc:  # noqa: BLE001 - shown, not raised: the listing goes on
                    listed = f"error: {type(exc).__name__}: {exc}"
                out.append((label, listed))
        return out

    def call(self, hook: str, **kwargs):
        """Call a hook; a plugin that raises is named with the hook in a one-line error."""
        caller = getattr(self.hook, hook)
        try:
            return caller(**kwargs)
        except UserError:
            raise
        except Exception as exc:  # noqa: BLE001
            culprit = self.culprit(exc) or "a plugin"
            raise UserError(f"plugin {culprit}", f"hook {hook} raised {type(exc).__name__}: {exc}") from exc

    def culprit(self, exc: BaseException) -> str | None:
        """The registered plugin whose code raised ``exc`` (its innermost frame in a plugin
        module, or in a module of a third-party plugin's own package), if any."""
        names = [n for n, _ in self.list_name_plugin()]
        packages = [(n, n.rpartition(".")[0] + ".") for n in names if not n.startswith("ipubuild.") and "." in n]
        tb, found = exc.__traceback__, None
        while tb is not None:
            mod = tb.tb_frame.f_globals.get("__name__", "")
            if mod in names:
                found = mod
            else:
                found = next((n for n, prefix in packages if mod.startswith(prefix)), found)
            tb = tb.tb_next
        return found


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "0"


@functools.lru_cache(maxsize=None)
def _manager(extra: tuple[str, ...], autoload: bool = True) -> PluginManager:
    return PluginManager().load(extra, autoload)


def get_plugin_manager() -> PluginManager:
    """The process's plugin manager, with ``$IPUBUILD_PLUGINS`` modules added (and no
    installed third-party plugin under ``$IPUBUILD_DISABLE_PLUGIN_AUTOLOAD``)."""
    extra = tuple(m for m in os.environ.get("IPUBUILD_PLUGINS", "").split(",") if m)
    return _manager(extra, os.environ.get("IPUBUILD_DISABLE_PLUGIN_AUTOLOAD", "") in ("", "0"))
