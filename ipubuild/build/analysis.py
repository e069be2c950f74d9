"""Analysis: a tree's targets turned into doit task entries (JSON-able), and the files read.

This is the expensive part of loading a tree — plugins, targets, machine descriptions, code
fingerprints, the compiler's identity — and its result is cached by ``ipubuild.taskcache`` until
one of the files it read changes. The entries are turned into doit tasks by ``ipubuild.tasks``.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

from ..engine.errors import UserError
from ..engine.log import log


def analyse(root: Path, previous: dict | None = None) -> dict:
    """Every task of the tree, as JSON-able entries, and the files the analysis read
    (``previous``, the last analysis, supplies the compiler's identity if it has gone)."""
    import ipubuild
    from ..engine import fingerprint
    from ..engine.store import cache_dir
    # a fresh clone's ~100 modules of ipubuild parsed on every core while the plugins load (in
    # the memo the workspace uses)
    own = python_files(Path(ipubuild.__file__).parent)
    fingerprint.use_memo(cache_dir(Path(root).resolve()) / "fingerprints.json")
    fingerprint.prefetch(own)
    try:
        return _tasks_and_watched(root, previous, own)
    finally:
        fingerprint.finish_prefetch()       # its processes gone before anything forks


def _tasks_and_watched(root: Path, previous: dict | None, own: list[str]) -> dict:
    """``analyse``'s result; ``own``: ipubuild's files and folders (``python_files``)."""
    from ..engine.files import StatMemo
    from ..engine.store import cache_dir, cache_identity
    watched = own + search_path(root)
    watched += [str(root / "targets")]
    cache = cache_dir(root)
    watched.append(str(cache / "id"))
    tasks: list[dict] = []
    try:
        from . import build as b
        from .pipeline import Workspace
        from ..compiler.targets import dump_resolved, find_targets, load_target
        ws = Workspace.at(root)
        pm = ws.plugins
        for name, _ in pm.list_name_plugin():
            watched += module_files(name)
        found, clashes = find_targets(root, pm)
    except UserError as exc:   # a bad setting (cache, remote, plugin): every build: task fails with it
        from ..compiler.targets import discover
        return {"tasks": [broken("build", name, str(exc)) for name in [p.stem for p in discover(root)] or ["all"]],
                "watched": watched, "provisional": True}
    tasks.append({"kind": "plugins", "doc": "list the loaded plugins, their versions and what each registers"})
    cache_id = cache_identity(cache)
    known = _known_names(pm)
    memo = StatMemo(cache / "compilers.json")
    compiler_cfg, machines, provisional = None, set(), False
    for tf in found:
        # a shipped target's file, and its folder (a hook may list what the folder holds)
        watched += [str(tf.path)] + ([str(tf.path.parent)] if tf.plugin else [])
        shipped = {"plugin": tf.plugin} if tf.plugin else {}
        if tf.name in clashes:
            tasks.append(dict(broken("build", tf.name, clashes[tf.name])))
            continue
        try:
            if tf.plugin:
                target = load_target(tf.path, known=known, shown=tf.shown)
            else:
                target = load_target(os.path.relpath(tf.path, root), known=known, root=root)
            b.check_machine(target)
            if compiler_cfg is None:
                compiler_cfg, cc_files = _compiler(b, memo, previous)
                watched += cc_files
                provisional = not cc_files
            steps = b.target_steps(target, root, compiler_cfg)
            # a model file's external data files are found here: re-derive when it changes
            watched += [str(root / p) for st in steps if st.phase == "lower_model" for p in st.sources.values()]
        except UserError as exc:
            # a target whose model family or graph pass no installed plugin provides is skipped
            # by bare `doit`
            missing = exc.where.endswith(": model.family") or ": model.passes[" in exc.where
            tasks.append(dict(broken("build", tf.name, str(exc)), skip=missing, **shipped))
            continue
        machine = target["target"]["machine"]
        if machine not in machines:
            machines.add(machine)
            steps.insert(0, b.machine_step(machine, root))
        tasks.extend(step_entry(ws, s, cache_id) for s in steps)
        t = target["name"]
        files = [[s.outputs[slot], str(p)] for s in steps for slot, p in s.files.items()]
        out = Path("artifacts") / t
        tasks.append({"kind": "build", "target": t, "path": target["path"], "device": target["target"]["device"],
                      "files": files, "file_dep": [str(ws.ref_path(a).relative_to(root)) for a, _ in files],
                      "verdict_file": str(out / f"{t}.verdict.json"), "profile_file": str(out / f"{t}.profile.json"),
                      "package_file": str(out / f"{t}.ipuexe"), "resolved": dump_resolved(target).decode(),
                      "default": target["target"]["default"], **shipped})
        tasks += [{"kind": kind, "target": t, "doc": doc.format(t)} for kind, doc in COMMANDS.items()]
    memo.save()
    # `doit kernel:<variant>`: one kernel variant on its own (ipubuild.build.kernel_cli)
    from ..graph.operators import registry
    try:
        variants = sorted(registry().kernels)
    except Exception:  # noqa: BLE001 - a broken operator plugin: the builds report it
        variants = []
    tasks += [{"kind": "kernel", "variant": name, "doc": f"compile kernel variant {name}, run it on random inputs "
               "of the shapes a target gives it against its reference; host time and basic blocks"}
              for name in variants]
    return {"tasks": tasks, "groups": group_docs(tasks), "watched": watched, "provisional": provisional}


COMMANDS = {"explain": "why each task of the last build of {} ran, and where it stopped early",
            "inspect": "summarise the package of {}",
            "profile": "print the steps of {} that take the most device cycles"}


def group_docs(entries: list) -> dict:
    """What ``doit list`` says of each group of tasks: the targets (and the errors of broken ones)
    and the phases."""
    def named(plugin: bool) -> tuple[list, list]:      # (built, broken) of the tree's own or the shipped
        mark = (lambda e: f" (from plugin {e['plugin']})") if plugin else (lambda e: "")
        return ([e["target"] + mark(e) for e in entries if e["kind"] == "build" and bool(e.get("plugin")) == plugin],
                [f"{e['name']}{mark(e)} (error: {e['message']})" for e in entries
                 if e["kind"] == "broken" and e["name"] != "all" and bool(e.get("plugin")) == plugin])
    (own_ok, own_bad), (shipped_ok, shipped_bad) = named(False), named(True)
    ok = own_ok + shipped_ok
    docs = {"build": f"compile, package, run on the device and check a target (bare `doit`: those not marked "
                     f"[target] default = false): "
                     f"{', '.join(own_ok + own_bad + shipped_ok + shipped_bad)}"}
    docs.update((kind, doc.format("a target") + f": {', '.join(ok)}") for kind, doc in COMMANDS.items())
    docs["kernel"] = ("run one kernel variant against its reference, timed and counted (--target T, --repeat N, "
                      "--seed S, --inputs a.npy,b.npy)")
    for e in entries:
        if e["kind"] == "step":
            s = e["step"]
            docs.setdefault(s["task"], f"phase {s['phase']}" + (f": {e['doc']}" if e["doc"] else ""))
    return docs


def step_entry(ws, step, cache_id: str | None) -> dict:
    """One step as a task entry: the step, its signature (``Engine.signature``, with the cache's
    identity), and its dependencies and targets as paths relative to the tree."""
    from ..engine.engine import PHASES
    ph = PHASES[step.phase]
    sig = ws.engine.signature(ph, step.config)

    def rel(p: Path) -> str:
        return os.path.relpath(p, ws.root) if Path(p).is_absolute() and ws.root in Path(p).parents else str(p)
    doc = step.doc or " ".join((ph.fn.__doc__ or "").split()).split(". ")[0].rstrip(".")
    # what the console needs: the phase kind (the outermost phase span: the planning steps are
    # plan_package's), the target, and the search's rounds
    kind = next((kv["phase"] for name, kv in step.spans if name == "phase"), step.phase)
    meta = {"kind": kind, "target": next((kv.get("target") for n, kv in step.spans if n == "build"), None)}
    if step.phase == "plan_package":
        meta["rounds"] = step.config.get("search", {}).get("rounds")
    return {"kind": "step", "step": step.to_json(), "signature": f"{sig}:{cache_id}", "doc": doc, "meta": meta,
            "file_dep": [rel(ws.ref_path(a)) for a in step.inputs.values()] + [str(p) for p in step.sources.values()],
            "targets": [rel(ws.ref_path(a)) for a in step.outputs.values()] + [str(p) for p in step.files.values()]}


def _compiler(b, memo, previous) -> tuple[dict, list[str]]:
    """The compiler's configuration; if the compiler cannot be run, the one the last analysis
    found — kernels it compiled stay valid, and a kernel that must compile anew then fails with
    the compiler's own one-line error (so a warm tree still builds without a compiler)."""
    try:
        return b.compiler_config(memo)
    except UserError as exc:
        from ..compiler.kernels import compiler
        cc, cflags = compiler()
        for e in (previous or {}).get("tasks", []):
            cfg = e.get("step", {}).get("config", {}).get("compiler") if e.get("kind") == "step" else None
            if cfg and cfg.get("cc") == cc:
                log.warning(f"{exc}; reusing kernels it compiled before")
                return {"cc": cc, "cflags": cflags, "identity": cfg["identity"]}, []
        raise


def broken(basename: str, name: str, message: str) -> dict:
    return {"kind": "broken", "basename": basename, "name": name, "message": message}


def _known_names(pm) -> dict | None:
    """Registered model families, cast policies and devices, to check targets when they load
    (None if a plugin fails here: its error then surfaces in the phase that calls it)."""
    from ..device.device import backends
    from ..graph.frontend import cast_policies, model_families
    from ..graph.passes import graph_passes
    try:
        return {"family": model_families(pm), "policy": sorted(cast_policies(pm)),
                "device": sorted(backends()), "passes": sorted(graph_passes(pm))}
    except UserError:
        return None


def python_files(folder: Path) -> list[str]:
    """Every ``.py`` file under a package folder (and the folders, whose stat changes when a
    module is added or removed)."""
    out = []
    for dirpath, dirnames, filenames in os.walk(folder):
        dirnames[:] = sorted(d for d in dirnames if d != "__pycache__" and not d.startswith("."))
        out.append(dirpath)
        out.extend(os.path.join(dirpath, f) for f in sorted(filenames) if f.endswith((".py", ".toml")))
    return out


def module_files(modname: str) -> list[str]:
    """The files behind an imported module's top-level package (or the module's own file)."""
    top = sys.modules.get(modname.split(".")[0])
    origin = getattr(top, "__file__", None)
    if not origin:
        return []
    if os.path.basename(origin) == "__init__.py":
        return python_files(Path(origin).parent)
    return [origin]


def search_path(root: Path) -> list[str]:
    """The folders Python imports from (their stat changes when a package is installed,
    upgraded or removed) — except the tree itself, which every build writes to; modules loaded
    from it are watched file by file."""
    root = os.path.realpath(root)
    return [p for p in sys.path if p and os.path.isdir(p) and os.path.realpath(p) != root]
