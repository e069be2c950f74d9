"""ipubuild: a content-addressed, plugin-based build system for a tile-processor ML compiler.

Plugins import ``hookimpl`` from here; the contract they implement is ``ipubuild.hookspecs``.
"""
import pluggy

__version__ = "0.1.0"

hookimpl = pluggy.HookimplMarker("ipubuild")

__all__ = ["hookimpl", "__version__"]
