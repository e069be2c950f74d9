"""Export a model of timm's to ONNX, for an ``onnx`` target:

    python -m ipubuild.graph.export timm vit_base_patch16_224 models/vit_b16.onnx

(torch, torchvision and timm, imported only here: a CPU torch and its own torchvision first,
then ``pip install -e '.[export]'``; README, "A model of your own".) The model is created with
``pretrained=False`` — random initialisation, as timm gives it — unless ``--pretrained`` is given
(that downloads timm's weights from the Hugging Face hub, which needs the network); a checkpoint
of your own is loaded with ``--checkpoint path.pth`` (a state dict). The export is torch's
TorchScript-based exporter at opset 17 with a symbolic batch (``dynamo=False``: the form
ipubuild's converters know — Shape/Gather/Concat shape arithmetic, Erf-GELU, attention as
MatMul/Softmax/Transpose), in eval mode (dropouts off). Then point a target at it::

    [model]
    family = "onnx"
    file = "models/vit_b16.onnx"
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path


def export_timm(name: str, out: Path, *, opset: int = 17, pretrained: bool = False, checkpoint: str | None = None,
                seed: int = 0) -> dict:
    import timm
    import torch
    torch.manual_seed(seed)
    model = timm.create_model(name, pretrained=pretrained)
    if checkpoint:
        state = torch.load(checkpoint, map_location="cpu", weights_only=True)
        model.load_state_dict(state.get("state_dict", state) if isinstance(state, dict) else state)
    model.eval()
    # the attention as MatMul/Softmax (timm's fused F.scaled_dot_product_attention exports the
    # same arithmetic in another order; the plain form is the one every exporter version writes)
    for m in model.modules():
        if hasattr(m, "fused_attn"):
            m.fused_attn = False
    cfg = model.pretrained_cfg if hasattr(model, "pretrained_cfg") else {}
    c, h, w = cfg.get("input_size", (3, 224, 224))
    x = torch.randn(1, c, h, w)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    kwargs = dict(opset_version=opset, input_names=["image"], output_names=["logits"],
                  dynamic_axes={"image": {0: "batch"}, "logits": {0: "batch"}}, do_constant_folding=True)
    with torch.no_grad():
        try:
            torch.onnx.export(model, (x,), str(out), dynamo=False, **kwargs)
        except TypeError:              # a torch before the dynamo switch
            torch.onnx.export(model, (x,), str(out), **kwargs)
    params = sum(p.numel() for p in model.parameters())
    return {"model": name, "file": str(out), "parameters": params, "input": [1, c, h, w], "opset": opset,
            "pretrained": pretrained or bool(checkpoint), "bytes": out.stat().st_size}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ipubuild.graph.export", description=__doc__.split("\n\n")[0])
    ap.add_argument("source", choices=["timm"], help="where the model comes from")
    ap.add_argument("name", help="the model's name there (e.g. vit_base_patch16_224, vit_tiny_patch16_224)")
    ap.add_argument("output", help="the .onnx file to write")
    ap.add_argument("--opset", type=int, default=17)
    ap.add_argument("--pretrained", action="store_true", help="timm's trained weights (downloads them)")
    ap.add_argument("--checkpoint", help="a state dict to load (.pth)")
    ap.add_argument("--seed", type=int, default=0, help="torch's seed for the random initialisation")
    a = ap.parse_args(argv)
    try:
        import timm  # noqa: F401
        import torch  # noqa: F401
    except (ImportError, RuntimeError) as exc:   # RuntimeError: a torchvision built for another torch
        missing = getattr(exc, "name", None) or "torch, timm and torchvision"
        print(f"error: python -m ipubuild.graph.export needs {missing} ({exc}); install a CPU torch and the "
              "torchvision built for it first, then pip install -e '.[export]' (README, 'A model of your own')",
              file=sys.stderr)
        return 2
    info = export_timm(a.name, Path(a.output), opset=a.opset, pretrained=a.pretrained, checkpoint=a.checkpoint,
                       seed=a.seed)
    weights = "trained" if info["pretrained"] else f"random (pretrained=False, seed {a.seed})"
    print(f"wrote {info['file']}: timm {info['model']}, {info['parameters']:,} parameters, {weights} weights, "
          f"opset {info['opset']}, {info['bytes']:,} bytes")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
