"""The graph: what a model is, before any tile.

Owns the IR (``ir``), operators and their registry (``operators``), front ends (``frontend``),
graph passes (``passes``), the host reference (``reference``), FP8 (``fp8``), tensor bytes
(``tensors``) and the artifacts that carry a graph or parameters (``artifacts``).

May import: ``ipubuild.engine``, ``ipubuild.plugins``/``hookspecs``; numpy.
"""
