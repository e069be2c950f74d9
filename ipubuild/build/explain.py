"""Why tasks ran, and where a build stopped early: the records behind ``doit explain:<target>``.

When a phase task runs, ``watch`` compares what it depends on now with what it depended on the
last time it ran (its entry in the *ledger*): its source files and input artifacts by digest, the
configuration keys its phase reads, the code of its phase module by module, the plugins it calls,
the Python toolchain and the cache — and the outputs doit found missing. After it has run, it
compares its outputs with what they were: an output that came out identical stops the build
there (early cutoff), and the tasks downstream that therefore did not run are counted.

Files, under ``.ipubuild/explain/``: ``ledger/<target>.json`` (``@shared.json`` for tasks shared
by targets) holds each task's dependencies as of its last successful run; ``last/<target>.json``
the records of the last build that ran one of the target's tasks, written after every task — a
no-op writes nothing, so ``explain`` tells about the last build that did some work. Bazel's
``--explain`` is the model.
"""
from __future__ import annotations

import contextlib
import datetime
import json
import os
import time
from pathlib import Path

from ..engine.files import file_digest, write_atomic
from ..engine.log import fields, log

SHARED = "@shared"
NO_RECORD = "no earlier run of it in this tree is recorded"
_run: dict = {"started": None, "shared": [], "targets": {}}
_ledgers: dict[str, dict] = {}


def folder(root) -> Path:
    return Path(root) / ".ipubuild" / "explain"


def target_of(step: dict) -> str | None:
    """The target a step belongs to (its ``build`` span's), or None for a shared step."""
    return next((kv.get("target") for name, kv in step["spans"] if name == "build"), None)


def state(ws, entry: dict) -> dict:
    """Everything a step's result depends on, as the ledger keeps it."""
    from ..engine import fingerprint
    from ..engine.engine import PHASES, config_subset, toolchain
    s = entry["step"]
    ph = PHASES[s["phase"]]
    return {"inputs": {a: ws.read_ref(a) for a in s["inputs"].values()},
            "sources": {p: file_digest(ws.root / p) for p in s["sources"].values()},
            "code": {m: fingerprint.module_digest(m) for m in fingerprint.closure(ph.fn.__module__)},
            "plugins": ws.plugins.fingerprints(ph.hooks) if ph.hooks else {},
            "toolchain": toolchain(), "config": config_subset(s["config"], ph.config),
            "cache": entry["signature"].rpartition(":")[2]}


def reasons(prev: dict | None, cur: dict, missing: list[str], doit_knew: bool, root: Path) -> list[str]:
    """Why a task with dependencies ``cur`` ran, given ``prev`` (its ledger entry), the outputs
    doit found ``missing`` and whether doit had a record of it."""
    if prev is None:
        return [f"{NO_RECORD} (the first build here, or its record was lost)"]
    out = []
    for kind in ("sources", "inputs"):
        for name, (a, b) in _changed(prev.get(kind, {}), cur[kind]):
            what = "source" if kind == "sources" else "input"
            out.append(f"{what} {name} " + ("appeared" if a is None else "went away" if b is None
                                            else f"changed ({a[:12]} → {b[:12]})"))
    for key, (a, b) in _leaves(prev.get("config", {}), cur["config"]):
        out.append(f"configuration {key} changed: {_show(a)} → {_show(b)}")
    for module, _ in _changed(prev.get("code", {}), cur["code"]):
        out.append(f"code changed: {_module_file(module, root)}")
    for plugin, (a, b) in _changed(prev.get("plugins", {}), cur["plugins"]):
        a, b = (v.split(":")[0] if v else "(none)" for v in (a, b))
        out.append(f"plugin {plugin} changed: " + (f"{a} → {b}" if a != b else f"{a}, its code"))
    for tool, (a, b) in _changed(prev.get("toolchain", {}), cur["toolchain"]):
        out.append(f"toolchain {tool} changed: {a} → {b}")
    if prev.get("cache") != cur["cache"]:
        out.append("the cache changed (another IPUBUILD_CACHE_DIR, or a new cache)")
    out += [f"output {p} was missing" for p in missing]
    if not out:
        out.append("doit had no record of a successful run (`doit forget`, or a new .doit.db)" if not doit_knew
                   else "nothing it depends on changed: doit was told to run it (`doit -a`?)")
    return out


def _changed(a: dict, b: dict):
    for k in sorted(set(a) | set(b)):
        if a.get(k) != b.get(k):
            yield k, (a.get(k), b.get(k))


def _leaves(a, b, prefix: str = ""):
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) | set(b), key=str):
            yield from _leaves(a.get(k), b.get(k), f"{prefix}.{k}" if prefix else str(k))
    elif a != b:
        yield prefix, (a, b)


def _show(v) -> str:
    text = json.dumps(v, sort_keys=True)
    return text if len(text) <= 60 else text[:57] + "..."


def _module_file(module: str, root: Path) -> str:
    from ..engine.fingerprint import source_file
    path = source_file(module)
    if path is None:
        return module
    rel = os.path.relpath(path, root)
    return path if rel.startswith("..") else rel


@contextlib.contextmanager
def watch(ws, entry: dict, entries: list, doit_knew: bool):
    """Record why the step of ``entry`` runs, what it did and whether its outputs changed."""
    s = entry["step"]
    task = f"{s['task']}:{s['name']}"
    target = target_of(s)
    outputs = list(s["outputs"].values())
    before = {a: ws.read_ref(a) for a in outputs}
    missing = [p for p in entry["targets"] if not (ws.root / p).exists()]
    ledger = _ledger(ws.root, target)
    cur = None
    try:        # explain may not know why (a damaged record); the build goes on regardless
        cur = state(ws, entry)
        why = reasons(ledger.get(task), cur, missing, doit_knew, ws.root)
    except Exception as exc:  # noqa: BLE001
        why = [f"unknown ({type(exc).__name__}: {exc})"]
    rec = {"task": task, "reasons": why, "notes": []}

    def listen(level, message, kv):
        if message == "compiled kernel variant":
            rec["notes"].append(f"compiled kernel variant {kv.get('variant')}")
        elif level == "WARN":
            rec["notes"].append(f"warning: {message} {fields(**kv)}".rstrip())

    log.listeners.append(listen)
    t0 = time.perf_counter()
    try:
        yield rec       # the caller sets rec["cache"]: "local" / "remote" when the result was a hit
    except BaseException as exc:
        rec["failed"] = "interrupted" if isinstance(exc, KeyboardInterrupt) else str(exc) or type(exc).__name__
        raise
    else:
        after = {a: ws.read_ref(a) for a in outputs}
        rec["identical"] = [a for a in outputs if before[a] is not None and before[a] == after[a]]
        rec["changed"] = [a for a in outputs if a not in rec["identical"]]
        if cur is not None:
            cur["inputs"] = {a: ws.read_ref(a) for a in s["inputs"].values()}
            ledger[task] = cur
            _save(folder(ws.root) / "ledger" / f"{target or SHARED}.json", ledger)
    finally:
        log.listeners.remove(listen)
        rec["ms"] = int((time.perf_counter() - t0) * 1000)
        _record(ws.root, target, rec, entries)


def _ledger(root: Path, target: str | None) -> dict:
    name = target or SHARED
    if name not in _ledgers:
        try:
            data = json.loads((folder(root) / "ledger" / f"{name}.json").read_bytes())
        except (OSError, ValueError):
            data = None
        _ledgers[name] = data if isinstance(data, dict) else {}
    return _ledgers[name]


def _save(path: Path, data: dict) -> None:
    with contextlib.suppress(Exception):   # a record for explain, never a reason to fail a build
        write_atomic(path, json.dumps(data, sort_keys=True).encode())


def _record(root: Path, target: str | None, rec: dict, entries: list) -> None:
    """Add a task's record to this run's, and rewrite the affected targets' ``last`` files."""
    if _run["started"] is None:
        _run["started"] = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
    if target is None:
        _run["shared"].append(rec)
    else:
        if target not in _run["targets"]:
            _run["targets"][target] = {"graph": _graph(entries, target), "records": []}
        _run["targets"][target]["records"].append(rec)
    for t in ([target] if target is not None else list(_run["targets"])):
        run = _run["targets"][t]
        _save(folder(root) / "last" / f"{t}.json",
              {"started": _run["started"], "graph": run["graph"], "records": _run["shared"] + run["records"]})


def _graph(entries: list, target: str) -> dict:
    """``{task: [tasks reading its outputs]}`` over the target's steps and the shared ones."""
    steps = [e["step"] for e in entries if e["kind"] == "step" and target_of(e["step"]) in (target, None)]
    producer = {a: f"{s['task']}:{s['name']}" for s in steps for a in s["outputs"].values()}
    graph: dict[str, set] = {f"{s['task']}:{s['name']}": set() for s in steps}
    for s in steps:
        for a in s["inputs"].values():
            if a in producer:
                graph[producer[a]].add(f"{s['task']}:{s['name']}")
    return {k: sorted(v) for k, v in graph.items()}


def built(root, target: str) -> bool:
    """Whether a build of ``target`` has recorded what it ran in this tree."""
    return (folder(root) / "last" / f"{target}.json").is_file()


def report(root, target: str) -> list[str]:
    """The lines of ``doit explain:<target>``."""
    from ..engine.errors import UserError
    path = folder(root) / "last" / f"{target}.json"
    try:
        run = json.loads(path.read_bytes())
        graph, records = run["graph"], run["records"]
    except (OSError, ValueError, KeyError, TypeError):
        raise UserError(f"explain:{target}", f"no build of {target} has run a task in this tree yet; "
                        f"run `doit build:{target}` first") from None
    ran = {r["task"] for r in records}
    hits = [r for r in records if r.get("cache")]
    remote = sum(r["cache"] == "remote" for r in hits)
    came = (f" ({len(hits)} of them from the cache{f', {remote} remote' if remote else ''}: nothing computed)"
            if hits else "")
    lines = [f"{target}: the last build that ran tasks started {run['started']}; {len(ran)} of "
             f"{len(graph)} tasks ran{came}, the others were up to date"]
    for r in records:
        where = {"local": "; its result came from the local cache",
                 "remote": "; its result came from the remote cache (the shared tier)"}.get(r.get("cache"), "")
        lines.append(f"{r['task']} ran ({r.get('ms', 0) / 1000:.1f} s){where}")
        reasons = r["reasons"]
        if r.get("cache") and reasons and reasons[0].startswith(NO_RECORD):
            # a hit: doit ran it to look it up, nothing was computed
            reasons = [f"this tree had no record of it (a new tree, or a lost record), and the {r['cache']} "
                       "cache had its result for the same inputs", *reasons[1:]]
        lines += [f"    because {reason}" for reason in reasons]
        lines += [f"    it {note}" if not note.startswith("warning") else f"    {note}" for note in r.get("notes", [])]
        if "failed" in r:
            lines.append(f"    and failed: {r['failed']}")
        elif r.get("identical") and _skipped(graph, r["task"], ran):
            skipped = _skipped(graph, r["task"], ran)
            which = ", ".join(sorted(a.rpartition("/")[2] for a in r["identical"]))
            lines.append(f"    early cutoff: {'it gave identical bytes' if not r.get('changed') else 'identical'} "
                         f"({which}); {skipped} task{'s' if skipped != 1 else ''} downstream skipped")
    return lines


def _skipped(graph: dict, task: str, ran: set) -> int:
    """The tasks downstream of ``task`` that did not run in the build: reachable through tasks
    that did not run either."""
    seen, todo = set(), list(graph.get(task, ()))
    while todo:
        t = todo.pop()
        if t in seen or t in ran:
            continue
        seen.add(t)
        todo.extend(graph.get(t, ()))
    return len(seen)
