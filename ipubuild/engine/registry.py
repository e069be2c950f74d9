"""What the engine reaches by name, never by import: the one table of it.

Phases register where they are defined (``engine.phase``). A process that must know every phase
— a target's steps, a cluster worker — calls ``load_phases()``, which imports the modules of
``PHASE_MODULES`` (in this order, which is the order their phases register in); no module
imports another only to have its phases registered.

Two backends of the engine sit in upper layers, because they use plugins or the compiler: the
store's shared cache tier (``SHARED_TIER``, when ``$IPUBUILD_REMOTE_CACHE`` is set) and the
cluster that executors send work to (``CLUSTER``, when ``$IPUBUILD_SCHEDULER`` is set). The
engine names them here and imports them only when they are configured, as plugins are named
by entry points: their code is not the engine's, and a no-op build never imports them. So is the
codec of planning artifacts that carry arrays (``PLAN_CODEC``): it needs numpy, which the engine
does not import; the engine hands it the blobs that begin with ``canonical.PLAN_MAGIC``.
"""
from __future__ import annotations

import importlib

PHASE_MODULES = (
    "ipubuild.compiler.kernels",          # compile_kernel, compile_counted_kernel, compile_kernels
    "ipubuild.device.compare",
    "ipubuild.device.device",
    "ipubuild.graph.frontend",
    "ipubuild.build.kernel_profile",
    "ipubuild.device.package",
    "ipubuild.graph.reference",
    "ipubuild.ui.report",
    "ipubuild.compiler.search",
    "ipubuild.compiler.planning.phases",
    "ipubuild.compiler.weights",          # strip_values, bind_values
    "ipubuild.device.onnxruntime_ref",    # compare_onnxruntime
)
SHARED_TIER = "ipubuild.remote"           # the store's remote cache tier
CLUSTER = "ipubuild.remote.cluster"       # where executors send work (imports distributed)
PLAN_CODEC = "ipubuild.graph.artifacts"   # reads the planning artifacts that carry arrays (numpy)


def load_phases() -> None:
    """Register every phase (importing a module twice is free)."""
    for name in PHASE_MODULES:
        importlib.import_module(name)


def load(name: str):
    """One of the backends above, imported now."""
    return importlib.import_module(name)
