"""The compiler: from a graph and a machine to tile programs, and the search for a layout.

Owns placement, the estimator, the layout search, planning (``planning/``: storage, exchange,
codegen, cost, the planning phases), machine descriptions (``machine``), target files
(``targets``) and the kernel compiles (``kernels``; the C sources and cycle estimators stay in
``ipubuild/kernels/`` where kernel developers edit them).

May import: ``ipubuild.engine``, ``ipubuild.plugins``/``hookspecs``, ``ipubuild.graph``,
``ipubuild.kernels``.
"""
