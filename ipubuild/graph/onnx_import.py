"""The ONNX front end: an exported model file, with its trained weights, as ipubuild's graph.

``import_model`` reads the file with the ``onnx`` package (checker, opset, shape inference with
the batch fixed), then runs the import as passes over a small ONNX-level graph:

1. ``constants`` — ``Constant`` nodes become initializers;
2. ``fold`` — nodes whose inputs are all constants (the shape arithmetic exporters emit:
   ``Shape``/``Gather``/``Concat``/``Reshape``/``ConstantOfShape``/``Expand``/``Where``/``Equal``/
   ``Cast``/…) are evaluated with numpy, and ``Shape`` of a statically shaped tensor folds too;
3. ``identities`` — ``Identity`` and (inference) ``Dropout`` are dropped;
4. ``convert`` — every remaining node, in order, through its converter (the built-in ones in
   ``ipubuild.builtin.onnx``, a plugin's through ``ipubuild_onnx_converters``), which builds
   ipubuild operations.

Converters see each ONNX tensor as an *entry*: a value of the ipubuild graph (``Val``: its data,
row-major, is the tensor's), an ONNX constant (``Const``) or a *form* (``Form``): a partial result
that only a following node completes — a MatMul waiting for its bias, the pieces of an
Erf-GELU, of a decomposed layer norm, the heads of a fused QKV, attention scores waiting for their
scale. That is how the decomposed forms exporters emit are recognised without matching fixed
node sequences. A form that a node cannot take is *materialised* (a MatMul without bias becomes
one) or, if ipubuild has no operator for it, is one line naming the node.

Everything here works on whole arrays (no per-element Python): importing a ViT-B/16 file is
dominated by protobuf parsing and one copy of each weight.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Callable

import numpy as np

from ..engine.errors import UserError
from .frontend import Model
from .ir import Graph

HOOK_DOC = "a plugin can add one with ipubuild_onnx_converters (docs/plugins.md)"


class ConversionError(ValueError):
    """Raised by a converter for a node it cannot convert (reported naming the node)."""


# the ONNX-level graph ----------------------------------------------------------------------------
@dataclasses.dataclass
class Node:
    """One ONNX node: ``op_type`` in ``domain`` (``""`` is the default ONNX domain) at the
    model's ``opset`` for that domain; ``attrs`` decoded to Python values (tensors as numpy)."""
    name: str
    op_type: str
    domain: str
    inputs: list
    outputs: list
    attrs: dict
    opset: int

    def attr(self, key, default=None):
        return self.attrs.get(key, default)


@dataclasses.dataclass
class OnnxGraph:
    nodes: list
    consts: dict            # tensor name -> numpy array (initializers, folded constants)
    shapes: dict            # tensor name -> tuple of ints (None where unknown)
    inputs: list            # [(name, shape)]
    outputs: list           # [name]
    opsets: dict            # domain -> version


def _attr_value(a):
    from onnx import helper, numpy_helper
    v = helper.get_attribute_value(a)
    if isinstance(v, bytes):
        return v.decode()
    if hasattr(v, "dims") and hasattr(v, "data_type"):
        return numpy_helper.to_array(v)
    if isinstance(v, list) and v and isinstance(v[0], bytes):
        return [x.decode() for x in v]
    return v


def tensor_array(t, external: dict | None = None) -> np.ndarray:
    """An initializer as a numpy array: raw data viewed in place (one copy), external data read
    from ``external`` (``{location: bytes}``)."""
    from onnx import TensorProto, helper, numpy_helper
    if t.data_location == TensorProto.EXTERNAL:
        info = {e.key: e.value for e in t.external_data}
        loc = info.get("location", "")
        if external is None or loc not in external:
            raise ConversionError(f"initializer {t.name}: its external data file {loc!r} is missing")
        blob = external[loc]
        dtype = np.dtype(helper.tensor_dtype_to_np_dtype(t.data_type)).newbyteorder("<")
        count = math.prod(t.dims)
        offset = int(info.get("offset", 0))
        if offset + count * dtype.itemsize > len(blob):
            raise ConversionError(f"initializer {t.name}: its external data in {loc!r} is truncated")
        return np.frombuffer(blob, dtype=dtype, count=count, offset=offset).reshape(tuple(t.dims))
    return numpy_helper.to_array(t)


def external_locations(model) -> list[str]:
    """The external data files a model's initializers name (sorted, unique)."""
    from onnx import TensorProto
    out = set()
    for t in model.graph.initializer:
        if t.data_location == TensorProto.EXTERNAL:
            out.update(e.value for e in t.external_data if e.key == "location")
    return sorted(out)


def read_model(data: bytes, where: str, batch: int | None, external: dict | None = None):
    """Parse, check and shape-infer a model (with the batch dimension fixed); returns
    ``(model, batch)``. Small external tensors (shape constants) are read in first, so that
    shape inference sees their values."""
    import onnx
    try:
        model = onnx.load_model_from_string(data)
    except Exception as exc:  # noqa: BLE001 - protobuf's DecodeError and friends
        raise UserError(where, f"is not an ONNX model ({type(exc).__name__}: {exc})") from None
    from onnx import TensorProto
    if any(t.data_location == TensorProto.EXTERNAL for t in model.graph.initializer):
        for t in model.graph.initializer:
            if t.data_location == TensorProto.EXTERNAL and math.prod(t.dims) <= 4096:
                try:
                    raw = tensor_array(t, external)
                except ConversionError as exc:
                    raise UserError(where, exc.args[0]) from None
                del t.external_data[:]
                t.data_location = TensorProto.DEFAULT
                t.raw_data = raw.astype(raw.dtype.newbyteorder("<")).tobytes()
    opset = {o.domain or "": o.version for o in model.opset_import}
    if "" not in opset and "ai.onnx" not in opset:
        raise UserError(where, "imports no default ONNX opset; export it with opset 13 or later")
    if opset.get("", opset.get("ai.onnx", 0)) < 11:
        raise UserError(where, f"has opset {opset.get('', 0)}; ipubuild reads opset 11 or later: export it again")
    graph_inputs = [i for i in model.graph.input if i.name not in {t.name for t in model.graph.initializer}]
    if len(graph_inputs) != 1:
        raise UserError(where, f"has {len(graph_inputs)} graph inputs; ipubuild compiles models with one input")
    dims = graph_inputs[0].type.tensor_type.shape.dim
    if not dims:
        raise UserError(where, f"input {graph_inputs[0].name} has no shape")
    first = dims[0]
    if first.HasField("dim_value") and first.dim_value > 0:
        if batch is not None and batch != first.dim_value:
            raise UserError(where, f"input {graph_inputs[0].name} has batch {first.dim_value}, not model.batch "
                            f"{batch}; leave model.batch out")
        batch = first.dim_value
    else:
        batch = batch or 1
        first.Clear()
        first.dim_value = batch
    for d in dims[1:]:
        if not d.HasField("dim_value"):
            raise UserError(where, f"input {graph_inputs[0].name} has a symbolic dimension "
                            f"{d.dim_param or '?'} besides the batch; export it with a fixed shape")
    skeleton = _skeleton(model)
    try:
        onnx.checker.check_model(skeleton)
    except onnx.checker.ValidationError as exc:
        text = " ".join(str(exc).split())
        tolerated = ("No Op registered", "is not a registered function/op")
        if not any(t in text for t in tolerated):
            raise UserError(where, f"fails onnx.checker: {text[:300]}") from None
    try:
        inferred = onnx.shape_inference.infer_shapes(skeleton, data_prop=True)
    except Exception as exc:  # noqa: BLE001 - onnx raises InferenceError and others
        raise UserError(where, f"fails ONNX shape inference: {' '.join(str(exc).split())[:300]}") from None
    del model.graph.value_info[:]
    model.graph.value_info.extend(inferred.graph.value_info)
    return model, batch


SKELETON_ELEMENTS = 4096     # initializers larger than this are graph inputs in the skeleton


def _skeleton(model):
    """The model without its weights, for the checker and shape inference: each initializer of
    more than ``SKELETON_ELEMENTS`` elements becomes a graph input of its type and shape (both
    would otherwise serialise the whole model, weights and all, several times: 30 s at ViT-B/16
    size); the small ones (shape constants) stay, so that inference still sees their values."""
    from onnx import ModelProto, helper
    sk = ModelProto()
    sk.ir_version, sk.producer_name, sk.producer_version = model.ir_version, model.producer_name, model.producer_version
    sk.domain, sk.model_version = model.domain, model.model_version
    sk.opset_import.extend(model.opset_import)
    sk.functions.extend(model.functions)
    g, out = model.graph, sk.graph
    out.name = g.name
    out.node.extend(g.node)
    out.input.extend(g.input)
    out.output.extend(g.output)
    out.value_info.extend(g.value_info)
    names = {i.name for i in g.input}
    for t in g.initializer:
        if math.prod(t.dims) <= SKELETON_ELEMENTS:
            out.initializer.append(t)
        elif t.name not in names:
            out.input.append(helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)))
    return sk


def onnx_graph(model, external: dict | None) -> OnnxGraph:
    opsets = {(o.domain if o.domain != "ai.onnx" else ""): o.version for o in model.opset_import}
    g = model.graph
    consts = {t.name: tensor_array(t, external) for t in g.initializer}
    shapes = {}
    for vi in list(g.input) + list(g.value_info) + list(g.output):
        tt = vi.type.tensor_type
        if tt.HasField("shape"):
            dims = [d.dim_value if d.HasField("dim_value") else None for d in tt.shape.dim]
            shapes[vi.name] = tuple(dims) if None not in dims else None
    nodes = []
    for i, n in enumerate(g.node):
        nodes.append(Node(n.name or f"{n.op_type}_{i}", n.op_type, n.domain if n.domain != "ai.onnx" else "",
                          list(n.input), list(n.output), {a.name: _attr_value(a) for a in n.attribute},
                          opsets.get(n.domain if n.domain != "ai.onnx" else "", 0)))
    inputs = [(i.name, shapes.get(i.name)) for i in g.input if i.name not in consts]
    return OnnxGraph(nodes, consts, shapes, inputs, [o.name for o in g.output], opsets)


# passes over the ONNX-level graph ----------------------------------------------------------------
def pass_constants(og: OnnxGraph) -> None:
    """``Constant`` nodes as initializers."""
    kept = []
    for n in og.nodes:
        if n.op_type == "Constant" and n.domain == "":
            if "value" in n.attrs:
                v = np.asarray(n.attrs["value"])
            else:
                key = next(k for k in n.attrs if k.startswith("value_"))
                v = np.asarray(n.attrs[key], dtype=np.float32 if "float" in key else np.int64 if "int" in key else None)
            og.consts[n.outputs[0]] = v
        else:
            kept.append(n)
    og.nodes = kept


def _np_dtype(onnx_type: int):
    from onnx import helper
    return helper.tensor_dtype_to_np_dtype(onnx_type)


def _axes(n: Node, ins: list, pos: int = 1):
    if len(ins) > pos and ins[pos] is not None:
        return [int(a) for a in np.asarray(ins[pos]).reshape(-1)]
    a = n.attr("axes")
    return None if a is None else [int(x) for x in a]


def _reshape(x, shape, allowzero=0):
    shape = [int(s) for s in np.asarray(shape).reshape(-1)]
    if not allowzero:
        shape = [x.shape[i] if s == 0 else s for i, s in enumerate(shape)]
    return x.reshape(shape)


def _slice(x, starts, ends, axes=None, steps=None):
    starts, ends = np.asarray(starts).reshape(-1), np.asarray(ends).reshape(-1)
    axes = range(len(starts)) if axes is None else np.asarray(axes).reshape(-1)
    steps = [1] * len(starts) if steps is None else np.asarray(steps).reshape(-1)
    idx = [slice(None)] * x.ndim
    for s, e, a, st in zip(starts, ends, axes, steps):
        n = x.shape[int(a)]
        s, e = int(max(min(s, n), -n - 1)), int(max(min(e, n), -n - 1))
        idx[int(a)] = slice(s, e, int(st))
    return x[tuple(idx)]


def _squeeze(x, axes):
    return np.squeeze(x, axis=tuple(a % x.ndim for a in axes)) if axes else np.squeeze(x)


def _unsqueeze(x, axes):
    out_rank = x.ndim + len(axes)
    for a in sorted(a % out_rank for a in axes):
        x = np.expand_dims(x, a)
    return x


def _int_div(a, b):
    if np.issubdtype(np.result_type(a, b), np.integer):
        return (np.trunc(a / b)).astype(np.result_type(a, b))
    return a / b


#: numpy evaluations of the nodes folded when all their inputs are constants
FOLD: dict[str, Callable] = {
    "Shape": lambda n, i: np.asarray(i[0].shape[n.attr("start", 0):n.attr("end")], np.int64),
    "Size": lambda n, i: np.asarray(i[0].size, np.int64),
    "Gather": lambda n, i: np.take(i[0], i[1].astype(np.int64), axis=n.attr("axis", 0)),
    "Concat": lambda n, i: np.concatenate([np.atleast_1d(x) for x in i], axis=n.attr("axis", 0)),
    "Reshape": lambda n, i: _reshape(i[0], i[1], n.attr("allowzero", 0)),
    "Flatten": lambda n, i: i[0].reshape(math.prod(i[0].shape[:n.attr("axis", 1)]), -1),
    "ConstantOfShape": lambda n, i: np.full([int(s) for s in i[0].reshape(-1)],
                                            np.asarray(n.attr("value", np.zeros(1, np.float32))).reshape(-1)[0]),
    "Expand": lambda n, i: np.broadcast_to(i[0], np.broadcast_shapes(i[0].shape, tuple(int(s) for s in i[1]))).copy(),
    "Where": lambda n, i: np.where(i[0], i[1], i[2]),
    "Equal": lambda n, i: np.equal(i[0], i[1]),
    "Less": lambda n, i: np.less(i[0], i[1]),
    "Greater": lambda n, i: np.greater(i[0], i[1]),
    "Not": lambda n, i: np.logical_not(i[0]),
    "Cast": lambda n, i: i[0].astype(_np_dtype(n.attr("to"))),
    "Unsqueeze": lambda n, i: _unsqueeze(i[0], _axes(n, i)),
    "Squeeze": lambda n, i: _squeeze(i[0], _axes(n, i)),
    "Slice": lambda n, i: (_slice(i[0], i[1], i[2], i[3] if len(i) > 3 else None, i[4] if len(i) > 4 else None)
                           if len(i) > 1 else _slice(i[0], n.attr("starts"), n.attr("ends"), n.attr("axes"))),
    "Transpose": lambda n, i: np.transpose(i[0], n.attr("perm")),
    "Add": lambda n, i: i[0] + i[1],
    "Sub": lambda n, i: i[0] - i[1],
    "Mul": lambda n, i: i[0] * i[1],
    "Div": lambda n, i: _int_div(i[0], i[1]),
    "Neg": lambda n, i: -i[0],
    "Sqrt": lambda n, i: np.sqrt(i[0]),
    "Pow": lambda n, i: np.power(i[0], i[1]).astype(i[0].dtype),
    "Min": lambda n, i: np.minimum.reduce(i),
    "Max": lambda n, i: np.maximum.reduce(i),
    "Range": lambda n, i: np.arange(i[0], i[1], i[2]).astype(i[0].dtype),
    "Identity": lambda n, i: i[0],
}


def pass_fold(og: OnnxGraph) -> None:
    """Evaluate nodes whose inputs are all constants (and ``Shape`` of a tensor whose shape is
    known) — the exporter's shape arithmetic — with numpy."""
    kept = []
    for n in og.nodes:
        fn = FOLD.get(n.op_type) if n.domain == "" else None
        if fn is not None and n.op_type == "Shape" and n.inputs[0] not in og.consts:
            shape = og.shapes.get(n.inputs[0])
            if shape is not None:
                og.consts[n.outputs[0]] = np.asarray(shape[n.attr("start", 0):n.attr("end")], np.int64)
                continue
        if fn is not None and all(i == "" or i in og.consts for i in n.inputs) and len(n.outputs) == 1:
            ins = [og.consts[i] if i else None for i in n.inputs]
            while ins and ins[-1] is None:
                ins.pop()
            try:
                out = np.asarray(fn(n, ins))
            except Exception as exc:  # noqa: BLE001 - a malformed model
                raise ConversionError(f"cannot evaluate it on its constant inputs ({type(exc).__name__}: {exc})",
                                      n) from None
            og.consts[n.outputs[0]] = out
            continue
        kept.append(n)
    og.nodes = kept


def pass_identities(og: OnnxGraph) -> None:
    """Drop ``Identity`` and inference ``Dropout``: their readers read the input instead."""
    alias: dict[str, str] = {}
    kept = []
    for n in og.nodes:
        n.inputs = [alias.get(i, i) for i in n.inputs]
        if n.domain == "" and (n.op_type == "Identity" or (n.op_type == "Dropout" and not _training(n, og))):
            if n.outputs[0] in og.outputs:
                kept.append(Node(n.name, "Identity", "", n.inputs[:1], n.outputs[:1], {}, n.opset))
                continue
            alias[n.outputs[0]] = n.inputs[0]
            continue
        kept.append(n)
    og.nodes = kept


def _training(n: Node, og: OnnxGraph) -> bool:
    if len(n.inputs) > 2 and n.inputs[2]:
        return bool(np.asarray(og.consts.get(n.inputs[2], True)).reshape(-1)[0])
    return False


PASSES = [("constants", pass_constants), ("fold", pass_fold), ("identities", pass_identities)]


# entries: what a converter sees of each ONNX tensor ----------------------------------------------
@dataclasses.dataclass
class Val:
    """A value of the ipubuild graph whose row-major data is the ONNX tensor of ``shape``."""
    vid: int
    shape: tuple


@dataclasses.dataclass
class Const:
    array: np.ndarray
    name: str

    @property
    def shape(self):
        return self.array.shape


@dataclasses.dataclass
class Form:
    """A partial result a later node completes (see the module docstring); ``kind`` names it."""
    kind: str
    shape: tuple
    data: dict


def rows_cols(shape) -> tuple:
    """The ipubuild matrix view of an ONNX shape: ``(prod(shape[:-1]), shape[-1])``."""
    shape = tuple(int(s) for s in shape)
    if not shape:
        return (1, 1)
    return (math.prod(shape[:-1]), shape[-1])


class Converter:
    """What a converter is given besides the node: the ipubuild graph under construction and
    the ONNX tensors as entries. A plugin's converter uses ``constant``, ``value``, ``shape``,
    ``add``, ``add_constant``; the built-in ones also read and return forms (``entry``)."""

    def __init__(self, og: OnnxGraph, where: str):
        self.og, self.where = og, where
        self.graph = Graph()
        self.constants: dict[int, np.ndarray] = {}
        self.inputs: dict[int, np.ndarray] = {}
        self.entries: dict[str, object] = {}
        self._const_vids: dict = {}
        self.node: Node | None = None

    # for every converter ------------------------------------------------------------------
    def shape(self, name: str) -> tuple:
        """The ONNX shape of a tensor (after shape inference, batch fixed)."""
        e = self.entries.get(name)
        if e is not None:
            return tuple(e.shape)
        if name in self.og.consts:
            return self.og.consts[name].shape
        s = self.og.shapes.get(name)
        if s is None:
            raise ConversionError(f"the shape of {name} is unknown after shape inference")
        return s

    def constant(self, name: str) -> np.ndarray | None:
        """The value of a constant tensor (initializer or folded), else None."""
        e = self.entry(name) if name else None
        return e.array if isinstance(e, Const) else None

    def value(self, name: str) -> int:
        """The ipubuild value id holding tensor ``name`` (a pending form materialised, a
        constant made a graph constant in its matrix view)."""
        e = self.entry(name)
        if isinstance(e, Const):
            return self.add_constant(e.array.reshape(rows_cols(e.array.shape)) if e.array.ndim > 1 else e.array,
                                     e.name)
        return self.materialise(e).vid

    def add(self, type: str, inputs, suffix: str = "", **attrs) -> int:
        """Add an ipubuild operation named after the node (``<node name><suffix>``)."""
        name = (self.node.name if self.node else type) + suffix
        base, i = name, 1
        names = self._names()
        while name in names:
            i += 1
            name = f"{base}#{i}"
        names.add(name)
        return self.graph.add(type, inputs, name=name, **attrs)

    def add_constant(self, array: np.ndarray, name: str) -> int:
        """A graph constant holding ``array`` as float32 (shared by name and shape)."""
        array = np.ascontiguousarray(array, dtype=np.float32)
        k = (name, array.shape)
        if k not in self._const_vids:
            vname, i = name, 1
            while vname in self._names():
                i += 1
                vname = f"{name}#{i}"
            self._names().add(vname)
            vid = self.graph.constant(vname, array.shape)
            self.constants[vid] = array
            self._const_vids[k] = vid
        return self._const_vids[k]

    # for the built-in converters ------------------------------------------------------------
    def entry(self, name: str):
        if name in self.entries:
            return self.entries[name]
        if name in self.og.consts:
            return Const(self.og.consts[name], name)
        raise ConversionError(f"input {name} is produced by no node before it")

    def materialise(self, e) -> Val:
        if isinstance(e, Val):
            return e
        if isinstance(e, Form):
            fn = MATERIALISE.get(e.kind)
            if fn is not None:
                return fn(self, e)
            raise ConversionError(f"reads a partial {FORM_NAMES.get(e.kind, e.kind)} that ipubuild has no "
                                  "operator for")
        raise ConversionError("reads a constant where it needs a computed value")

    def _names(self) -> set:
        if not hasattr(self, "_name_set"):
            self._name_set = set()
        return self._name_set


#: forms a node may complete, named for error messages
FORM_NAMES = {"matmul": "MatMul", "gelu": "GELU", "ln": "layer normalisation", "tokens_cf": "patch embedding "
              "(channels first)", "qkv5": "QKV reshape", "qkv_heads": "QKV heads", "head": "attention head",
              "scores": "attention scores", "probs": "attention probabilities",
              "ctx_heads": "attention context (by head)", "ctx_tokens": "attention context (by token)",
              "scaled": "product with a constant"}
MATERIALISE: dict[str, Callable] = {}


def converters(pm) -> dict:
    """Every plugin's ONNX converters by ``(domain, op_type)`` (a plain ``op_type`` key is the
    default domain's); one declared twice is an error naming both plugins."""
    found, owners = {}, {}
    for impl in sorted(pm.hook.ipubuild_onnx_converters.get_hookimpls(), key=lambda i: i.plugin_name):
        plugin = impl.plugin_name
        try:
            table = impl.function()
        except UserError:
            raise
        except Exception as exc:  # noqa: BLE001 - a plugin's bug, named
            raise UserError(f"plugin {plugin}", f"hook ipubuild_onnx_converters raised {type(exc).__name__}: "
                            f"{exc}") from None
        if not _well_formed(table):
            raise UserError(f"plugin {plugin}", "hook ipubuild_onnx_converters must return a dict of ONNX op "
                            "types (or (domain, op type) pairs) to callables")
        for k, fn in table.items():
            key = ("", k) if isinstance(k, str) else (("" if k[0] == "ai.onnx" else k[0]), k[1])
            if key in owners:
                raise UserError(f"plugin {plugin}", f"hook ipubuild_onnx_converters: a converter of "
                                f"{_key_name(key)} is already registered by {owners[key]}")
            owners[key] = plugin
            found[key] = fn
    return found


def _key_name(key) -> str:
    return key[1] if not key[0] else f"{key[0]}:{key[1]}"


def _well_formed(table) -> bool:
    return isinstance(table, dict) and all(
        (isinstance(k, str) or (isinstance(k, tuple) and len(k) == 2 and all(isinstance(x, str) for x in k)))
        and callable(f) for k, f in table.items())


# the whole import ---------------------------------------------------------------------------------
def import_model(pm, data: bytes, external: dict, where: str, *, batch: int | None, seed: int,
                 input_array: np.ndarray | None = None, input_where: str = "model.input") -> Model:
    model, batch = read_model(data, where, batch, external)
    try:
        og = onnx_graph(model, external)
        for _, p in PASSES:
            p(og)
    except ConversionError as exc:
        node = exc.args[1] if len(exc.args) > 1 else None
        what = f"node {node.name} (op {node.op_type}, opset {node.opset}): " if node else ""
        raise UserError(where, what + exc.args[0]) from None
    (in_name, in_shape), = og.inputs
    x = model_input(in_shape, seed, input_array, input_where)
    table = converters(pm)
    cv = Converter(og, where)
    add_input(cv, in_name, x)
    cv2 = convert(cv, table)
    g = cv2.graph
    outs = []
    for name in og.outputs:
        try:
            e = cv2.materialise(cv2.entry(name))
        except ConversionError as exc:
            raise UserError(where, f"graph output {name}: {exc.args[0]}") from None
        outs.append(e.vid)
        g.values[e.vid].name = name
    g.outputs = outs
    return Model(g, cv2.constants, cv2.inputs)


def convert(cv: Converter, table: dict) -> Converter:
    """Every node through its converter, in order (the one-line error for a node none converts)."""
    og, where = cv.og, cv.where
    for n in og.nodes:
        fn = table.get((n.domain, n.op_type))
        if fn is None:
            raise UserError(where, f"node {n.name} (op {_key_name((n.domain, n.op_type))}, opset {n.opset}) "
                            f"has no converter; {HOOK_DOC}")
        cv.node = n
        try:
            got = fn(cv, n)
        except ConversionError as exc:
            raise UserError(where, f"node {n.name} (op {n.op_type}, opset {n.opset}): {exc.args[0]}") from None
        except ValueError as exc:
            raise UserError(where, f"node {n.name} (op {n.op_type}, opset {n.opset}): {exc}") from None
        except UserError as exc:
            raise UserError(where, f"node {n.name} (op {n.op_type}, opset {n.opset}): {exc.message}") from None
        if not isinstance(got, (list, tuple)) or len(got) > len(n.outputs):
            raise UserError(where, f"node {n.name} (op {n.op_type}): its converter must return a list of at "
                            f"most {len(n.outputs)} value ids or entries")
        for name, e in zip(n.outputs, got):
            if isinstance(e, (int, np.integer)):
                shape = og.shapes.get(name) or cv.graph.values[int(e)].shape
                e = Val(int(e), tuple(shape))
            cv.entries[name] = e
    cv.node = None
    return cv


def model_input(shape, seed: int, array: np.ndarray | None, where: str) -> np.ndarray:
    """The example input: the ``.npy`` array given (checked against the model's input shape)
    or a seeded standard normal tensor of that shape."""
    if array is not None:
        if tuple(array.shape) != tuple(shape):
            raise UserError(where, f"holds an array of shape {list(array.shape)}; the model's input is "
                            f"{list(shape)}")
        return np.ascontiguousarray(array, dtype=np.float32)
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


# the files an ONNX target reads (declared sources of lower_model) ------------------------------
MODEL_SLOT, INPUT_SLOT, DATA_SLOT = "model/file", "model/input", "model/data/"


def _installed(module: str) -> bool:
    import importlib.util
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def declared_sources(target: dict, root) -> dict:
    """``{slot: path}`` of the files ``lower_model`` reads for an ONNX target: the model, its
    external data files and the ``.npy`` input — paths relative to the target file, checked
    here (a missing file is one line naming ``model.file``). Their digests enter the phase's
    action key (doit judges them by stat, then content: hashed once per change)."""
    from pathlib import Path
    from ..engine.files import tree_path
    missing = [m for m in ("onnx", "onnxruntime") if not _installed(m)]
    if missing:   # named like a family no plugin provides: bare `doit` skips the target, saying why
        raise UserError(f"{target['path']}: model.family", f"the onnx family needs {' and '.join(missing)}, "
                        "which is not installed: pip install -e '.[onnx]' (the onnx extra)")
    root = Path(root)
    m = target["model"]
    tp = Path(target["path"])
    base = (tp if tp.is_absolute() else root / tp).parent
    out = {}
    for slot, key in ((MODEL_SLOT, "file"), (INPUT_SLOT, "input")):
        rel = m.get(key)
        if not rel:
            if key == "file":
                raise UserError(f"{target['path']}: model.file", "missing; name the .onnx file, relative to the "
                                "target file")
            continue
        if not isinstance(rel, str):
            raise UserError(f"{target['path']}: model.{key}", f"expected a path string, got {rel!r}")
        f = base / rel
        if not f.is_file():
            raise UserError(f"{target['path']}: model.{key}", f"{rel}: no such file (paths are relative to the "
                            "target file)")
        out[slot] = tree_path(f, root)
    model_file = base / m["file"]
    for loc in external_files(model_file):
        f = model_file.parent / loc
        if not f.is_file():
            raise UserError(f"{target['path']}: model.file", f"{m['file']} names external data {loc}, which is "
                            "missing")
        out[DATA_SLOT + loc] = tree_path(f, root)
    return out


def external_files(path) -> list[str]:
    """The external data files a model file names: its bytes scanned for the ``location``
    entry first (most models have none), parsed without the data only if it is there."""
    with open(path, "rb") as f:
        import mmap
        try:
            mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except ValueError:        # an empty file
            return []
        with mm:
            if mm.find(b"location") < 0:
                return []
    import onnx
    return external_locations(onnx.load(str(path), load_external_data=False))


def add_input(cv: "Converter", name: str, x: np.ndarray) -> None:
    """The graph input: an image (NCHW) stays a form until a node says how it is read."""
    cv.entries[name] = Form("image", tuple(x.shape), dict(name=name, array=x))
