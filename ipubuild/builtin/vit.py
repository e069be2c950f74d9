"""The ViT front end: a Vision Transformer of ``blocks`` encoder blocks, built as a float32 graph
with deterministic weights and image from the target's seed (no downloads)."""
from __future__ import annotations

import math

import numpy as np

from .. import hookimpl
from ..engine.errors import UserError
from ..engine.log import progress
from ..graph.frontend import Model
from ..graph.ir import Graph
from ..compiler.targets import Field, check_table

SCHEMA = {
    "image_size": Field(int, 224, min=8, max=4096, doc="square image side in pixels"),
    "channels": Field(int, 3, min=1, max=64),
    "patch": Field(int, 16, min=1, max=512),
    "width": Field(int, 192, min=8, max=8192, doc="embedding width"),
    "heads": Field(int, 3, min=1, max=128),
    "mlp": Field(int, 768, min=8, max=32768),
    "blocks": Field(int, 1, min=1, max=128),
    "classes": Field(int, 1000, min=1, max=100000),
}


def build_vit(p: dict, seed: int, norm=None) -> Model:
    """The ViT graph for checked parameters ``p``. ``norm(graph, x, name, width, const)``, if
    given, replaces layer normalisation (a plugin's front end can swap in its own operator);
    ``const(name, shape, scale, offset=0.0)`` makes a deterministic constant."""
    g, rng = Graph(), np.random.default_rng(seed)
    consts: dict[int, np.ndarray] = {}

    def const(name, shape, scale, offset=0.0):
        vid = g.constant(name, shape)
        consts[vid] = (offset + scale * rng.standard_normal(shape)).astype(np.float32)
        return vid

    def linear(x, name, n_in, n_out):
        w = const(f"{name}.weight", (n_in, n_out), 1 / math.sqrt(n_in))
        b = const(f"{name}.bias", (n_out,), 0.02)
        return g.add("matmul", [x, w, b], name=name)

    def layernorm(x, name, d):
        if norm is not None:
            return norm(g, x, name, d, const)
        return g.add("layernorm", [x, const(f"{name}.gamma", (d,), 0.1, 1.0),
                                   const(f"{name}.beta", (d,), 0.1)], name=name, eps=1e-6)

    s, c, pt, d, h = p["image_size"], p["channels"], p["patch"], p["width"], p["heads"]
    image = g.input("image", (s, s * c))
    x = g.add("patchify", [image], name="patchify", patch=pt, channels=c)
    x = linear(x, "patch_embed", pt * pt * c, d)
    tokens = (s // pt) ** 2 + 1
    x = g.add("concat_rows", [const("cls_token", (1, d), 0.5), x], name="prepend_cls")
    x = g.add("add", [x, const("pos_embed", (tokens, d), 0.5)], name="pos_embed")
    for i in range(p["blocks"]):
        progress("model blocks built", i, p["blocks"])
        y = layernorm(x, f"block{i}.ln1", d)
        qkv = linear(y, f"block{i}.qkv", d, 3 * d)
        scores = g.add("attention_scores", [qkv], name=f"block{i}.scores", heads=h)
        probs = g.add("softmax", [scores], name=f"block{i}.softmax", scale=1 / math.sqrt(d // h))
        ctx = g.add("attention_context", [probs, qkv], name=f"block{i}.context", heads=h)
        x = g.add("add", [x, linear(ctx, f"block{i}.proj", d, d)], name=f"block{i}.residual1")
        y = layernorm(x, f"block{i}.ln2", d)
        y = g.add("gelu", [linear(y, f"block{i}.fc1", d, p["mlp"])], name=f"block{i}.gelu")
        x = g.add("add", [x, linear(y, f"block{i}.fc2", p["mlp"], d)], name=f"block{i}.residual2")
    progress("model blocks built", p["blocks"], p["blocks"])
    features = layernorm(x, "final_norm", d)
    cls = g.add("slice_rows", [features], name="cls_slice", start=0, end=1)
    logits = linear(cls, "head", d, p["classes"])
    g.outputs = [features, logits]
    g.values[features].name, g.values[logits].name = "features", "logits"
    img = rng.standard_normal((s, s * c)).astype(np.float32)
    return Model(g, consts, {image: img})


@hookimpl
def ipubuild_model_families():
    return ["vit"]


def vit_params(params: dict, where: str) -> dict:
    """The ``[model]`` table checked against SCHEMA (defaults filled in), with one-line errors
    naming ``<where>: model.<key>``; front ends that build a ViT variant use it too."""
    p = check_table(params, SCHEMA, where, "model")
    if p["image_size"] % p["patch"]:
        raise UserError(f"{where}: model.patch", f"patch {p['patch']} does not divide image_size "
                        f"{p['image_size']}; choose a divisor")
    if p["width"] % p["heads"]:
        raise UserError(f"{where}: model.heads", f"heads {p['heads']} does not divide width "
                        f"{p['width']}; choose a divisor")
    return p


@hookimpl
def ipubuild_build_model(family, params, seed, where):
    if family != "vit":
        return None
    return build_vit(vit_params(params, where), seed)
