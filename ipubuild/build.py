"""A target's build as steps: the compiler's phases wired over named artifacts.

``target_steps`` (with ``kernel_steps`` and ``machine_step``) is the single description of a build; doit tasks (``ipubuild.tasks``) and the
in-process runner both use it. Artifact names are ``<target>/<name>`` (or ``kernels/<variant>/…``
for what targets share).
"""
from __future__ import annotations

from pathlib import Path

from .errors import UserError
from .kernels import compiler, compiler_identity, included_headers
from .machine import MACHINES
from .operators import registry
from .pipeline import Step

# importing registers the phases (the kernels package, imported above, registers compile_kernels)
from . import device, frontend, package, reference, report  # noqa: F401
from .planning import phases  # noqa: F401

def kernel_steps(machine: str) -> list[Step]:
    """One compile step per kernel variant known to the operator registry."""
    cc, cflags = compiler()
    ident = compiler_identity(cc)
    out = []
    for name, kv in sorted(registry().kernels.items()):
        source = Path(kv.source)
        if not source.is_file():
            raise UserError(f"kernel {name}", f"its source {source} does not exist; reinstall the plugin "
                            "that declares it")
        headers = {f"header/{h.name}": h for h in included_headers(source)}
        out.append(Step("compile_kernels", name, "compile_kernels",
                        inputs={"machine": f"machines/{machine}"},
                        outputs={"object": f"kernels/{name}/object", "reservation": f"kernels/{name}/reservation",
                                 "code_size": f"kernels/{name}/code_size"},
                        sources={"source": source, **headers},
                        config={"kernel": {"name": name, "source_name": source.name, "defines": [list(d) for d in kv.defines],
                                           "where": _in_package(source)},
                                "compiler": {"cc": cc, "cflags": cflags, "identity": ident}},
                        doc=f"compile kernel variant {name} from {_short(source)}"))
    return out


def check_machine(target: dict) -> None:
    """The target's machine description exists and parses (else a one-line error)."""
    from .machine import load_machine
    load_machine(target["target"]["machine"], where=f"{target['path']}: target.machine")


def machine_step(machine: str) -> Step:
    return Step("machine", machine, "read_machine", outputs={"machine": f"machines/{machine}"},
                sources={"file": MACHINES / f"{machine}.toml"}, doc=f"read the machine description {machine}")


def _in_package(source: Path) -> str:
    """``source`` relative to the folder holding its top-level Python package, e.g.
    ``ipubuild/kernels/matmul.c``: meaningful in messages, and the same in every checkout (it
    enters the compile's action key)."""
    top = source.parent
    while (top.parent / "__init__.py").exists():
        top = top.parent
    return str(source.relative_to(top.parent))


def _short(path: Path) -> str:
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def target_steps(target: dict, kernels: list[str], artifacts: Path) -> list[Step]:
    """The steps that build, run and check one target."""
    t = target["name"]
    n = target["target"]["tile_count"]
    machine = f"machines/{target['target']['machine']}"
    spans = (("build", {"target": t, "tile_count": n}),)
    plan_spans = spans + (("phase", {"phase": "plan_package"}),)
    res = {f"reservation/{k}": f"kernels/{k}/reservation" for k in kernels}
    obj = {f"object/{k}": f"kernels/{k}/object" for k in kernels}
    a = lambda name: f"{t}/{name}"  # noqa: E731
    tiles = [str(i) for i in range(n)]
    cfg = target

    def step(task, phase, inputs, outputs, span=spans, name=t, **kw):
        return Step(task, name, phase, inputs=inputs, outputs=outputs, config=cfg, spans=span, **kw)

    steps = [
        step("lower_model", "lower_model", {}, {"graph": a("graph"), "params": a("params")},
             sources={"target": Path(target["path"])}, doc="build the model graph and place the FP8 casts"),
        step("compile_runtime", "compile_runtime", {"machine": machine}, {"runtime": a("runtime")}),
        step("plan_package", "plan_package", {"graph": a("graph"), "machine": machine, "runtime": a("runtime"), **res},
             {"layout": a("layout"), "search": a("search")}, doc="search the layout"),
        step("place_provisional_storage", "place_provisional_storage",
             {"graph": a("graph"), "layout": a("layout"), "machine": machine, **res},
             {"program": a("program"), "provisional_storage": a("provisional_storage")}, plan_spans),
        step("schedule_provisional_exchanges", "schedule_provisional_exchanges",
             {"program": a("program"), "machine": machine}, {"exchange_schedule": a("exchange_schedule")}, plan_spans),
        step("plan_kernels", "plan_kernels", {"program": a("program")}, {"kernel_plan": a("kernel_plan")}, plan_spans),
        step("link_runtime", "link_runtime", {"kernel_plan": a("kernel_plan"), "runtime": a("runtime"),
                                              "machine": machine, **res}, {"link_map": a("link_map")}, plan_spans),
        step("link_kernels", "link_kernels", {"link_map": a("link_map"), **obj},
             {f"tile_kernels/{i}": a(f"tile_kernels/{i}") for i in tiles}, plan_spans,
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
        step("prepare_tile_code", "prepare_tile_code",
             {"graph": a("graph"), "params": a("params"), "program": a("program"), "storage": a("storage"),
              "placed_exchanges": a("placed_exchanges"), "link_map": a("link_map"), "code_sizes": a("code_sizes")},
             {**{f"tile_program/{i}": a(f"tile_program/{i}") for i in tiles},
              **{f"tile_data/{i}": a(f"tile_data/{i}") for i in tiles}, "host_program": a("host_program")}, plan_spans),
        step("emit_tile_code", "emit_tile_code", {f"tile_program/{i}": a(f"tile_program/{i}") for i in tiles},
             {f"tile_code/{i}": a(f"tile_code/{i}") for i in tiles}, plan_spans),
    ]
    for i in tiles:
        steps.append(step("build_tile_images", "build_tile_images",
                          {"tile_code": a(f"tile_code/{i}"), "tile_data": a(f"tile_data/{i}"),
                           "tile_kernels": a(f"tile_kernels/{i}")},
                          {"image": a(f"image/{i}")}, plan_spans, name=f"{t}/tile{i}"))
    steps += [
        step("build_tile_images", "build_idle_image", {}, {"image": a("image/idle")}, plan_spans, name=f"{t}/idle"),
        step("write_package", "write_package",
             {**{f"image/{i}": a(f"image/{i}") for i in tiles}, "idle_image": a("image/idle"), **obj,
              "host_program": a("host_program"), "machine": machine},
             {"package": a("package")}, files={"package": artifacts / t / f"{t}.ipuexe"}),
        step("evaluate_reference", "evaluate_reference", {"graph": a("graph"), "params": a("params")},
             {"reference": a("reference")}),
        step("run_device", "run_device", {"package": a("package"), "params": a("params"), "graph": a("graph")},
             {"device_run": a("device_run"), "profile": a("profile"), "trace": a("device_trace")},
             files={"profile": artifacts / t / f"{t}.profile.json",
                    "trace": artifacts / t / f"{t}.device.trace.json"}),
        step("check_numerics", "check_numerics", {"device_run": a("device_run"), "reference": a("reference"),
                                                  "profile": a("profile")}, {"verdict": a("verdict")}),
        step("report_profile", "report_profile",
             {"profile": a("profile"), "cost": a("cost"), "program": a("program"), "storage": a("storage"),
              "code_sizes": a("code_sizes"), "machine": machine, "search": a("search")},
             {"report": a("report")}, files={"report": artifacts / t / f"{t}.profile.html"},
             doc="draw the device profile as one HTML page"),
    ]
    return steps


def all_steps(target: dict, artifacts: Path) -> list[Step]:
    """Every step one target needs, in an order that respects their dependencies."""
    machine = target["target"]["machine"]
    ksteps = kernel_steps(machine)
    return [machine_step(machine), *ksteps, *target_steps(target, [s.name for s in ksteps], artifacts)]


def build_in_process(root, target_file) -> dict:
    """Build a target without doit (tests, benchmarks): run every step through the engine and
    return ``{artifact: digest}``."""
    from .pipeline import Workspace
    from .targets import load_target
    ws = Workspace.at(root)
    target = load_target(target_file)
    out = {}
    for step in all_steps(target, ws.artifacts):
        result = ws.execute(step)
        out.update({a: result.outputs[s] for s, a in step.outputs.items()})
    return out
