"""A ViT as an ONNX file, written the way ``torch.onnx.export`` writes timm's models (opset 17):
Conv patch embedding, shape arithmetic for the batch (Shape/Gather/Unsqueeze/Concat/Expand),
LayerNormalization, MatMul + Add linears, the heads as Reshape/Transpose/Split/Squeeze,
attention as MatMul/Softmax/Transpose, Erf-GELU, Identity for dropouts, a Gather of the class
token and a Gemm head. The weights are the built-in ViT family's for the same parameters and
seed (``ipubuild.builtin.vit.build_vit``), so the two front ends can be compared.

Deterministic: the same parameters give the same bytes. The shipped model
(``targets/models/vit_onnx.onnx``) is::

    python -m ipubuild.builtin.onnx_vit targets/models/vit_onnx.onnx --image-size 96 --width 128 \\
        --heads 4 --mlp 384 --blocks 2 --classes 10 --seed 0
"""
from __future__ import annotations

import argparse
import math

import numpy as np

PARAMS = {"image_size": 96, "channels": 3, "patch": 16, "width": 128, "heads": 4, "mlp": 384, "blocks": 2,
          "classes": 10}


def vit_weights(p: dict, seed: int) -> tuple[dict, np.ndarray]:
    """The built-in ViT's weights by name, and its image as NCHW ``[1, C, S, S]``."""
    from .vit import build_vit
    m = build_vit(p, seed)
    w = {m.graph.values[v].name: a for v, a in m.constants.items()}
    (img,) = m.inputs.values()
    s, c = p["image_size"], p["channels"]
    return w, np.ascontiguousarray(img.reshape(s, s, c).transpose(2, 0, 1)[None])


def vit_onnx(p: dict | None = None, seed: int = 0, opset: int = 17):
    """The ONNX ModelProto of the ViT with parameters ``p`` (``PARAMS`` by default)."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper
    p = dict(PARAMS, **(p or {}))
    w, _ = vit_weights(p, seed)
    s, c, pt, d, h = p["image_size"], p["channels"], p["patch"], p["width"], p["heads"]
    dh = d // h
    nodes, inits = [], []
    counter = [0]

    def init(name, array):
        a = np.asarray(array)
        inits.append(numpy_helper.from_array(np.ascontiguousarray(a).reshape(a.shape), name))
        return name

    def const(array, dtype=np.int64):
        counter[0] += 1
        return init(f"onnx::Constant_{counter[0]}", np.asarray(array, dtype))

    def node(op, inputs, name, n_out=1, **attrs):
        outs = [f"{name}_output_{i}" for i in range(n_out)]
        nodes.append(helper.make_node(op, inputs, outs, name=name, **attrs))
        return outs if n_out > 1 else outs[0]

    def dim(x, i, name):
        shape = node("Shape", [x], f"{name}/Shape")
        g = node("Gather", [shape, const(i)], f"{name}/Gather", axis=0)
        return node("Unsqueeze", [g, const([0])], f"{name}/Unsqueeze")

    def linear(x, prefix, key):
        y = node("MatMul", [x, init(f"{key}.weight.T", w[f"{key}.weight"])], f"{prefix}/MatMul")
        return node("Add", [init(f"{key}.bias", w[f"{key}.bias"]), y], f"{prefix}/Add")

    def layernorm(x, prefix, key):
        return node("LayerNormalization", [x, init(f"{key}.weight", w[f"{key}.gamma"]),
                                           init(f"{key}.bias", w[f"{key}.beta"])], f"{prefix}/LayerNormalization",
                    axis=-1, epsilon=1e-6)

    kernel = w["patch_embed.weight"].reshape(pt, pt, c, d).transpose(3, 2, 0, 1)
    x = node("Conv", ["image", init("patch_embed.proj.weight", kernel), init("patch_embed.proj.bias",
                                                                               w["patch_embed.bias"])],
             "/patch_embed/proj/Conv", kernel_shape=[pt, pt], strides=[pt, pt], pads=[0, 0, 0, 0],
             dilations=[1, 1], group=1)
    shape = node("Concat", [dim(x, 0, "/patch_embed/b"), dim(x, 1, "/patch_embed/c"), const([-1])],
                 "/patch_embed/Concat", axis=0)
    x = node("Reshape", [x, shape], "/patch_embed/Reshape")
    x = node("Transpose", [x], "/patch_embed/Transpose", perm=[0, 2, 1])
    cls_shape = node("Concat", [dim(x, 0, "/cls"), const([1, d])], "/Concat", axis=0)
    cls = node("Expand", [init("cls_token", w["cls_token"].reshape(1, 1, d)), cls_shape], "/Expand")
    x = node("Concat", [cls, x], "/Concat_1", axis=1)
    x = node("Add", [x, init("pos_embed", w["pos_embed"][None])], "/Add")
    x = node("Identity", [x], "/pos_drop/Identity")
    for i in range(p["blocks"]):
        b, k = f"/blocks.{i}", f"block{i}"
        y = layernorm(x, f"{b}/norm1", f"{k}.ln1")
        qkv = linear(y, f"{b}/attn/qkv", f"{k}.qkv")
        shape = node("Concat", [dim(y, 0, f"{b}/attn/b"), dim(y, 1, f"{b}/attn/n"), const([3, h, dh])],
                     f"{b}/attn/Concat", axis=0)
        qkv = node("Reshape", [qkv, shape], f"{b}/attn/Reshape")
        qkv = node("Transpose", [qkv], f"{b}/attn/Transpose", perm=[2, 0, 3, 1, 4])
        q, kk, v = node("Split", [qkv, const([1, 1, 1])], f"{b}/attn/Split", n_out=3, axis=0)
        q, kk, v = (node("Squeeze", [t, const([0])], f"{b}/attn/Squeeze_{j}") for j, t in enumerate((q, kk, v)))
        q = node("Mul", [q, const(1 / math.sqrt(dh), np.float32)], f"{b}/attn/Mul")
        kt = node("Transpose", [kk], f"{b}/attn/Transpose_1", perm=[0, 1, 3, 2])
        a = node("MatMul", [q, kt], f"{b}/attn/MatMul")
        a = node("Softmax", [a], f"{b}/attn/Softmax", axis=-1)
        a = node("Identity", [a], f"{b}/attn/attn_drop/Identity")
        a = node("MatMul", [a, v], f"{b}/attn/MatMul_1")
        a = node("Transpose", [a], f"{b}/attn/Transpose_2", perm=[0, 2, 1, 3])
        shape = node("Concat", [dim(y, 0, f"{b}/attn/b2"), dim(y, 1, f"{b}/attn/n2"), const([d])],
                     f"{b}/attn/Concat_1", axis=0)
        a = node("Reshape", [a, shape], f"{b}/attn/Reshape_1")
        a = linear(a, f"{b}/attn/proj", f"{k}.proj")
        x = node("Add", [x, a], f"{b}/Add")
        y = layernorm(x, f"{b}/norm2", f"{k}.ln2")
        y = linear(y, f"{b}/mlp/fc1", f"{k}.fc1")
        g = node("Div", [y, const(math.sqrt(2), np.float32)], f"{b}/mlp/act/Div")
        g = node("Erf", [g], f"{b}/mlp/act/Erf")
        g = node("Add", [g, const(1.0, np.float32)], f"{b}/mlp/act/Add")
        g = node("Mul", [y, g], f"{b}/mlp/act/Mul")
        g = node("Mul", [g, const(0.5, np.float32)], f"{b}/mlp/act/Mul_1")
        y = linear(g, f"{b}/mlp/fc2", f"{k}.fc2")
        x = node("Add", [x, y], f"{b}/Add_1")
    feats = layernorm(x, "/norm", "final_norm")
    nodes[-1].output[0] = "features"
    cls = node("Gather", ["features", const(0)], "/Gather", axis=1)
    node("Gemm", [cls, init("head.weight", w["head.weight"].T), init("head.bias", w["head.bias"])], "/head/Gemm",
         transB=1)
    nodes[-1].output[0] = "logits"
    del feats
    graph = helper.make_graph(
        nodes, "vit", [helper.make_tensor_value_info("image", TensorProto.FLOAT, ["batch", c, s, s])],
        [helper.make_tensor_value_info("features", TensorProto.FLOAT, ["batch", (s // pt) ** 2 + 1, d]),
         helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", p["classes"]])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)],
                              producer_name="ipubuild.builtin.onnx_vit", ir_version=8)
    onnx.checker.check_model(model)
    return model


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ipubuild.builtin.onnx_vit", description=__doc__.split("\n\n")[0])
    ap.add_argument("output")
    for k, v in PARAMS.items():
        ap.add_argument("--" + k.replace("_", "-"), type=int, default=v)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    import onnx
    p = {k: getattr(a, k) for k in PARAMS}
    model = vit_onnx(p, a.seed)
    onnx.save_model(model, a.output)
    print(f"wrote {a.output}: ViT {p} seed {a.seed}, {len(model.graph.node)} nodes")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
