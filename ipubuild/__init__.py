"""ipubuild: a content-addressed, plugin-based build system for a tile-processor ML compiler.

Plugins import ``hookimpl`` from here; the contract they implement is ``ipubuild.hookspecs``.
"""
__version__ = "0.1.0"

__all__ = ["hookimpl", "__version__"]


def __getattr__(name):
    # pluggy is imported when a plugin first asks for ``hookimpl``, not by every ``doit`` run
    if name == "hookimpl":
        import pluggy
        global hookimpl
        hookimpl = pluggy.HookimplMarker("ipubuild")
        return hookimpl
    raise AttributeError(f"module 'ipubuild' has no attribute {name!r}")
