"""A Dask worker preload for tests/test_cluster.py (``dask worker --preload <this file>``): makes
one worker misbehave in a way the tests choose with ``$IPUBUILD_TEST_SHIM``.

* ``slow:<folder>`` — before every search candidate it runs, the worker writes
  ``<folder>/running-<pid>`` and waits 3 s: a test then knows a task is in flight on it (to kill
  the worker, or the scheduler, at that moment).
* ``lie`` — every blob the worker returns has one byte flipped (the client must refuse them).
* ``lie-candidates`` — every search candidate the worker evaluates is claimed 1000 cycles cheaper
  than it is (the client must evaluate them itself).

Nothing in ipubuild knows about this file; it wraps ipubuild.remote.cluster's task functions in the
worker process only. (Dask may run a preload twice in one process: the originals are kept on the
module, so the wrappers never wrap themselves.)
"""
from __future__ import annotations

import os
import time
from pathlib import Path

from ipubuild.remote import cluster

_mode = os.environ.get("IPUBUILD_TEST_SHIM", "")
_originals = cluster.__dict__.setdefault("_test_originals", {"evaluate": cluster._evaluate,
                                                              "run_calls": cluster._run_calls})


def _slow_evaluate(payload, _evaluate=_originals["evaluate"]):
    Path(_mode[5:], f"running-{os.getpid()}").write_text(str(payload["attempt"]))
    time.sleep(3)
    return _evaluate(payload)


def _lying_run_calls(payload, _run_calls=_originals["run_calls"]):
    out = _run_calls(payload)
    for r in out["results"]:
        for d, data in r.get("blobs", {}).items():
            r["blobs"][d] = bytes([data[0] ^ 1]) + data[1:] if data else b"x"
    return out


if _mode.startswith("slow:"):
    cluster._evaluate = _slow_evaluate
elif _mode == "lie":
    cluster._run_calls = _lying_run_calls


def _lying_evaluate(payload, _evaluate=_originals["evaluate"]):
    out = _evaluate(payload)
    if "cycles" in out.get("result", {}):
        out["result"] = dict(out["result"], cycles=out["result"]["cycles"] - 1000)
    return out


if _mode == "lie-candidates":
    cluster._evaluate = _lying_evaluate
