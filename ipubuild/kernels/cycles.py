"""Terms shared by the built-in kernels' cycle estimators (the ``<kernel>_cycles.py`` files
beside each kernel's C source). An estimator is ``cycles(args, machine) -> int``: one vertex's
compute cycles from its scalar arguments (as the kernel's ``args`` array; buffer references read
as 0) and the machine description's ``compute`` constants.

The estimators model the kernels, they do not read their code: the planning phases (layout
search, storage, exchange placement) and the device profile's cycles use them, so editing one of
these files re-runs those phases; editing only a kernel's C source re-runs none of them.
"""
from __future__ import annotations

from ..graph.operators import ceil_div


def elementwise(n: int, flops_per_element: int, transcendentals: int, machine: dict) -> int:
    """``n`` elements on the vector units: the vertex overhead, ``flops_per_element`` vector flops
    an element, and ``transcendentals`` transcendental functions an element spread over the
    tile's workers."""
    c = machine["compute"]
    return (c["vertex_overhead_cycles"] + ceil_div(n * flops_per_element, c["vector_flops_per_cycle"])
            + ceil_div(n * transcendentals * c["transcendental_cycles"], machine["workers"]))


def folded_cast(n: int, machine: dict) -> int:
    """A cast to FP8 folded into a kernel, on its ``n`` output elements: the cast's 2 vector flops
    an element (as cast.c's estimator), without a vertex overhead of its own."""
    return ceil_div(n * 2, machine["compute"]["vector_flops_per_cycle"])


def folded_gelu(n: int, machine: dict) -> int:
    """A GELU folded into a kernel, on its ``n`` output elements: gelu.c's 6 vector flops and a
    tanh an element (as its estimator), without a vertex overhead of its own."""
    return elementwise(n, 6, 1, machine) - machine["compute"]["vertex_overhead_cycles"]
