"""A target's build as steps: the compiler's phases wired over named artifacts.

``target_steps`` (with ``machine_step``) is the single description of a build; doit tasks
(``ipubuild.tasks``) and the in-process runner both use it. Artifact names are
``<target>/<name>`` (``machines/<machine>`` for what targets share). Paths in steps are relative to
the tree's root where they lie inside it, so the same tree builds the same tasks from any working
directory, and a moved tree keeps its results.
"""
from __future__ import annotations

import os
from pathlib import Path

from ..engine.errors import UserError
from ..compiler.kernels import COUNTER, compiler, compiler_identity, kernel_sources
from ..compiler.machine import MACHINES, load_machine
from ..graph.operators import registry
from .pipeline import Step

from ..engine.files import tree_path
from ..engine.registry import load_phases
from ..device.onnxruntime_ref import onnxruntime_version

load_phases()   # the steps below name phases of every layer: have them all registered


def check_machine(target: dict) -> dict:
    """The target's machine description (a one-line error if it is missing or does not parse)."""
    return load_machine(target["target"]["machine"], where=f"{target['path']}: target.machine")


def machine_step(machine: str, root: Path) -> Step:
    return Step("machine", machine, "read_machine", outputs={"machine": f"machines/{machine}"},
                sources={"file": tree_path(MACHINES / f"{machine}.toml", root)},
                doc=f"read the machine description {machine}")


def compiler_config(memo=None) -> tuple[dict, list[str]]:
    """The compile steps' view of the compiler (command, flags, identity) and the files behind it."""
    cc, cflags = compiler()
    identity, files = compiler_identity(cc, memo)
    return {"cc": cc, "cflags": cflags, "identity": identity}, files


def model_files(target: dict, root) -> dict:
    """The files a target's model family reads, ``{slot: tree path}`` (the ONNX family's model,
    external data and input; none for the others): ``lower_model``'s declared sources."""
    if target["model"].get("family") != "onnx":
        return {}
    from ..graph.onnx_import import declared_sources
    return declared_sources(target, root)


def target_steps(target: dict, root: Path, compiler_cfg: dict) -> list[Step]:
    """The steps that build, run and check one target (``target["path"]`` relative to ``root``)."""
    t = target["name"]
    root = Path(root)
    machine_file = check_machine(target)
    machine = f"machines/{target['target']['machine']}"
    spans = (("build", {"target": t, "tile_count": target["target"]["tile_count"]}),)
    plan_spans = spans + (("phase", {"phase": "plan_package"}),)
    a = lambda name: f"{t}/{name}"  # noqa: E731
    out = Path("artifacts") / t

    def step(task, phase, inputs, outputs, span=spans, **kw):
        kw.setdefault("config", target)
        return Step(task, t, phase, inputs=inputs, outputs=outputs, spans=span, **kw)

    sources = {f"source/{slot}": tree_path(p, root) for slot, p in kernel_sources(registry()).items()}
    compile_cfg = dict(target, compiler=compiler_cfg,
                       kernel_quantum=machine_file["code"]["reservation_quantum"])
    model = model_files(target, root)     # the ONNX model file (and its data), as sources
    return [
        step("lower_model", "lower_model", {}, {"graph": a("graph"), "params": a("params"),
                                                 "float_reference": a("float_reference")},
             sources=model, doc="build the model graph and place the FP8 casts"),
        # planning reads the graph's structure, not its FP8 scales (ipubuild.compiler.weights)
        step("strip_values", "strip_values", {"graph": a("graph")}, {"plan_graph": a("plan_graph")},
             doc="the graph planning reads: shapes, dtypes and operators, no scales"),
        step("compile_kernels", "compile_kernels", {"graph": a("plan_graph")},
             {"objects": a("kernel_objects"), "code_sizes": a("kernel_code_sizes"),
              "reservations": a("kernel_reservations")},
             sources={**sources, "counter": tree_path(COUNTER, root)}, config=compile_cfg,
             doc="compile the kernel variants the target uses (each one a cached action)"),
        step("compile_runtime", "compile_runtime", {"machine": machine}, {"runtime": a("runtime")}),
        step("plan_package", "plan_package", {"graph": a("plan_graph"), "machine": machine, "runtime": a("runtime"),
                                              "reservations": a("kernel_reservations")},
             {"layout": a("layout"), "search": a("search")}, doc="search the layout"),
        step("place_provisional_storage", "place_provisional_storage",
             {"graph": a("plan_graph"), "layout": a("layout"), "machine": machine,
              "reservations": a("kernel_reservations")},
             {"program": a("program"), "provisional_storage": a("provisional_storage"),
              "provisional_code": a("provisional_code")}, plan_spans),
        step("schedule_provisional_exchanges", "schedule_provisional_exchanges",
             {"program": a("program"), "machine": machine}, {"exchange_schedule": a("exchange_schedule")}, plan_spans),
        step("plan_kernels", "plan_kernels", {"program": a("program")}, {"kernel_plan": a("kernel_plan")}, plan_spans),
        step("link_runtime", "link_runtime", {"kernel_plan": a("kernel_plan"), "runtime": a("runtime"),
                                              "machine": machine, "reservations": a("kernel_reservations")},
             {"link_map": a("link_map")}, plan_spans),
        step("link_kernels", "link_kernels", {"link_map": a("link_map"), "objects": a("kernel_objects")},
             {"tile_kernels": a("tile_kernels")}, plan_spans,
             doc="bind each tile's kernel slots to the compiled objects"),
        step("size_tile_code", "size_tile_code", {"program": a("program"), "link_map": a("link_map"),
                                                  "exchange_schedule": a("exchange_schedule")},
             {"code_sizes": a("code_sizes")}, plan_spans),
        step("place_storage", "place_storage", {"program": a("program"), "code_sizes": a("code_sizes"), "machine": machine},
             {"storage": a("storage")}, plan_spans),
        step("lower_exchanges", "lower_exchanges", {"exchange_schedule": a("exchange_schedule"), "storage": a("storage")},
             {"exchange_tables": a("exchange_tables")}, plan_spans),
        step("optimize_exchange_placement", "optimize_exchange_placement",
             {"exchange_tables": a("exchange_tables"), "program": a("program"), "machine": machine},
             {"placed_exchanges": a("placed_exchanges"), "cost": a("cost")}, plan_spans),
        step("bind_values", "bind_values", {"graph": a("graph"), "layout": a("layout"), "program": a("program")},
             {"program": a("bound_program")}, doc="put the model's FP8 scales into the planned program"),
        step("prepare_tile_code", "prepare_tile_code",
             {"graph": a("graph"), "params": a("params"), "program": a("bound_program"), "storage": a("storage"),
              "placed_exchanges": a("placed_exchanges"), "link_map": a("link_map"), "code_sizes": a("code_sizes")},
             {"tile_program": a("tile_program"), "tile_data": a("tile_data"), "host_program": a("host_program")},
             plan_spans),
        step("emit_tile_code", "emit_tile_code", {"tile_program": a("tile_program")},
             {"tile_code": a("tile_code")}, plan_spans),
        step("build_tile_images", "build_tile_images",
             {"tile_code": a("tile_code"), "tile_data": a("tile_data"), "tile_kernels": a("tile_kernels")},
             {"images": a("images")}, plan_spans, doc="build every tile's image (each one a cached action)"),
        step("write_package", "write_package",
             {"images": a("images"), "objects": a("kernel_objects"), "host_program": a("host_program"),
              "machine": machine},
             {"package": a("package")}, files={"package": out / f"{t}.ipuexe"}),
        step("evaluate_reference", "evaluate_reference", {"graph": a("graph"), "params": a("params")},
             {"reference": a("reference")}),
        step("map_values", "map_values", {"graph": a("graph"), "program": a("program"), "storage": a("storage")},
             {"value_map": a("value_map")}, doc="where each operation's output lies, for the per-operation check"),
        step("run_device", "run_device", {"package": a("package"), "params": a("params"), "graph": a("graph"),
                                          "value_map": a("value_map")},
             {"device_run": a("device_run"), "values": a("device_values"), "profile": a("profile"),
              "trace": a("device_trace")},
             files={"profile": out / f"{t}.profile.json", "trace": out / f"{t}.device.trace.json"}),
        # after the device run: the counted builds compile_kernels started compile meanwhile
        step("compile_kernels_counted", "compile_kernels_counted", {"graph": a("plan_graph")},
             {"counted_objects": a("kernel_counted_objects")},
             sources={**sources, "counter": tree_path(COUNTER, root)}, config=compile_cfg, after=("run_device",),
             doc="compile the kernel variants' counted builds, for measure_kernels (each one a cached action)"),
        step("measure_kernels", "measure_kernels",
             {"package": a("package"), "params": a("params"), "graph": a("graph"),
              "counted_objects": a("kernel_counted_objects")},
             {"kernel_profile": a("kernel_profile")}, files={"kernel_profile": out / f"{t}.kernels.json"},
             doc="count the basic blocks each kernel variant executes on the build's inputs"),
        step("check_numerics", "check_numerics", {"device_run": a("device_run"), "values": a("device_values"),
                                                  "value_map": a("value_map"), "reference": a("reference"),
                                                  "float_reference": a("float_reference"), "graph": a("graph"),
                                                  "params": a("params"), "profile": a("profile"), "cost": a("cost")},
             {"verdict": a("verdict")}, files={"verdict": out / f"{t}.verdict.json"}),
        *([step("compare_onnxruntime", "compare_onnxruntime", {"device_run": a("device_run")},
                {"onnxruntime": a("onnxruntime")}, sources=model, files={"onnxruntime": out / f"{t}.onnxruntime.json"},
                config=dict(target, onnxruntime=onnxruntime_version()),
                doc="compare the device's outputs with onnxruntime's on the same input (a report figure)")]
          if model else []),
        step("report_profile", "report_profile",
             {"profile": a("profile"), "cost": a("cost"), "program": a("program"), "storage": a("storage"),
              "code_sizes": a("code_sizes"), "machine": machine, "search": a("search"),
              "kernel_profile": a("kernel_profile"), "graph": a("plan_graph"), "layout": a("layout")},
             {"report": a("report")}, files={"report": out / f"{t}.profile.html"},
             doc="draw the device profile as one HTML page"),
    ]


def all_steps(target: dict, root: Path) -> list[Step]:
    """Every step one target needs, in an order that respects their dependencies."""
    cfg, _ = compiler_config()
    return [machine_step(target["target"]["machine"], Path(root)), *target_steps(target, root, cfg)]


def build_in_process(root, target_file) -> dict:
    """Build a target without doit (tests, benchmarks): run every step through the engine and
    return ``{artifact: digest}``. ``IPUBUILD_LOG``, if set, chooses what of the log reaches the
    console, as in a doit run."""
    from ..ui.console import LOG_LEVELS
    from ..engine.log import log
    from .pipeline import Workspace
    from ..compiler.targets import load_target
    setting = os.environ.get("IPUBUILD_LOG", "").strip().lower()
    level = log.level
    if setting:
        if setting not in LOG_LEVELS:
            raise UserError("IPUBUILD_LOG", f"{setting!r}: expected debug, info, warning or error")
        log.level = LOG_LEVELS[setting]
    try:
        ws = Workspace.at(root)
        target = load_target(os.path.relpath(Path(target_file).resolve(), ws.root), root=ws.root)
        out, steps = {}, list(all_steps(target, ws.root))
        ws.register(steps)
        for step in steps:
            result = ws.execute(step)
            out.update({a: result.outputs[s] for s, a in step.outputs.items()})
        return out
    finally:
        log.level = level
