"""ipubuild-rmsnorm: an example third-party ipubuild plugin.

The hooks live in :mod:`ipubuild_rmsnorm.plugin`, which the ``ipubuild`` entry point names; the
tile kernel is ``rmsnorm.c`` beside it.
"""
__version__ = "0.1.0"
