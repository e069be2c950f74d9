"""Running a package on a device backend, and the numerical test against the host reference.

A backend (a plugin, ``ipubuild_device_backends``) owns its device through a lock file, loads the
package through the validating reader, runs the host calls and returns a :class:`DeviceRun`;
asked to, it also reads back every operation's output (``probes``), which the numerical test
compares operation by operation (``ipubuild.compare``).
"""
from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import inspect
import math
import os
import tempfile
from pathlib import Path

import numpy as np

from ..engine import canonical
from ..graph import tensors
from ..engine.engine import phase
from ..engine.errors import UserError
from ..engine.log import log


@dataclasses.dataclass
class DeviceRun:
    """What a device returns: outputs by name, the profile (cycles per tile per step) and its
    Chrome trace events; and, when it was given probes, the values it read back by name."""
    outputs: dict[str, np.ndarray]
    profile: dict
    trace: list
    values: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)


@contextlib.contextmanager
def device_ownership(name: str):
    """Hold the device's lock file for the duration (``$IPUBUILD_DEVICE_LOCK_DIR`` or /tmp)."""
    folder = Path(os.environ.get("IPUBUILD_DEVICE_LOCK_DIR") or tempfile.gettempdir())
    path = folder / f"ipubuild-{name}-device.lock"
    log.info("waiting for hardware ownership", path=path)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDONLY | os.O_CREAT, 0o666)   # read-only: another user's lock file works too
    except OSError as exc:
        raise UserError("IPUBUILD_DEVICE_LOCK_DIR", f"cannot create the device's lock file {path}: "
                        f"{exc.strerror or exc}; point it at a writable folder") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        log.info("acquired hardware ownership", path=path)
        yield path
    finally:
        os.close(fd)


def backends() -> dict:
    from ..plugins import get_plugin_manager
    return get_plugin_manager().collect("ipubuild_device_backends", callable,
                                        "a dict of device names to backend factories", mapping=True)


def prepare(name: str) -> None:
    """Ready a device's backend, if its factory (the backend's class) has a ``prepare`` method:
    ``factory().prepare()``. An unknown name or a broken plugin is left for ``run_device`` to
    report."""
    factory = backends().get(name)
    if callable(getattr(factory, "prepare", None)):
        factory().prepare()


def reads_back(backend) -> bool:
    """Whether a backend's ``run`` takes ``probes`` (reads back operations' outputs)."""
    try:
        return "probes" in inspect.signature(backend.run).parameters
    except (TypeError, ValueError):
        return False


@phase("run_device", inputs=("package", "params", "graph", "value_map"),
       outputs=("device_run", "values", "profile", "trace"),
       config=("name", "target.device", "numerics.compare"), hooks=("ipubuild_device_backends", "ipubuild_operators"))
def run_device(ctx):
    """Run the package; for the per-operation comparison, read back every operation's output
    (``values``; empty when the comparison is of the graph's outputs only)."""
    from . import compare
    from ..graph.ir import Graph
    name = ctx.config["target"]["device"]
    found = backends()
    if name not in found:
        raise UserError("target.device", f"unknown device {name!r}; known: {', '.join(sorted(found))}")
    g = Graph.from_json(ctx.json("graph"))
    arrays = tensors.unpack(ctx.bytes("params"))
    inputs = {g.values[v].name: arrays[f"v{v}"] for v in g.inputs}
    backend = found[name]()
    setting = ctx.config["numerics"]["compare"]
    mode, _ = compare.mode(setting, ctx.json("value_map"))
    if mode == "operations" and not reads_back(backend):
        if setting == "operations":
            raise UserError("numerics.compare", f"device {name} cannot read back operations' outputs; "
                            'set it to "outputs" or "auto"')
        mode = "outputs"
    from .package import validated
    package = ctx.bytes("package")
    validated(package, "package", ctx.digest("package"))    # the store checked its digest: not hashed again
    with tempfile.TemporaryDirectory(prefix="ipubuild-device-") as work:
        if mode == "operations":
            run = backend.run(package, inputs, Path(work), probes=compare.probes(ctx.json("value_map")))
        else:
            run = backend.run(package, inputs, Path(work))
    return {"device_run": tensors.pack(run.outputs), "values": tensors.pack(run.values if mode == "operations" else {}),
            "profile": canonical.dumps(run.profile),
            "trace": trace_bytes(run.trace)}


#: the scalars orjson writes as ``json`` does (floats are checked value by value)
_FLAT = (str, int, bool, type(None))


def trace_bytes(trace: list) -> bytes:
    """The trace artifact: ``canonical.dumps({"traceEvents": trace, "displayTimeUnit": "ns"})``,
    written by orjson where that gives the same bytes (ViT-B/16's 23 MB trace: 0.49 s by
    ``json``, 0.18 s here, the checks included). It does when every event is a flat dict (its
    values, and those of a dict value such as ``args``, plain scalars), every distinct float's
    orjson text is its ``repr`` (orjson writes 5e-05 as 0.00005), and the text is ASCII without
    DEL (``json`` escapes both); else ``canonical.dumps`` writes it."""
    import orjson
    doc = {"traceEvents": trace, "displayTimeUnit": "ns"}
    floats: set = set()
    for event in trace:
        if type(event) is not dict:
            return canonical.dumps(doc)
        for v in event.values():
            if type(v) is float:
                floats.add(v)
            elif type(v) is dict:
                for x in v.values():
                    if type(x) is float:
                        floats.add(x)
                    elif type(x) not in _FLAT:
                        return canonical.dumps(doc)
            elif type(v) not in _FLAT:
                return canonical.dumps(doc)
    if not all(math.isfinite(f) and orjson.dumps(f) == repr(f).encode() for f in floats):
        return canonical.dumps(doc)
    try:
        out = orjson.dumps(doc, option=orjson.OPT_SORT_KEYS)
    except TypeError:                   # an integer past 64 bits
        return canonical.dumps(doc)
    return out if out.isascii() and b"\x7f" not in out else canonical.dumps(doc)


@phase("check_numerics", inputs=("device_run", "values", "value_map", "reference", "float_reference", "graph",
                                  "params", "profile", "cost"),
       outputs=("verdict",), config=("numerics.min_cosine", "numerics.max_abs_error", "numerics.compare"),
       hooks=("ipubuild_operators",))
def check_numerics(ctx):
    """The verdict: the numerical test against the host reference, the device's own checks, and
    the program's cost — everything the build's closing lines print.

    The test compares the device with the host reference *in device precision* (the same FP8 casts
    at the same points): that isolates what the device and its kernels got wrong. It passes when
    the graph's outputs are within the gates (``[numerics] min_cosine``, ``max_abs_error``) and,
    in the per-operation comparison (``numerics.compare``), every operation's output is within
    its tolerance of its reference on the device's own inputs (``ipubuild.compare``); the first
    that is not is named. The error against the float32 model (before casts) is reported beside
    it — the quantisation error of the cast policy, to compare policies — but does not gate."""
    from . import compare
    from ..graph.artifacts import graph_of, params_of
    from ..engine.log import log
    from ..graph.reference import compare as compare_outputs
    from .verdict import diverged
    device, ref = tensors.unpack(ctx.bytes("device_run")), tensors.unpack(ctx.bytes("reference"))
    cos, err = compare_outputs(device, ref)
    fcos, ferr = compare_outputs(device, tensors.unpack(ctx.bytes("float_reference")))
    n = ctx.config["numerics"]
    failed_gates = [g for g, ok in (("min_cosine", np.isfinite(cos) and cos >= n["min_cosine"]),
                                    ("max_abs_error", err <= n["max_abs_error"])) if not ok]
    vmap = ctx.json("value_map")
    mode, why = compare.mode(n["compare"], vmap)
    values = tensors.unpack(ctx.bytes("values"))
    if mode == "operations" and not values:
        mode, why = "outputs", "the device did not read back operations' outputs"
    operations = {"mode": mode}
    if mode == "operations":
        g = graph_of(ctx)
        consts, inputs = params_of(ctx, g)
        operations.update(compare.check_operations(g, consts, inputs, values, vmap))
        if operations["first"]:
            log.info(diverged(operations["first"]))
    else:
        operations["why"] = why
    profile = ctx.json("profile")
    ok = not failed_gates and not operations.get("diverged")
    return {"verdict": canonical.dumps({
        "min_cosine": f"{cos:.9f}", "max_abs_error": f"{err:.6f}", "pass": ok, "failed_gates": failed_gates,
        "float32": {"min_cosine": f"{fcos:.9f}", "max_abs_error": f"{ferr:.6f}"},
        "thresholds": {"min_cosine": n["min_cosine"], "max_abs_error": n["max_abs_error"]},
        "operations": operations,
        "device_ok": bool(profile.get("ok", False)), "device_failures": profile.get("failures", []),
        "device_failure_count": profile.get("failure_count", 0),
        **({"unchecked": profile["unchecked"]} if profile.get("unchecked") else {}), "samples": profile.get("samples", 0),
        "tiles": profile.get("tiles", 0), "total_cycles": profile.get("total_cycles", 0),
        "cost": {k: v for k, v in ctx.json("cost").items() if k != "steps"}})}
