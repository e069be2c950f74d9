"""The build: a target's steps, run by doit or in process.

Owns the steps of a target (``build``), the pipeline and workspace (``pipeline``), the doit tasks
and commands (``tasks``, ``commands``), the analysis and its cache (``analysis``, ``taskcache``),
``explain`` and kernel measurement (``kernel_profile``, which runs the built-in simulator's
loader).

May import: every layer below — engine, plugins/hookspecs, graph, kernels, compiler, device, ui,
remote — and ``ipubuild.builtin``; doit.
"""


def __getattr__(name):   # the names of the module this folder replaced (ipubuild/build.py), for a release
    from .. import moved_attribute
    return moved_attribute(__name__, name)
