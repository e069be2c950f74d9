"""How long importing an ONNX model takes: a ViT-B/16-sized file (224 px, patch 16, width 768,
12 blocks, 86 M parameters, ~346 MB, written by ``ipubuild.builtin.onnx_vit`` in timm's exported form)
read, checked, shape-inferred, folded and converted to ipubuild's graph — ``import_model``, what
``lower_model`` does before the cast policy. The goal is ≤ 5 s on the 2-core machine. Also
hashing the file once (what doit's content check costs when the file changed). Writes JSON
(default benchmarks/results/onnx_import.json) and prints a table.

    python benchmarks/onnx_import.py [--repeats 3] [--small] [--out PATH]

``--small``: the shipped 1.7 MB model instead (seconds; for a quick look).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
B16 = {"image_size": 224, "channels": 3, "patch": 16, "width": 768, "heads": 12, "mlp": 3072, "blocks": 12,
       "classes": 1000}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "onnx_import.json"))
    a = ap.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    import onnx

    from ipubuild.graph.onnx_import import import_model
    from ipubuild.builtin.onnx_vit import vit_onnx
    from ipubuild.plugins import get_plugin_manager
    with tempfile.TemporaryDirectory() as tmp:
        if a.small:
            path, params = ROOT / "targets" / "models" / "vit_onnx.onnx", "shipped vit_onnx"
        else:
            t0 = time.perf_counter()
            path, params = Path(tmp) / "vit_b16.onnx", B16
            onnx.save_model(vit_onnx(B16, 0), str(path))
            print(f"[bench] wrote a ViT-B/16 ONNX file in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
        data = path.read_bytes()
        pm = get_plugin_manager()
        hashes, imports = [], []
        for i in range(a.repeats):
            t0 = time.perf_counter()
            hashlib.sha256(path.read_bytes()).hexdigest()
            hashes.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            m = import_model(pm, data, {}, path.name, batch=None, seed=0)
            imports.append(time.perf_counter() - t0)
            print(f"[bench] import {i + 1}/{a.repeats}: {imports[-1]:.2f} s", file=sys.stderr)
        out = {"model": params, "file_bytes": len(data), "nodes": len(onnx.load_model_from_string(data).graph.node),
               "operations": len(m.graph.ops), "constants": len(m.constants),
               "import_s": {"median": round(statistics.median(imports), 3), "all": [round(x, 3) for x in imports]},
               "hash_s": {"median": round(statistics.median(hashes), 3)},
               "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
               "cpus": os.cpu_count(), "goal_import_s": 5.0}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(out, indent=1) + "\n")
    print(f"| file | nodes | operations | import (median) | sha256 of the file | peak RSS |\n|---|---|---|---|---|---|\n"
          f"| {out['file_bytes'] / 2**20:.0f} MiB | {out['nodes']} | {out['operations']} | {out['import_s']['median']} s "
          f"| {out['hash_s']['median']} s | {out['peak_rss_mb']} MB |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
