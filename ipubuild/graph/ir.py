"""The graph IR: SSA values with shapes and dtypes, and operations over them.

Dtypes: ``f32``, ``f16``, ``f143`` and ``f152`` (Graphcore FP8, stored as uint8 codes with a
tensor-wide power-of-two ``scale_exp``). Every value is also seen as a 2-D matrix
``[rows, cols]`` = ``[prod(shape[:-1]), shape[-1]]``: plans split values into row/column blocks.
"""
from __future__ import annotations

import dataclasses
import math

from ..engine import canonical

DTYPES = {"f32": 4, "f16": 2, "f143": 1, "f152": 1}
FP8 = ("f143", "f152")


@dataclasses.dataclass
class Value:
    id: int
    name: str
    shape: tuple[int, ...]
    dtype: str
    scale_exp: int = 0

    @property
    def rows(self) -> int:
        return math.prod(self.shape[:-1]) if len(self.shape) > 1 else 1

    @property
    def cols(self) -> int:
        return self.shape[-1] if self.shape else 1

    @property
    def itemsize(self) -> int:
        return DTYPES[self.dtype]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.itemsize


@dataclasses.dataclass
class Op:
    id: int
    type: str
    name: str
    inputs: list[int]
    outputs: list[int]
    attrs: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class CastStoragePolicy:
    """How cast outputs are stored: ``separate`` buffers or ``inplace`` over their input."""
    default: str = "separate"
    operators: dict = dataclasses.field(default_factory=dict)
    sites: dict = dataclasses.field(default_factory=dict)

    def for_site(self, op: Op) -> str:
        return self.sites.get(op.name, self.operators.get(op.type, self.default))

    def __str__(self) -> str:
        def m(d):
            return "{" + ", ".join(f"{k}: {v.capitalize()}" for k, v in sorted(d.items())) + "}"
        return (f"CastStoragePolicy {{ default: {self.default.capitalize()}, "
                f"operators: {m(self.operators)}, sites: {m(self.sites)} }}")


class Graph:
    """Values and operations in topological order; inputs, outputs and constants by value id."""

    def __init__(self):
        self.values: dict[int, Value] = {}
        self.ops: list[Op] = []
        self.inputs: list[int] = []
        self.outputs: list[int] = []
        self.constants: list[int] = []
        self.cast_storage = CastStoragePolicy()

    # building -------------------------------------------------------------------------------
    def value(self, name: str, shape, dtype: str, scale_exp: int = 0) -> int:
        if dtype not in DTYPES:
            raise ValueError(f"value {name}: unknown dtype {dtype!r}; expected one of {list(DTYPES)}")
        vid = len(self.values)
        self.values[vid] = Value(vid, name, tuple(int(s) for s in shape), dtype, scale_exp)
        return vid

    def input(self, name: str, shape, dtype="f32") -> int:
        vid = self.value(name, shape, dtype)
        self.inputs.append(vid)
        return vid

    def constant(self, name: str, shape, dtype="f32") -> int:
        vid = self.value(name, shape, dtype)
        self.constants.append(vid)
        return vid

    def add(self, type: str, inputs, name: str | None = None, **attrs) -> int:
        """Append an operation whose output types its operator infers; returns the output id
        (an operation's outputs are named ``<name>``, ``<name>.out1``, …)."""
        return self.insert(len(self.ops), type, inputs, name, **attrs)

    def insert(self, index: int, type: str, inputs, name: str | None = None, **attrs) -> int:
        """Insert an operation at position ``index`` of ``ops`` (before the operation now
        there), its output types inferred as ``add`` does; returns its first output's id. The
        caller keeps the order topological: insert after the producers of ``inputs``."""
        from .operators import registry
        op = Op(index, type, name or f"{type}_{len(self.ops)}", list(inputs), [], attrs)
        out_types = registry().get(type, where=f"operation {op.name}").infer_types(self, op)
        for i, (shape, dtype, scale) in enumerate(out_types):
            op.outputs.append(self.value(f"{op.name}.out{i}" if i else op.name, shape, dtype, scale))
        self.ops.insert(index, op)
        if index != len(self.ops) - 1:
            self.renumber()
        return op.outputs[0]

    def insert_before(self, index: int, op: Op) -> None:
        self.ops.insert(index, op)
        self.renumber()

    def renumber(self) -> None:
        for i, op in enumerate(self.ops):
            op.id = i

    # rewriting (graph passes) ---------------------------------------------------------------
    def replace_op(self, op: Op | str, type: str, inputs, *, name: str | None = None, **attrs) -> None:
        """Make ``op`` (an operation, or its name) an operation of ``type`` reading ``inputs``
        with attributes ``attrs``, in place: its outputs keep their ids, their types inferred
        again (call ``infer`` if that changed a dtype or shape others read). It keeps its name
        unless ``name`` gives a new one (its outputs then are ``<name>``, ``<name>.out1``, …).
        ValueError if ``type`` gives another number of outputs, or no operation has that name."""
        from .operators import registry
        if isinstance(op, str):
            found = [o for o in self.ops if o.name == op]
            if not found:
                raise ValueError(f"replace_op: no operation named {op!r}")
            op = found[0]
        new = Op(op.id, type, name or op.name, list(inputs), list(op.outputs), dict(attrs))
        types = registry().get(type, where=f"operation {op.name}").infer_types(self, new)
        if len(types) != len(op.outputs):
            raise ValueError(f"operation {op.name}: a {type} gives {len(types)} outputs, not {len(op.outputs)}")
        op.type, op.inputs, op.attrs, op.name = type, new.inputs, new.attrs, new.name
        for i, (vid, (shape, dtype, scale)) in enumerate(zip(op.outputs, types)):
            v = self.values[vid]
            v.shape, v.dtype, v.scale_exp = tuple(shape), dtype, scale
            if name:
                v.name = f"{name}.out{i}" if i else name

    def replace_uses(self, old: int, new: int, skip=()) -> int:
        """Make every operation that reads value ``old`` (but the operations in ``skip``) read
        ``new`` instead, and a graph output ``old`` be ``new``; returns how many uses changed."""
        skipped = {id(op) for op in skip}
        changed = 0
        for op in self.ops:
            if id(op) in skipped:
                continue
            for i, v in enumerate(op.inputs):
                if v == old:
                    op.inputs[i] = new
                    changed += 1
        for i, v in enumerate(self.outputs):
            if v == old:
                self.outputs[i] = new
                changed += 1
        return changed

    def infer(self) -> None:
        """Infer every operation's output shapes, dtypes and ``scale_exp`` again from its inputs
        and attributes, in order (after a rewrite changed what they read, or an attribute such
        as a cast's ``scale_exp``)."""
        from .operators import registry
        reg = registry()
        for op in self.ops:
            types = reg.get(op.type, where=f"operation {op.name}").infer_types(self, op)
            for vid, (shape, dtype, scale) in zip(op.outputs, types):
                v = self.values[vid]
                v.shape, v.dtype, v.scale_exp = tuple(shape), dtype, scale

    def stale(self) -> list[str]:
        """The outputs whose recorded shape, dtype or ``scale_exp`` is not what their operation
        infers from its inputs and attributes now (``infer`` was not called after a change)."""
        from .operators import registry
        reg = registry()
        out = []
        for op in self.ops:
            types = reg.get(op.type, where=f"operation {op.name}").infer_types(self, op)
            for vid, (shape, dtype, scale) in zip(op.outputs, types):
                v = self.values[vid]
                if (v.shape, v.dtype, v.scale_exp) != (tuple(shape), dtype, scale):
                    out.append(f"operation {op.name}: value {v.name} is {list(v.shape)} {v.dtype} scale_exp "
                               f"{v.scale_exp}, but its inputs and attributes give {list(shape)} {dtype} "
                               f"scale_exp {scale}: call graph.infer() after changing them")
        return out

    def remove_unused(self) -> dict[int, int]:
        """Remove the operations whose outputs nothing reads and no graph output is, then every
        value no remaining operation defines or reads (graph inputs stay); number the remaining
        values 0, 1, … in their order and the operations too. Returns ``{old id: new id}`` of
        the values kept (apply it to anything keyed by value id: constants, example inputs)."""
        live = set(self.outputs)
        kept_ops = []
        for op in reversed(self.ops):
            if live.intersection(op.outputs):
                kept_ops.append(op)
                live.update(op.inputs)
        kept_ops.reverse()
        used = set(self.inputs) | {v for op in kept_ops for v in (*op.inputs, *op.outputs)}
        renumbered = {old: new for new, old in enumerate(sorted(v for v in self.values if v in used))}
        if len(kept_ops) == len(self.ops) and all(k == v for k, v in renumbered.items()) \
                and len(renumbered) == len(self.values):
            return renumbered
        self.values = {renumbered[v]: dataclasses.replace(val, id=renumbered[v])
                       for v, val in self.values.items() if v in renumbered}
        for op in kept_ops:
            op.inputs = [renumbered[v] for v in op.inputs]
            op.outputs = [renumbered[v] for v in op.outputs]
        self.ops = kept_ops
        self.renumber()
        self.inputs = [renumbered[v] for v in self.inputs]
        self.outputs = [renumbered[v] for v in self.outputs]
        self.constants = [renumbered[v] for v in self.constants if v in renumbered]
        return renumbered

    # queries --------------------------------------------------------------------------------
    def producer(self) -> dict[int, Op]:
        return {v: op for op in self.ops for v in op.outputs}

    def consumers(self) -> dict[int, list[Op]]:
        out: dict[int, list[Op]] = {v: [] for v in self.values}
        for op in self.ops:
            for v in op.inputs:
                out[v].append(op)
        return out

    def validate(self, types: bool = True) -> None:
        """Check SSA form and topological order, and (``types``) that every output's shape, dtype
        and ``scale_exp`` are what its operation infers (``stale``); errors name the operation
        and the value."""
        defined = set(self.inputs) | set(self.constants)
        for op in self.ops:
            for v in op.inputs:
                if v not in self.values:
                    raise ValueError(f"operation {op.name}: input {v} is not a value")
                if v not in defined:
                    raise ValueError(f"operation {op.name}: input {self.values[v].name} is used "
                                     "before it is defined")
            for v in op.outputs:
                if v in defined:
                    raise ValueError(f"operation {op.name}: value {self.values[v].name} is defined twice")
                defined.add(v)
        for v in self.outputs:
            if v not in defined:
                raise ValueError(f"graph output {self.values[v].name if v in self.values else v} is never defined")
        if types:
            problems = self.stale()
            if problems:
                raise ValueError(problems[0] + (f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""))

    # serialisation --------------------------------------------------------------------------
    def to_json(self) -> dict:
        return {
            "values": [[v.id, v.name, list(v.shape), v.dtype, v.scale_exp] for v in self.values.values()],
            "ops": [[o.id, o.type, o.name, o.inputs, o.outputs, o.attrs] for o in self.ops],
            "inputs": self.inputs, "outputs": self.outputs, "constants": self.constants,
            "cast_storage": dataclasses.asdict(self.cast_storage),
        }

    @classmethod
    def from_json(cls, data: dict) -> "Graph":
        g = cls()
        for vid, name, shape, dtype, scale in data["values"]:
            g.values[vid] = Value(vid, name, tuple(shape), dtype, scale)
        g.ops = [Op(i, t, n, list(ins), list(outs), dict(a)) for i, t, n, ins, outs, a in data["ops"]]
        g.inputs, g.outputs, g.constants = list(data["inputs"]), list(data["outputs"]), list(data["constants"])
        g.cast_storage = CastStoragePolicy(**data["cast_storage"])
        return g

    def to_bytes(self) -> bytes:
        return canonical.dumps(self.to_json())

    def digest(self) -> str:
        return canonical.digest(self.to_bytes())
