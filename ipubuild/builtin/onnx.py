"""The ``onnx`` model family and the built-in ONNX converters (``ipubuild_onnx_converters``).

A target says ``[model] family = "onnx"`` and ``file = "models/<name>.onnx"`` (relative to the
target file); ``input = "<name>.npy"`` gives the example input (else a seeded standard normal
tensor of the model's input shape) and ``batch = N`` fixes a symbolic batch dimension (default 1).
The importer is ``ipubuild.graph.onnx_import``; the converters here map ONNX nodes onto ipubuild's
operators, recognising the decomposed forms exporters emit (see that module's docstring).
"""
from __future__ import annotations

import math

import numpy as np

from .. import hookimpl
from ..engine.errors import UserError
from ..graph.onnx_import import (DATA_SLOT, INPUT_SLOT, MATERIALISE, MODEL_SLOT, Const, ConversionError, Converter,
                           Form, Node, Val, rows_cols)
from ..compiler.targets import Field, check_table

SCHEMA = {
    "file": Field(str, doc="the ONNX model, relative to the target file"),
    "input": Field(str, "", doc="an .npy file with the example input (default: seeded random)"),
    "batch": Field(int, 0, min=0, max=65536, doc="the batch, where the model's input has a symbolic one (0: 1)"),
}

#: the source slots lower_model reads for an ONNX target (``model/<slot>``)



@hookimpl
def ipubuild_model_families():
    return ["onnx"]


@hookimpl
def ipubuild_build_model(family, params, seed, where):
    if family != "onnx":
        return None
    from ..graph.frontend import model_sources
    from ..graph.onnx_import import import_model
    from ..plugins import get_plugin_manager
    p = check_table(params, SCHEMA, where, "model")
    files = model_sources()
    if MODEL_SLOT not in files:
        raise UserError(f"{where}: model.file", "the ONNX family reads its file as a declared source; "
                        "build it with doit build:<target>")
    external = {k[len(DATA_SLOT):]: files[k]() for k in files if k.startswith(DATA_SLOT)}
    array = None
    if p["input"]:
        import io
        try:
            array = np.load(io.BytesIO(files[INPUT_SLOT]()), allow_pickle=False)
        except (ValueError, OSError) as exc:
            raise UserError(f"{where}: model.input", f"{p['input']} is not an .npy array ({exc})") from None
    return import_model(get_plugin_manager(), files[MODEL_SLOT](), external, p["file"],
                        batch=p["batch"] or None, seed=seed, input_array=array,
                        input_where=f"{where}: model.input")


# helpers --------------------------------------------------------------------------------------------
def _scalar(e) -> float | None:
    if isinstance(e, Const) and e.array.size == 1 and np.issubdtype(e.array.dtype, np.number):
        return float(e.array.reshape(-1)[0])
    return None


def _near(x, want, rel=1e-3) -> bool:
    return x is not None and abs(x - want) <= rel * abs(want)


def _out_shape(cv: Converter, n: Node, i: int = 0, fallback=None):
    s = cv.og.shapes.get(n.outputs[i])
    return tuple(s) if s is not None else fallback


def _dummy_shape(cv: Converter, n: Node, in_shape) -> tuple:
    """The output shape of a shape-only node (Reshape, Flatten, Squeeze, …) on ``in_shape``."""
    from ..graph.onnx_import import FOLD
    s = _out_shape(cv, n)
    if s is not None:
        return s
    ins = [np.empty(in_shape, np.bool_)] + [cv.constant(i) for i in n.inputs[1:]]
    return tuple(FOLD[n.op_type](n, ins).shape)


def _form(kind, shape, **data) -> Form:
    return Form(kind, tuple(shape), data)


def _val(cv, e) -> Val:
    return cv.materialise(e)


def _bias(e, n_out) -> np.ndarray | None:
    if isinstance(e, Const) and e.array.size == n_out and e.array.shape[-1:] == (n_out,):
        return e.array.reshape(n_out)
    return None


def _const2d(cv: Converter, c: Const, cols: int) -> int:
    a = c.array.astype(np.float32)
    if a.size == cols:
        return cv.add_constant(a.reshape(cols), c.name)
    return cv.add_constant(a.reshape(rows_cols(a.shape)), c.name)


def _image_input(cv: Converter, e: Form, layout: str) -> int:
    if "vid" in e.data:
        if e.data["layout"] != layout:
            raise ConversionError("reads the model input in another layout than an earlier node")
        return e.data["vid"]
    x = e.data["array"]
    if x.shape[0] != 1:
        raise ConversionError(f"the batch is {x.shape[0]}: ipubuild's operators take one image at a time; "
                              "set model.batch = 1")
    if layout == "hwc":
        _, c, h, w = x.shape
        arr = np.ascontiguousarray(x[0].transpose(1, 2, 0).reshape(h, w * c))
    else:
        arr = x.reshape(rows_cols(x.shape))
    vid = cv.graph.input(e.data["name"], arr.shape)
    cv.inputs[vid] = arr
    e.data.update(vid=vid, layout=layout)
    return vid


def _materialise_image(cv, e):
    return Val(_image_input(cv, e, "rows"), e.shape)


def _materialise_matmul(cv, e):
    vid = cv.add("matmul", [e.data["x"], cv.add_constant(e.data["w"], e.data["wname"])])
    e.kind, e.data = "done", {"vid": vid}
    return Val(vid, e.shape)


def _materialise_done(cv, e):
    return Val(e.data["vid"], e.shape)


def _materialise_ln(cv, e):
    """A normalised ``x`` without (some of) its scale and shift: a layer norm with ones, zeros."""
    d = e.data
    if d.get("stage") != "normed":
        raise ConversionError("reads a partial layer normalisation that ipubuild has no operator for")
    cols = cv.graph.values[d["x"]].cols
    g = d.get("gamma")
    b = d.get("beta")
    gv = cv.add_constant(g if g is not None else np.ones(cols, np.float32), d.get("gname") or f"{cv.node.name}.gamma")
    bv = cv.add_constant(b if b is not None else np.zeros(cols, np.float32), d.get("bname") or f"{cv.node.name}.beta")
    return Val(cv.add("layernorm", [d["x"], gv, bv], eps=float(d["eps"])), e.shape)


def _materialise_probs(cv, e):
    return Val(e.data["vid"], e.shape)


MATERIALISE.update(image=_materialise_image, matmul=_materialise_matmul, done=_materialise_done,
                   ln=_materialise_ln, probs=_materialise_probs)


# converters ------------------------------------------------------------------------------------------
def conv(cv: Converter, n: Node):
    """Conv with stride = kernel, no padding, one group, on the model's image input: patchify
    (the image read channels last) and a matmul with the kernel as ``[P·P·C, D]``."""
    x, w = cv.entry(n.inputs[0]), cv.entry(n.inputs[1])
    if not isinstance(w, Const) or w.array.ndim != 4:
        raise ConversionError("needs a constant 2-D kernel")
    d, c, p, q = w.array.shape
    if (list(n.attr("strides", [1, 1])) != [p, q] or any(n.attr("pads", [0, 0, 0, 0]))
            or n.attr("group", 1) != 1 or any(k != 1 for k in n.attr("dilations", [1, 1])) or p != q):
        raise ConversionError("only a square Conv with stride = kernel, no padding, one group (a patch "
                              "embedding) has an ipubuild operator (patchify + matmul)")
    if not (isinstance(x, Form) and x.kind == "image"):
        raise ConversionError("a patch-embedding Conv must read the model's image input")
    img = _image_input(cv, x, "hwc")
    patches = cv.add("patchify", [img], suffix="/patchify", patch=p, channels=c)
    wm = w.array.transpose(2, 3, 1, 0).reshape(p * p * c, d)
    ins = [patches, cv.add_constant(wm, w.name)]
    if len(n.inputs) > 2 and n.inputs[2]:
        ins.append(cv.add_constant(cv.constant(n.inputs[2]).reshape(d), n.inputs[2]))
    vid = cv.add("matmul", ins)
    _, _, h, ww = x.shape
    return [_form("tokens_cf", (1, d, h // p, ww // p), vid=vid, flat=False)]


def reshape(cv: Converter, n: Node):
    """Reshape, Flatten, Squeeze, Unsqueeze: a view of the same matrix where the last axis stays
    (and the steps of the patch embedding, the QKV heads and the attention context)."""
    e = cv.entry(n.inputs[0])
    new = _dummy_shape(cv, n, e.shape)
    if isinstance(e, Val):
        if new[-1:] == e.shape[-1:] or (len(new) and math.prod(new[:-1]) == rows_cols(e.shape)[0]
                                         and new[-1] == e.shape[-1]):
            return [Val(e.vid, new)]
        if len(new) >= 3 and new[-3] == 3 and new[-3] * new[-2] * new[-1] == e.shape[-1]:
            return [_form("qkv5", new, qkv=e.vid, heads=new[-2])]
        raise ConversionError(f"reshapes {list(e.shape)} to {list(new)}, changing the last axis: ipubuild has no "
                              "reshape operator")
    if isinstance(e, Form):
        if e.kind == "tokens_cf" and len(new) == 3 and new[:2] == e.shape[:2]:
            return [_form("tokens_cf", new, vid=e.data["vid"], flat=True)]
        if e.kind == "ctx_tokens" and len(new) >= 2 and new[-1] == e.shape[-2] * e.shape[-1]:
            return [Val(e.data["vid"], new)]
        if e.kind == "head" and math.prod(new) == math.prod(e.shape) and new[-2:] == e.shape[-2:]:
            return [_form("head", new, **e.data)]
        if e.kind in ("scores", "probs", "ctx_heads") and new[-2:] == e.shape[-2:]:
            return [_form(e.kind, new, **e.data)]
        if e.kind == "image" and new[-1] == e.shape[-1]:
            return [Val(_image_input(cv, e, "rows"), new)]
    raise ConversionError(f"reshapes a {getattr(e, 'kind', 'constant')} in a way ipubuild has no operator for")


def transpose(cv: Converter, n: Node):
    e = cv.entry(n.inputs[0])
    perm = list(n.attr("perm", list(range(len(e.shape)))[::-1]))
    new = tuple(e.shape[i] for i in perm)
    if isinstance(e, Form):
        k = e.kind
        if k == "tokens_cf" and e.data["flat"] and perm == [0, 2, 1]:
            return [Val(e.data["vid"], new)]
        if k == "tokens_cf" and not e.data["flat"] and perm == [0, 2, 3, 1]:
            return [Val(e.data["vid"], new)]
        if k == "qkv5" and len(perm) == 5 and perm == [2, 0, 3, 1, 4]:
            return [_form("qkv_heads", new, **e.data)]
        if k == "head" and perm[-2:] == [len(perm) - 1, len(perm) - 2] and perm[:-2] == list(range(len(perm) - 2)):
            return [_form("head", new, **dict(e.data, trans=not e.data["trans"]))]
        if k == "ctx_heads" and perm == [0, 2, 1, 3]:
            return [_form("ctx_tokens", new, **e.data)]
    if isinstance(e, Val) and perm[-1] == len(perm) - 1 and all(e.shape[i] == 1 for i in range(len(perm) - 1)
                                                              if perm[i] != i):
        return [Val(e.vid, new)]
    raise ConversionError(f"transposes {list(e.shape)} by {perm}: ipubuild has no transpose operator for it")


def split(cv: Converter, n: Node):
    e = cv.entry(n.inputs[0])
    axis = n.attr("axis", 0)
    if isinstance(e, Form) and e.kind == "qkv_heads" and axis == 0 and len(n.outputs) == 3:
        shape = (1,) + e.shape[1:]
        return [_form("head", shape, qkv=e.data["qkv"], heads=e.data["heads"], part=i, trans=False, scale=1.0)
                for i in range(3)]
    raise ConversionError("only the split of fused QKV heads into Q, K and V has an ipubuild operator")


def gather(cv: Converter, n: Node):
    e, idx = cv.entry(n.inputs[0]), cv.constant(n.inputs[1])
    axis = n.attr("axis", 0)
    if idx is None or idx.size != 1:
        raise ConversionError("needs one constant index")
    i = int(idx.reshape(-1)[0])
    if isinstance(e, Form) and e.kind == "qkv_heads" and axis == 0:
        shape = e.shape[1:] if idx.ndim == 0 else (1,) + e.shape[1:]
        return [_form("head", shape, qkv=e.data["qkv"], heads=e.data["heads"], part=i % 3, trans=False, scale=1.0)]
    e = _val(cv, e)
    nd = len(e.shape)
    axis %= nd
    if axis == nd - 2 and all(s == 1 for s in e.shape[:axis]):
        i %= e.shape[axis]
        vid = cv.add("slice_rows", [e.vid], start=i, end=i + 1)
        return [Val(vid, _out_shape(cv, n, 0, e.shape[:axis] + e.shape[axis + 1:]))]
    raise ConversionError(f"gathers along axis {axis} of {list(e.shape)}: only rows (the class token) have an "
                          "ipubuild operator")


def slice_(cv: Converter, n: Node):
    e = _val(cv, cv.entry(n.inputs[0]))
    starts, ends = cv.constant(n.inputs[1]), cv.constant(n.inputs[2])
    axes = cv.constant(n.inputs[3]) if len(n.inputs) > 3 and n.inputs[3] else np.arange(len(starts.reshape(-1)))
    steps = cv.constant(n.inputs[4]) if len(n.inputs) > 4 and n.inputs[4] else np.ones(len(starts.reshape(-1)))
    if starts is None or ends is None or axes is None or steps is None:
        raise ConversionError("needs constant starts, ends, axes and steps")
    nd = len(e.shape)
    if len(starts.reshape(-1)) == 1 and int(steps.reshape(-1)[0]) == 1:
        axis = int(axes.reshape(-1)[0]) % nd
        size = e.shape[axis]
        s, t = (int(max(min(v, size), -size)) for v in (starts.reshape(-1)[0], ends.reshape(-1)[0]))
        s, t = s % size if s < 0 else s, t % size if t < 0 else min(t, size)
        if axis == nd - 2 and all(x == 1 for x in e.shape[:axis]) and 0 <= s < t:
            vid = cv.add("slice_rows", [e.vid], start=s, end=t)
            return [Val(vid, e.shape[:axis] + (t - s,) + e.shape[axis + 1:])]
    raise ConversionError("only a slice of rows (the class token) has an ipubuild operator")


def concat(cv: Converter, n: Node):
    es = [cv.entry(i) for i in n.inputs]
    nd = len(es[0].shape)
    axis = n.attr("axis", 0) % nd
    if len(es) != 2 or axis != nd - 2 or any(any(s != 1 for s in e.shape[:axis]) for e in es):
        raise ConversionError("only two tensors stacked by rows (the class token before the patches) have an "
                              "ipubuild operator")
    vids = [cv.add_constant(e.array.reshape(rows_cols(e.shape)), e.name) if isinstance(e, Const) else _val(cv, e).vid
            for e in es]
    return [cv.add("concat_rows", vids)]


def matmul(cv: Converter, n: Node):
    a, b = cv.entry(n.inputs[0]), cv.entry(n.inputs[1])
    if isinstance(a, Form) and isinstance(b, Form) and a.kind == "head" and b.kind == "head":
        if a.data["qkv"] != b.data["qkv"] or (a.data["part"], b.data["part"]) != (0, 1) or a.data["trans"] \
                or not b.data["trans"]:
            raise ConversionError("multiplies attention heads other than Q by K transposed of one fused QKV")
        vid = cv.add("attention_scores", [a.data["qkv"]], heads=a.data["heads"])
        return [_form("scores", _out_shape(cv, n, 0, a.shape[:-1] + a.shape[-2:-1]), vid=vid,
                      scale=a.data["scale"] * b.data["scale"], heads=a.data["heads"], qkv=a.data["qkv"])]
    if isinstance(a, Form) and a.kind == "probs" and isinstance(b, Form) and b.kind == "head":
        if b.data["part"] != 2 or b.data["trans"] or b.data["scale"] != 1.0 or b.data["qkv"] != a.data["qkv"]:
            raise ConversionError("multiplies attention probabilities by something other than V of their QKV")
        vid = cv.add("attention_context", [a.data["vid"], b.data["qkv"]], heads=b.data["heads"])
        return [_form("ctx_heads", _out_shape(cv, n, 0, a.shape[:-1] + b.shape[-1:]), vid=vid)]
    if isinstance(b, Const) and b.array.ndim == 2:
        x = _val(cv, a)
        return [_form("matmul", x.shape[:-1] + (b.array.shape[1],), x=x.vid, w=b.array, wname=b.name)]
    raise ConversionError("only activations times a constant 2-D weight, and attention's Q·Kᵀ and P·V, have "
                          "ipubuild operators")


def gemm(cv: Converter, n: Node):
    a, b = cv.entry(n.inputs[0]), cv.entry(n.inputs[1])
    if n.attr("transA", 0) or n.attr("alpha", 1.0) != 1.0 or n.attr("beta", 1.0) != 1.0 or not isinstance(b, Const):
        raise ConversionError("only Gemm with a constant B, no transA and alpha = beta = 1 has an ipubuild operator")
    w = b.array.T if n.attr("transB", 0) else b.array
    ins = [_val(cv, a).vid, cv.add_constant(w, b.name)]
    if len(n.inputs) > 2 and n.inputs[2]:
        bias = _bias(cv.entry(n.inputs[2]), w.shape[1])
        if bias is None:
            raise ConversionError("its C must be a constant bias of one row")
        ins.append(cv.add_constant(bias, n.inputs[2]))
    return [cv.add("matmul", ins)]


def _gelu_parts(e, x_vid=None):
    if isinstance(e, Form) and e.kind == "gelu":
        return e.data
    return None


def _gelu_merge(cv, shape, x, parts, scale):
    parts = set(parts)
    if parts >= {"x", "one_plus"} and _near(scale, 0.5, 1e-6):
        return Val(cv.add("gelu", [x]), shape)
    return _form("gelu", shape, x=x, parts=parts, scale=scale, stage="parts")


def add(cv: Converter, n: Node):
    a, b = cv.entry(n.inputs[0]), cv.entry(n.inputs[1])
    if isinstance(a, Const) and not isinstance(b, Const):
        a, b = b, a
    if isinstance(a, Form):
        k, st = a.kind, a.data.get("stage")
        if k == "matmul":
            bias = _bias(b, a.shape[-1])
            if bias is not None:
                ins = [a.data["x"], cv.add_constant(a.data["w"], a.data["wname"]), cv.add_constant(bias, b.name)]
                return [Val(cv.add("matmul", ins), a.shape)]
        if k == "gelu" and st in ("erf", "tanh") and _near(_scalar(b), 1.0, 1e-6):
            return [_form("gelu", a.shape, x=a.data["x"], parts={"one_plus"}, scale=1.0, stage="parts")]
        if k == "ln" and st == "var" and _scalar(b) is not None:
            return [_form("ln", a.shape, **dict(a.data, stage="var_eps", eps=_scalar(b)))]
        if k == "ln" and st == "normed" and a.data.get("beta") is None and isinstance(b, Const):
            beta = _bias(b, a.shape[-1])
            if beta is not None:
                return [_materialise_ln(cv, _form("ln", a.shape, **dict(a.data, beta=beta, bname=b.name)))]
        if k == "gelu" and st == "ccube" and isinstance(b, Val) and b.vid == a.data["x"]:
            return [_form("gelu", a.shape, x=b.vid, stage="inner")]
    if isinstance(b, Form) and b.kind == "gelu" and b.data.get("stage") == "ccube" and isinstance(a, Val) \
            and a.vid == b.data["x"]:
        return [_form("gelu", b.shape, x=a.vid, stage="inner")]
    x = _val(cv, a)
    if isinstance(b, Const):
        return [Val(cv.add("add", [x.vid, _const2d(cv, b, x.shape[-1])]), x.shape)]
    y = _val(cv, b)
    if cv.graph.values[y.vid].shape != cv.graph.values[x.vid].shape and cv.graph.values[x.vid].rows == 1:
        x, y = y, x
    return [Val(cv.add("add", [x.vid, y.vid]), x.shape if len(x.shape) >= len(y.shape) else y.shape)]


def mul(cv: Converter, n: Node, divide: bool = False):
    a, b = cv.entry(n.inputs[0]), cv.entry(n.inputs[1])
    if isinstance(a, Const) and not divide:
        a, b = b, a
    c = _scalar(b)
    if c is not None and divide:
        c = 1.0 / c
    if isinstance(a, Form):
        k, st = a.kind, a.data.get("stage")
        if k in ("head", "scores") and c is not None:
            return [_form(k, a.shape, **dict(a.data, scale=a.data["scale"] * c))]
        if k == "gelu" and st == "parts" and c is not None:
            return [_gelu_merge(cv, a.shape, a.data["x"], a.data["parts"], a.data["scale"] * c)]
        if k == "gelu" and st == "cube" and _near(c, 0.044715):
            return [_form("gelu", a.shape, x=a.data["x"], stage="ccube")]
        if k == "gelu" and st == "inner" and _near(c, math.sqrt(2 / math.pi)):
            return [_form("gelu", a.shape, x=a.data["x"], stage="arg_tanh")]
        if k == "ln" and st == "normed" and a.data.get("gamma") is None and isinstance(b, Const) and not divide:
            gamma = _bias(b, a.shape[-1])
            if gamma is not None:
                return [_form("ln", a.shape, **dict(a.data, gamma=gamma, gname=b.name))]
        if k == "gelu" and st == "parts" and isinstance(b, Val) and b.vid == a.data["x"] and not divide:
            return [_gelu_merge(cv, a.shape, b.vid, a.data["parts"] | {"x"}, a.data["scale"])]
        if k == "ln" and st == "centered" and divide and isinstance(b, Form) and b.kind == "ln" \
                and b.data.get("stage") == "std" and b.data["x"] == a.data["x"]:
            return [_form("ln", a.shape, x=a.data["x"], stage="normed", eps=b.data["eps"])]
        if k == "gelu" and st == "parts" and isinstance(b, Form) and b.kind == "gelu" \
                and b.data.get("stage") == "parts" and b.data["x"] == a.data["x"] and not divide:
            return [_gelu_merge(cv, a.shape, a.data["x"], a.data["parts"] | b.data["parts"],
                                a.data["scale"] * b.data["scale"])]
    if isinstance(b, Form) and b.kind == "gelu" and b.data.get("stage") == "parts" and isinstance(a, Val) \
            and a.vid == b.data["x"] and not divide:
        return [_gelu_merge(cv, a.shape, a.vid, b.data["parts"] | {"x"}, b.data["scale"])]
    if isinstance(a, (Val, Form)) and c is not None:
        x = _val(cv, a)
        if _near(c, 1 / math.sqrt(2), 1e-5):
            return [_form("gelu", x.shape, x=x.vid, stage="arg_erf")]
        return [_form("gelu", x.shape, x=x.vid, parts={"x"}, scale=c, stage="parts")]
    raise ConversionError("multiplies tensors in a way ipubuild has no operator for (it has no general "
                          "elementwise product)")


def div(cv: Converter, n: Node):
    return mul(cv, n, divide=True)


def erf(cv: Converter, n: Node, kind: str = "erf"):
    e = cv.entry(n.inputs[0])
    if isinstance(e, Form) and e.kind == "gelu" and e.data.get("stage") == f"arg_{kind}":
        return [_form("gelu", e.shape, x=e.data["x"], stage=kind)]
    raise ConversionError(f"only the {kind} of a GELU (x/√2, or its tanh form) has an ipubuild operator")


def pow_(cv: Converter, n: Node):
    e, p = cv.entry(n.inputs[0]), _scalar(cv.entry(n.inputs[1]))
    if isinstance(e, Val) and p == 3.0:
        return [_form("gelu", e.shape, x=e.vid, stage="cube")]
    if isinstance(e, Form) and e.kind == "ln" and e.data["stage"] == "centered" and p == 2.0:
        return [_form("ln", e.shape, x=e.data["x"], stage="sq")]
    raise ConversionError("only x³ of a tanh GELU and the square of a layer norm's deviations have ipubuild "
                          "operators")


def _last_axis(cv, n, shape) -> bool:
    axes = cv.constant(n.inputs[1]) if len(n.inputs) > 1 and n.inputs[1] else n.attr("axes")
    axes = [int(a) for a in np.asarray(axes).reshape(-1)] if axes is not None else None
    return axes is not None and len(axes) == 1 and axes[0] % len(shape) == len(shape) - 1 and n.attr("keepdims", 1)


def reduce_mean(cv: Converter, n: Node):
    e = cv.entry(n.inputs[0])
    if not _last_axis(cv, n, e.shape):
        raise ConversionError("only a mean over the last axis (of a layer norm) has an ipubuild operator")
    if isinstance(e, Val):
        return [_form("ln", e.shape[:-1] + (1,), x=e.vid, stage="mean")]
    if isinstance(e, Form) and e.kind == "ln" and e.data["stage"] == "sq":
        return [_form("ln", e.shape[:-1] + (1,), x=e.data["x"], stage="var")]
    raise ConversionError("only the mean and variance of a layer norm have an ipubuild operator")


def sub(cv: Converter, n: Node):
    a, b = cv.entry(n.inputs[0]), cv.entry(n.inputs[1])
    if isinstance(a, Val) and isinstance(b, Form) and b.kind == "ln" and b.data["stage"] == "mean" \
            and b.data["x"] == a.vid:
        return [_form("ln", a.shape, x=a.vid, stage="centered")]
    raise ConversionError("only x − mean(x) of a layer norm has an ipubuild operator")


def sqrt(cv: Converter, n: Node):
    e = cv.entry(n.inputs[0])
    if isinstance(e, Form) and e.kind == "ln" and e.data["stage"] == "var_eps":
        return [_form("ln", e.shape, **dict(e.data, stage="std"))]
    raise ConversionError("only √(variance + ε) of a layer norm has an ipubuild operator")


def softmax(cv: Converter, n: Node):
    e = cv.entry(n.inputs[0])
    axis = n.attr("axis", -1 if n.opset >= 13 else 1) % len(e.shape)
    if axis != len(e.shape) - 1:
        raise ConversionError("only a softmax over the last axis has an ipubuild operator")
    if isinstance(e, Form) and e.kind == "scores":
        vid = cv.add("softmax", [e.data["vid"]], scale=float(np.float32(e.data["scale"])))
        return [_form("probs", e.shape, vid=vid, qkv=e.data["qkv"])]
    x = _val(cv, e)
    return [Val(cv.add("softmax", [x.vid]), x.shape)]


def layer_normalization(cv: Converter, n: Node):
    x = _val(cv, cv.entry(n.inputs[0]))
    if n.attr("axis", -1) % len(x.shape) != len(x.shape) - 1:
        raise ConversionError("only a layer norm over the last axis has an ipubuild operator")
    cols = x.shape[-1]
    g = _bias(cv.entry(n.inputs[1]), cols)
    b = _bias(cv.entry(n.inputs[2]), cols) if len(n.inputs) > 2 and n.inputs[2] else np.zeros(cols, np.float32)
    if g is None or b is None:
        raise ConversionError(f"needs constant scale and bias of {cols} elements")
    ins = [x.vid, cv.add_constant(g, n.inputs[1]),
           cv.add_constant(b, n.inputs[2] if len(n.inputs) > 2 and n.inputs[2] else f"{n.name}.bias")]
    return [Val(cv.add("layernorm", ins, eps=float(n.attr("epsilon", 1e-5))), x.shape)]


def gelu(cv: Converter, n: Node):
    """ONNX Gelu (opset 20): ipubuild's gelu (the tanh form) for either approximation."""
    x = _val(cv, cv.entry(n.inputs[0]))
    return [Val(cv.add("gelu", [x.vid]), x.shape)]


def same(cv: Converter, n: Node):
    """Cast to float, Identity kept for a graph output: the same tensor."""
    e = cv.entry(n.inputs[0])
    if n.op_type == "Cast":
        from onnx import TensorProto
        if n.attr("to") != TensorProto.FLOAT:
            raise ConversionError("only a cast to float32 of a computed value has an ipubuild operator")
    return [e]


BUILTIN = {
    "Conv": conv, "Reshape": reshape, "Flatten": reshape, "Squeeze": reshape, "Unsqueeze": reshape,
    "Transpose": transpose, "Split": split, "Gather": gather, "Slice": slice_, "Concat": concat,
    "MatMul": matmul, "Gemm": gemm, "Add": add, "Mul": mul, "Div": div, "Erf": erf,
    "Tanh": lambda cv, n: erf(cv, n, "tanh"), "Pow": pow_, "ReduceMean": reduce_mean, "Sub": sub,
    "Sqrt": sqrt, "Softmax": softmax, "LayerNormalization": layer_normalization, "Gelu": gelu,
    "Cast": same, "Identity": same,
}


@hookimpl
def ipubuild_onnx_converters():
    return dict(BUILTIN)
