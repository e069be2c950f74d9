"""Running a package on a device backend, and the numerical test against the host reference.

A backend (a plugin, ``ipubuild_device_backends``) owns its device through a lock file, loads the
package through the validating reader, runs the host calls and returns a :class:`DeviceRun`.
"""
from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import os
import tempfile
from pathlib import Path

import numpy as np

from . import canonical, tensors
from .engine import phase
from .errors import UserError
from .log import log


@dataclasses.dataclass
class DeviceRun:
    """What a device returns: outputs by name, the profile (cycles per tile per step) and its
    Chrome trace events."""
    outputs: dict[str, np.ndarray]
    profile: dict
    trace: list


@contextlib.contextmanager
def device_ownership(name: str):
    """Hold the device's lock file for the duration (``$IPUBUILD_DEVICE_LOCK_DIR`` or /tmp)."""
    path = Path(os.environ.get("IPUBUILD_DEVICE_LOCK_DIR") or tempfile.gettempdir()) / f"ipubuild-{name}-device.lock"
    log.info("waiting for hardware ownership", path=path)
    fd = os.open(path, os.O_RDONLY | os.O_CREAT, 0o666)   # read-only: another user's lock file works too
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        log.info("acquired hardware ownership", path=path)
        yield path
    finally:
        os.close(fd)


def backends() -> dict:
    from .plugins import get_plugin_manager
    return get_plugin_manager().collect("ipubuild_device_backends", callable,
                                        "a dict of device names to backend factories", mapping=True)


@phase("run_device", inputs=("package", "params", "graph"), outputs=("device_run", "profile", "trace"),
       config=("name", "target.device"), hooks=("ipubuild_device_backends", "ipubuild_operators"))
def run_device(ctx):
    from .ir import Graph
    name = ctx.config["target"]["device"]
    found = backends()
    if name not in found:
        raise UserError("target.device", f"unknown device {name!r}; known: {', '.join(sorted(found))}")
    g = Graph.from_json(ctx.json("graph"))
    arrays = tensors.unpack(ctx.bytes("params"))
    inputs = {g.values[v].name: arrays[f"v{v}"] for v in g.inputs}
    with tempfile.TemporaryDirectory(prefix="ipubuild-device-") as work:
        run = found[name]().run(ctx.bytes("package"), inputs, Path(work))
    return {"device_run": tensors.pack(run.outputs), "profile": canonical.dumps(run.profile),
            "trace": canonical.dumps({"traceEvents": run.trace, "displayTimeUnit": "ns"})}


@phase("check_numerics", inputs=("device_run", "reference", "float_reference", "profile", "cost"),
       outputs=("verdict",), config=("numerics.min_cosine", "numerics.max_abs_error"))
def check_numerics(ctx):
    """The verdict: the numerical test against the host reference, the device's own checks, and
    the program's cost — everything the build's closing lines print.

    The test compares the device with the host reference *in device precision* (the same FP8 casts
    at the same points): that isolates what the device and its kernels got wrong. The error
    against the float32 model (before casts) is reported beside it — the quantisation error of
    the cast policy, to compare policies — but does not gate."""
    from .reference import compare
    device, ref = tensors.unpack(ctx.bytes("device_run")), tensors.unpack(ctx.bytes("reference"))
    cos, err = compare(device, ref)
    fcos, ferr = compare(device, tensors.unpack(ctx.bytes("float_reference")))
    n = ctx.config["numerics"]
    ok = bool(np.isfinite(cos) and cos >= n["min_cosine"] and err <= n["max_abs_error"])
    profile = ctx.json("profile")
    return {"verdict": canonical.dumps({
        "min_cosine": f"{cos:.9f}", "max_abs_error": f"{err:.6f}", "pass": ok,
        "float32": {"min_cosine": f"{fcos:.9f}", "max_abs_error": f"{ferr:.6f}"},
        "thresholds": {"min_cosine": n["min_cosine"], "max_abs_error": n["max_abs_error"]},
        "device_ok": bool(profile.get("ok", False)), "samples": profile.get("samples", 0),
        "tiles": profile.get("tiles", 0), "total_cycles": profile.get("total_cycles", 0),
        "cost": {k: v for k, v in ctx.json("cost").items() if k != "steps"}})}
