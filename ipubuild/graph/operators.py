"""Operators as plugins declare them, and the registry that gathers them.

An operator says how its outputs' shapes and dtypes follow from its inputs (``infer``), what it
computes in device precision (``reference``), how it may be split over tiles (``plans``), what
each tile does under a plan (``lower``) and which C kernels it needs (``kernels``).

Lowering speaks in *blocks*: every value is seen as a 2-D matrix ``[rows, cols]`` and a block is
``(value, r0, r1, c0, c1)``. A tile's work reads blocks (each gathered into one contiguous local
buffer by the exchange before the compute phase) and writes blocks (each one contiguous local
buffer that then holds that part of the value), and runs vertices: calls of kernel variants
whose arguments are integers or references ``("r", i, byte_offset)`` / ``("w", i, byte_offset)``
to the address of its i-th read or written buffer.

An operator may also *follow* a producer: a plan ``{"follow": i}`` runs it on the tiles where
the producer of its input ``i`` wrote that input, block for block, so that input needs no
exchange. The planner turns it into a concrete plan with ``follow`` (given the producer's
blocks) before ``lower`` sees it.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import struct
from pathlib import Path
from typing import Callable

from ..engine.errors import UserError

Block = tuple  # (value key, r0, r1, c0, c1); a value key is "v<id>" or "t<op>.<n>" (a temporary)

F32_ROUNDOFF = 2.0 ** -24      # the unit roundoff of f32: a rounding's relative error is at most this


def gamma(n: int) -> float:
    """The bound on the relative error of ``n`` f32 roundings in a row (``n·u / (1 - n·u)``):
    a sum of ``n`` products in any order is within ``gamma(n)`` times the sum of their
    magnitudes of the exact one."""
    return n * F32_ROUNDOFF / (1 - n * F32_ROUNDOFF)


@dataclasses.dataclass(frozen=True)
class KernelVariant:
    """One compiled kernel: a C source with ``-D`` defines, and its cycle estimator.

    ``cycles(args, machine)`` gives the compute cycles of one vertex with these arguments; the
    cost model and the simulator's profile both use it.
    """
    name: str
    source: Path
    defines: tuple = ()
    cycles: Callable = None


@dataclasses.dataclass
class TileWork:
    """What one (logical) tile does in one stage of an operation."""
    tile: int
    reads: list
    writes: list
    vertices: list  # [(kernel variant name, [arg, ...])]


@dataclasses.dataclass
class Lowering:
    """The stages of an operation under a plan (each stage: an exchange, then compute), and
    the temporaries it needs (key -> (rows, cols, dtype))."""
    stages: list
    temps: dict = dataclasses.field(default_factory=dict)


class Operator:
    """Base class for operators; plugins subclass it and return instances from
    ``ipubuild_operators``."""

    name: str = ""

    #: how the operator can follow a producer: ``"elements"`` — each output element needs only
    #: the same element of its same-shaped inputs (and the same column of a one-row input), so
    #: it runs on any blocks (``lower`` takes ``{"blocks": [[tile, r0, r1, c0, c1], ...]}``);
    #: ``"rows"`` — the same, for blocks that span whole rows; None — it cannot (the default).
    #: Operators with other rules override ``follow_plans`` and ``follow``.
    follows: str | None = None

    def infer(self, graph, op) -> list[tuple]:
        """``[(shape, dtype, scale_exp)]`` for each output; raise ValueError for bad inputs."""
        raise NotImplementedError

    def reference(self, graph, op, inputs: list) -> list:
        """numpy outputs in device precision (fp8 values as uint8 codes)."""
        raise NotImplementedError

    def plans(self, graph, op, tile_count: int) -> list[dict]:
        """Candidate plans, the first being the default choice."""
        raise NotImplementedError

    def lower(self, graph, op, plan: dict) -> Lowering:
        raise NotImplementedError

    def kernels(self) -> list[KernelVariant]:
        return []

    def variants(self, graph, op) -> list[str]:
        """The names of the kernel variants some plan of ``op`` may call (declared by this or
        another operator's ``kernels()``). A target compiles only the variants its operations
        name here; the default, every variant of ``kernels()``, is always safe."""
        return [kv.name for kv in self.kernels()]

    def follow_plans(self, graph, op) -> list[dict]:
        """``{"follow": i}`` for each input ``i`` this operation can follow: an operation's
        output (not a constant or graph input) of the output's shape."""
        if self.follows is None:
            return []
        out = graph.values[op.outputs[0]]
        fixed = set(graph.constants) | set(graph.inputs)
        return [{"follow": i} for i, v in enumerate(op.inputs)
                if v not in fixed and graph.values[v].shape == out.shape]

    def follow(self, graph, op, position: int, blocks: list) -> dict:
        """The concrete plan that runs this operation on the tiles holding ``blocks`` (the
        ``(tile, r0, r1, c0, c1)`` blocks its producer wrote of input ``position``); raise
        ValueError if it cannot."""
        if self.follows == "rows":
            cols = graph.values[op.inputs[position]].cols
            if any((c0, c1) != (0, cols) for _, _, _, c0, c1 in blocks):
                raise ValueError("its producer splits columns and it needs whole rows")
        return {"blocks": [list(b) for b in blocks]}

    def fuses_cast(self, graph, op, dtype: str) -> bool:
        """Whether the operation can write its output as ``dtype`` directly, a cast folded
        into its kernel (no separate step, no sync). If so, a cast policy may set attributes
        ``to`` (the dtype) and ``scale_exp`` on it, and ``infer``, ``reference`` and ``lower``
        honour them, bit-exact with the operation followed by a cast."""
        return False

    def fuses_addend(self, graph, op) -> bool:
        """Whether an ``add`` of the operation's output and another value of its shape can be
        folded into it (no separate step, no sync): if so, the ``fold_adds`` pass appends
        that value to its inputs and sets attribute ``addend``, and ``infer``, ``reference`` and
        ``lower`` honour it, bit-exact with the operation followed by the add."""
        return False

    def fuses_activation(self, graph, op, activation: str) -> bool:
        """Whether the operator ``activation`` (the name of an elementwise operator of one input,
        e.g. ``"gelu"``) applied to the operation's output can be folded into it (no separate
        step, no sync): if so, the ``fold_activations`` pass sets attribute ``activation`` on it
        (and moves a cast folded into the activation to it), and ``infer``, ``reference`` and
        ``lower`` honour it, bit-exact with the operation followed by the activation."""
        return False

    def tolerance(self, graph, op, inputs: list, outputs: list) -> list:
        """How far the device's outputs may be from ``outputs`` — the reference's on the same
        ``inputs``, before any folded cast (``op`` comes without ``to``/``scale_exp``) —, one
        absolute bound per output element (an array broadcastable to it, or a number). The
        per-operation comparison (``ipubuild.compare``) fails an element beyond it; an FP8
        output must be a code that a value within it encodes to.

        Derive it from the kernel's arithmetic: accumulation order over the reduction length
        (``f32_roundoff``, ``gamma``), library functions' last bits; 0 where the kernel must be
        bit-exact with the reference. The default assumes a reduction along the last axis and
        no cancellation: each element within ``(2·cols + 8)`` f32 roundoffs of its magnitude.
        Override it for a sharper check, or where results cancel."""
        import numpy as np
        return [(2 * graph.values[v].cols + 8) * F32_ROUNDOFF * np.abs(np.asarray(o, np.float64))
                for v, o in zip(op.outputs, outputs)]

    def macs(self, graph, op) -> int:
        """Multiply-accumulates of the operation (0 for one that is not a product): with its
        output's element count, what the program-independent bound charges it."""
        return 0

    # used by ipubuild ----------------------------------------------------------------------
    def infer_types(self, graph, op) -> list[tuple]:
        try:
            return self.infer(graph, op)
        except (ValueError, KeyError, IndexError, TypeError) as exc:
            raise UserError(f"operation {op.name} ({op.type})", str(exc)) from None


def split(n: int, parts: int) -> list[tuple[int, int]]:
    """``n`` items in ``parts`` nearly equal contiguous ranges (empty ranges dropped)."""
    parts = max(1, min(parts, n))
    q, r = divmod(n, parts)
    out, start = [], 0
    for i in range(parts):
        end = start + q + (1 if i < r else 0)
        out.append((start, end))
        start = end
    return out


def f32_bits(x: float) -> int:
    return struct.unpack("<I", struct.pack("<f", x))[0]


def key(vid: int) -> str:
    return f"v{vid}"


class Registry:
    """Operators and kernel variants from every plugin, by name."""

    def __init__(self, operators: list[Operator], owners: dict[str, str]):
        self.operators = {op.name: op for op in operators}
        self.owners = owners
        self.kernels: dict[str, KernelVariant] = {}
        for op in operators:
            for kv in op.kernels():
                known = self.kernels.setdefault(kv.name, kv)
                if (Path(known.source), known.defines) != (Path(kv.source), kv.defines):
                    raise UserError(f"plugin {owners.get(op.name, op.name)}", f"kernel variant {kv.name!r} of "
                                    f"operator {op.name} is already declared with another source or defines; "
                                    "give it another name")

    def get(self, name: str, where: str = "graph") -> Operator:
        try:
            return self.operators[name]
        except KeyError:
            raise UserError(where, f"unknown operator {name!r}; known: "
                            f"{', '.join(sorted(self.operators))}") from None


@functools.lru_cache(maxsize=None)
def _registry(pm) -> Registry:
    operators, owners = [], {}
    for plugin, o in pm.collect("ipubuild_operators", lambda o: isinstance(o, Operator),
                                "a list of ipubuild.operators.Operator"):
        if o.name in owners:
            raise UserError(f"plugin {plugin}", f"hook ipubuild_operators: operator "
                            f"{o.name!r} is already registered by {owners[o.name]}")
        owners[o.name] = plugin
        operators.append(o)
    return Registry(operators, owners)


def registry() -> Registry:
    from ..plugins import get_plugin_manager
    return _registry(get_plugin_manager())


#: the column-block width ``aligned_counts`` cuts a matmul's N into multiples of
ALIGNED_COLUMNS = 32


def aligned_counts(n: int, tile_count: int) -> list[int]:
    """The column counts (up to ``tile_count``) that cut ``n`` columns into equal blocks of a
    whole number of ``ALIGNED_COLUMNS``."""
    return [d for d in range(1, min(n, tile_count) + 1) if n % d == 0 and (n // d) % ALIGNED_COLUMNS == 0]


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def prod(xs) -> int:
    return math.prod(xs)
