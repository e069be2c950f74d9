"""ipubuild: a content-addressed, plugin-based build system for a tile-processor ML compiler.

Plugins import ``hookimpl`` from here; the contract they implement is ``ipubuild.hookspecs``.

The package is laid out in layers, one folder each (docs/architecture.md, "Layers"). The flat
module paths of the first edition (``ipubuild.store``, ``ipubuild.search``, …) are served from
``MOVED`` below, the one alias table: an old path imports the very module object (and file) of
its new path, so code fingerprints, monkeypatching and ``isinstance`` see one module. The paths
docs/reference.md and docs/plugins.md name are public and stay; the others warn
(``DeprecationWarning``) for one release.
"""
import sys

__version__ = "0.1.0"

__all__ = ["hookimpl", "__version__"]

# old path -> new path: every module the layering moved
MOVED = {
    "ipubuild.engine": "ipubuild.engine.engine", "ipubuild.store": "ipubuild.engine.store",
    "ipubuild.fingerprint": "ipubuild.engine.fingerprint", "ipubuild.files": "ipubuild.engine.files",
    "ipubuild.canonical": "ipubuild.engine.canonical", "ipubuild.log": "ipubuild.engine.log",
    "ipubuild.errors": "ipubuild.engine.errors", "ipubuild.executors": "ipubuild.engine.executors",
    "ipubuild.ir": "ipubuild.graph.ir", "ipubuild.operators": "ipubuild.graph.operators",
    "ipubuild.frontend": "ipubuild.graph.frontend", "ipubuild.passes": "ipubuild.graph.passes",
    "ipubuild.reference": "ipubuild.graph.reference", "ipubuild.fp8": "ipubuild.graph.fp8",
    "ipubuild.tensors": "ipubuild.graph.tensors", "ipubuild.artifacts": "ipubuild.graph.artifacts",
    "ipubuild.placement": "ipubuild.compiler.placement", "ipubuild.estimator": "ipubuild.compiler.estimator",
    "ipubuild.search": "ipubuild.compiler.search", "ipubuild.machine": "ipubuild.compiler.machine",
    "ipubuild.targets": "ipubuild.compiler.targets", "ipubuild.kernels": "ipubuild.compiler.kernels",
    "ipubuild.planning": "ipubuild.compiler.planning",
    "ipubuild.package": "ipubuild.device.package", "ipubuild.device": "ipubuild.device.device",
    "ipubuild.compare": "ipubuild.device.compare", "ipubuild.verdict": "ipubuild.device.verdict",
    "ipubuild.build": "ipubuild.build.build", "ipubuild.pipeline": "ipubuild.build.pipeline",
    "ipubuild.tasks": "ipubuild.build.tasks", "ipubuild.commands": "ipubuild.build.commands",
    "ipubuild.analysis": "ipubuild.build.analysis", "ipubuild.taskcache": "ipubuild.build.taskcache",
    "ipubuild.explain": "ipubuild.build.explain", "ipubuild.kernel_profile": "ipubuild.build.kernel_profile",
    "ipubuild.cluster": "ipubuild.remote.cluster",
    "ipubuild.console": "ipubuild.ui.console", "ipubuild.progress": "ipubuild.ui.progress",
    "ipubuild.report": "ipubuild.ui.report", "ipubuild.report_page": "ipubuild.ui.report_page",
}
# documented paths (docs/reference.md, docs/plugins.md; ``ipubuild.tasks`` is every dodo.py's
# first line): served without a warning
PUBLIC = {"ipubuild.operators", "ipubuild.ir", "ipubuild.frontend", "ipubuild.passes", "ipubuild.search",
          "ipubuild.device", "ipubuild.package", "ipubuild.targets", "ipubuild.errors", "ipubuild.log",
          "ipubuild.fp8", "ipubuild.estimator", "ipubuild.tasks"}
# folders that took the name of a module they replaced: their attributes come from that module
# (ipubuild/kernels/ has no __init__.py, so that git sees the kernel compiles move to
# compiler/kernels.py; the finder below makes it a package whose names are that module's)
FOLDER_OF_MODULE = ("ipubuild.engine", "ipubuild.device", "ipubuild.build", "ipubuild.kernels")


def _warn(old: str, new: str, level: int = 3) -> None:
    if old not in PUBLIC:
        import warnings
        warnings.warn(f"{old} moved to {new}; import it from there ({old} goes in the next release)",
                      DeprecationWarning, stacklevel=level)


def _target(old: str) -> str | None:
    """The new path of an old module path (``ipubuild.planning.phases`` too), or None."""
    head, tail = old, ""
    while head not in MOVED:
        head, _, last = head.rpartition(".")
        if not head:
            return None
        tail = f".{last}{tail}"
    return MOVED[head] + tail


class _Aliases:
    """The meta-path finder behind ``MOVED``: ``import ipubuild.store`` gives the module
    ``ipubuild.engine.store`` itself (one object in ``sys.modules`` under both names)."""

    @classmethod
    def find_spec(cls, name, path=None, target=None):
        if name == "ipubuild.kernels":   # the C kernels' folder: a package with no __init__.py
            import importlib.machinery
            import os
            spec = importlib.machinery.ModuleSpec(name, cls, is_package=True)
            spec.submodule_search_locations = [os.path.join(os.path.dirname(__file__), "kernels")]
            return spec
        if not name.startswith("ipubuild.") or any(name == f or name.startswith(f + ".") for f in FOLDER_OF_MODULE):
            return None     # a folder's own modules are where they are
        new = _target(name)
        if new is None or new == name:
            return None
        import importlib.util
        real = importlib.util.find_spec(new)
        if real is None:
            return None
        spec = importlib.util.spec_from_loader(name, cls, origin=real.origin,
                                               is_package=real.submodule_search_locations is not None)
        spec.has_location = real.has_location   # fingerprints find the same file under either name
        spec.loader_state = new
        return spec

    @staticmethod
    def create_module(spec):
        return None

    @staticmethod
    def exec_module(module):
        import importlib
        spec = module.__spec__
        if spec.loader_state is None:    # ipubuild.kernels
            module.__doc__ = "The C kernels and their cycle estimators (ipubuild/kernels/README.md)."
            module.__getattr__ = lambda name: moved_attribute(spec.name, name)
            return
        _warn(spec.name, spec.loader_state)
        sys.modules[spec.name] = importlib.import_module(spec.loader_state)   # the import returns this one


sys.meta_path.insert(0, _Aliases)


def moved_attribute(folder: str, name: str):
    """An attribute of a folder that took a module's name (``ipubuild.engine.Engine``): the
    module's (``ipubuild.engine.engine.Engine``), with the warning its path carries."""
    import importlib
    import os
    here = list(sys.modules[folder].__path__)[0]
    if name.startswith("__") or os.path.exists(os.path.join(here, name + ".py")) \
            or os.path.isdir(os.path.join(here, name)):
        raise AttributeError(f"module {folder!r} has no attribute {name!r}")   # a submodule: import it
    module = importlib.import_module(MOVED[folder])
    try:
        value = getattr(module, name)
    except AttributeError:
        raise AttributeError(f"module {folder!r} has no attribute {name!r}") from None
    _warn(folder, MOVED[folder], 4)
    return value


def __getattr__(name):
    # pluggy is imported when a plugin first asks for ``hookimpl``, not by every ``doit`` run
    if name == "hookimpl":
        import pluggy
        global hookimpl
        hookimpl = pluggy.HookimplMarker("ipubuild")
        return hookimpl
    raise AttributeError(f"module 'ipubuild' has no attribute {name!r}")
