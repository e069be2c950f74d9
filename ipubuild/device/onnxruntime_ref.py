"""onnxruntime as the independent float32 reference of an ONNX target.

``compare_onnxruntime`` runs the target's model file with onnxruntime (a runtime nobody here
wrote) on the same input the device ran, and compares the device's outputs with it: the closing
lines print ``onnxruntimeMinimumCosineSimilarity=… onnxruntimeMaximumAbsoluteError=…``. It is a
report figure, never the gate (the gate is the device-precision reference), and nothing the
package is made of reads it — onnxruntime's kernels differ from CPU to CPU in their last bits,
so it runs single-threaded and sequential, and only this report depends on it. Without
onnxruntime the report says so, and why.
"""
from __future__ import annotations

import tempfile
from pathlib import Path

from ..engine import canonical
from ..engine.engine import phase
from ..graph import tensors


def onnxruntime_version() -> str | None:
    """The installed onnxruntime's version (part of the phase's configuration), or None."""
    from importlib.metadata import PackageNotFoundError, version
    for dist in ("onnxruntime", "onnxruntime-gpu"):
        try:
            return version(dist)
        except PackageNotFoundError:
            continue
    return None


@phase("compare_onnxruntime", inputs=("device_run", "model/*"), outputs=("onnxruntime",),
       config=("target.seed", "model", "onnxruntime"))
def compare_onnxruntime(ctx):
    """The device's outputs against onnxruntime's on the same input (a report figure)."""
    return {"onnxruntime": canonical.dumps(_compare(ctx))}


def _compare(ctx) -> dict:
    if ctx.config.get("onnxruntime") is None:
        return {"available": False, "why": "onnxruntime is not installed (pip install 'ipubuild[onnx]')"}
    import io

    import numpy as np

    from ..graph.onnx_import import DATA_SLOT, INPUT_SLOT, MODEL_SLOT, model_input, read_model
    from ..graph.reference import compare
    files = {f"model/{k}": d for k, d in ctx.family("model").items()}
    m = ctx.config["model"]
    try:
        import onnxruntime as ort
    except ImportError as exc:
        return {"available": False, "why": f"onnxruntime does not import ({exc})"}
    data = ctx.engine.fetch(files[MODEL_SLOT])
    external = {slot[len(DATA_SLOT):]: ctx.engine.fetch(d) for slot, d in files.items() if slot.startswith(DATA_SLOT)}
    model, batch = read_model(data, m["file"], m.get("batch") or None, external)
    array = None
    if m.get("input"):
        array = np.load(io.BytesIO(ctx.engine.fetch(files[INPUT_SLOT])), allow_pickle=False)
    (inp,) = [i for i in model.graph.input if i.name not in {t.name for t in model.graph.initializer}]
    shape = [d.dim_value for d in inp.type.tensor_type.shape.dim]
    x = model_input(shape, ctx.config["target"]["seed"], array, "model.input")
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = opts.inter_op_num_threads = 1
    opts.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    opts.log_severity_level = 3
    try:
        with tempfile.TemporaryDirectory(prefix="ipubuild-ort-") as tmp:
            path = Path(tmp) / "model.onnx"
            path.write_bytes(data)          # external data files beside it, by their locations
            for slot, digest in files.items():
                if slot.startswith(DATA_SLOT):
                    f = Path(tmp) / slot[len(DATA_SLOT):]
                    f.parent.mkdir(parents=True, exist_ok=True)
                    f.write_bytes(ctx.engine.fetch(digest))
            session = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
            names = [o.name for o in session.get_outputs()]
            outs = session.run(None, {inp.name: x})
    except Exception as exc:  # noqa: BLE001 - onnxruntime's own errors (an op it lacks, …)
        return {"available": False, "why": f"onnxruntime could not run the model: {' '.join(str(exc).split())[:200]}"}
    device = tensors.unpack(ctx.bytes("device_run"))
    ref = {n: np.asarray(o, np.float32) for n, o in zip(names, outs) if n in device}
    if not ref:
        return {"available": False, "why": "the device's outputs are named unlike the model's"}
    cos, err = compare(device, ref)
    return {"available": True, "onnxruntime": ctx.config["onnxruntime"], "threads": 1,
            "min_cosine": f"{cos:.9f}", "max_abs_error": f"{err:.6f}", "outputs": sorted(ref)}


def closing_line(report: dict) -> str:
    """The closing line of an ONNX target's build."""
    if report.get("available"):
        return (f"onnxruntimeMinimumCosineSimilarity={report['min_cosine']} "
                f"onnxruntimeMaximumAbsoluteError={report['max_abs_error']}")
    return f"onnxruntime: no comparison: {report.get('why', 'unknown')}"
