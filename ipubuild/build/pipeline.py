"""A build as a list of steps over named artifacts, run by doit or in-process alike.

A step runs one phase: its inputs are artifacts (whose digests sit in small reference files
under ``.ipubuild/refs``) or real source files; its outputs are reference files, rewritten only
when the digest changes, so that a phase re-run with identical output leaves everything
downstream up to date (early cutoff through doit's content checker).

References heal: a reference file that is missing or damaged, or that names a blob the cache no
longer has and cannot rebuild from its provenance, is re-made by running the step that produces
it (the workspace knows every loaded step's outputs) — never a message asking to delete
``.ipubuild``.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import re
import threading
from pathlib import Path

from ..engine import executors, fingerprint
from ..engine.engine import Engine, MissingBlob, Result
from ..engine.errors import UserError
from ..engine.files import read_recorded, tree_memo, write_if_changed
from ..engine.log import log, phase_finished, span
from ..engine.store import Store, cache_dir, size_limit

_DIGEST = re.compile(r"[0-9a-f]{64}")


@dataclasses.dataclass
class Step:
    """One phase run in a build; ``task`` and ``name`` make its doit name ``task:name``.
    Paths are relative to the workspace's root (or absolute, for files outside it)."""
    task: str
    name: str
    phase: str
    inputs: dict[str, str] = dataclasses.field(default_factory=dict)   # slot -> artifact
    outputs: dict[str, str] = dataclasses.field(default_factory=dict)  # slot -> artifact
    sources: dict[str, Path] = dataclasses.field(default_factory=dict)  # slot -> source file
    files: dict[str, Path] = dataclasses.field(default_factory=dict)   # slot -> file written
    config: dict = dataclasses.field(default_factory=dict)
    spans: tuple = ()            # enclosing log spans: (("build", {...}), ("phase", {...}))
    doc: str = ""
    after: tuple = ()            # tasks (of the same name) doit runs first: an order, not an input

    @property
    def task_name(self) -> str:
        return f"{self.task}:{self.name}"

    def to_json(self) -> dict:
        d = dataclasses.asdict(self)
        d["sources"] = {k: str(v) for k, v in self.sources.items()}
        d["files"] = {k: str(v) for k, v in self.files.items()}
        d["spans"] = [list(s) for s in self.spans]
        return d

    @classmethod
    def from_json(cls, d: dict) -> "Step":
        return cls(**dict(d, sources={k: Path(v) for k, v in d["sources"].items()},
                          files={k: Path(v) for k, v in d["files"].items()},
                          spans=tuple((n, kv) for n, kv in d["spans"]), after=tuple(d.get("after", ()))))


class Workspace:
    """A project tree: where refs, artifacts and the cache live, and the engine over them."""

    _open: dict[Path, "Workspace"] = {}
    _lock = threading.Lock()

    def __init__(self, root: Path):
        self.root = Path(root).resolve()
        self.refs = self.root / ".ipubuild" / "refs"
        self.artifacts = self.root / "artifacts"
        self.cache = cache_dir(self.root)
        self.store = Store(self.cache, size_limit())
        self.engine = Engine(self.store, lambda hooks: self.plugins.fingerprints(hooks))
        self.digests = tree_memo(self.root)
        self.producers: dict[str, Step] = {}
        self.executed = 0
        self._prepared: set[str] = set()     # the step names (targets) whose device was asked to get ready
        self._plugins = None
        fingerprint.use_memo(self.cache / "fingerprints.json")

    @property
    def plugins(self):
        if self._plugins is None:
            from ..plugins import get_plugin_manager
            self._plugins = get_plugin_manager()
        return self._plugins

    @classmethod
    def at(cls, root) -> "Workspace":
        root = Path(root).resolve()
        with cls._lock:
            if root not in cls._open:
                cls._open[root] = cls(root)
            return cls._open[root]

    @classmethod
    def close_all(cls) -> None:
        with cls._lock:
            for ws in cls._open.values():
                ws.close()
            cls._open.clear()

    def close(self) -> None:
        self.digests.save()
        fingerprint.save_memo()
        self.store.close()

    def register(self, steps) -> None:
        """Remember which step produces each artifact (to re-make a lost reference)."""
        for s in steps:
            for artifact in s.outputs.values():
                self.producers[artifact] = s

    # references ---------------------------------------------------------------------------
    def ref_path(self, artifact: str) -> Path:
        return self.refs / f"{artifact}.ref"

    def read_ref(self, artifact: str) -> str | None:
        """The digest a reference file holds, or None if it is missing or damaged."""
        try:
            text = self.ref_path(artifact).read_text().strip()
        except (OSError, UnicodeDecodeError):
            return None
        return text if _DIGEST.fullmatch(text) else None

    def digest_of(self, artifact: str, _depth: int = 0) -> str:
        """An artifact's digest, re-making its reference by running its producer if needed."""
        d = self.read_ref(artifact)
        if d is not None:
            return d
        producer = self.producers.get(artifact)
        if producer is None:
            raise UserError(str(self.ref_path(artifact)), "missing or damaged, and no step of this "
                            "build produces it; run the build that makes it")
        log.warning("re-making a missing or damaged reference", artifact=artifact, step=producer.task_name)
        result = self._execute(producer, False, _depth + 1)
        return next(result.outputs[slot] for slot, a in producer.outputs.items() if a == artifact)

    def fetch_artifact(self, artifact: str) -> bytes:
        """An artifact's bytes, rebuilding them (by provenance, else by its step) if needed."""
        try:
            return self.engine.fetch(self.digest_of(artifact))
        except MissingBlob:
            producer = self.producers.get(artifact)
            if producer is None:
                raise
            result = self._execute(producer, True, 1)
            slot = next(s for s, a in producer.outputs.items() if a == artifact)
            return self.engine.fetch(result.outputs[slot])

    # running ------------------------------------------------------------------------------
    def read_source(self, path: Path) -> bytes:
        try:
            return read_recorded(self.root / path)   # doit's record of it: these bytes (tasks.py)
        except OSError as exc:
            raise UserError(str(path), f"cannot read: {exc.strerror}") from None

    def _spans(self, step: Step) -> tuple:
        """The step's spans, with the build span's ``operations`` once its graph exists."""
        if not step.spans or step.spans[0][0] != "build":
            return step.spans
        name, kv = step.spans[0]
        d = self.read_ref(f"{kv['target']}/graph")
        if d is not None:
            with contextlib.suppress(Exception):  # a label only; the build reports real problems
                kv = dict(kv, operations=len(self.engine.decoded(d)["ops"]))
        return ((name, kv),) + tuple(step.spans[1:])

    def execute(self, step: Step, *, force: bool = False) -> Result:
        """Run a step: read input refs, run (or hit) its phase, write output refs and files."""
        return self._execute(step, force, 0)

    def _execute(self, step: Step, force: bool, depth: int) -> Result:
        if depth > len(self.producers) + 1:
            raise UserError(step.task_name, "its inputs could not be rebuilt; see the warnings above")
        self._prepare_device(step)
        self.executed += 1
        inputs = {slot: self.digest_of(a, depth) for slot, a in step.inputs.items()}
        for slot, path in step.sources.items():
            inputs[slot] = self.store.put(self.read_source(path), pin=True)
        try:
            with contextlib.ExitStack() as spans:
                for name, kv in self._spans(step) + (("phase", {"phase": step.phase}),):
                    spans.enter_context(span(name, **kv))
                result = self.engine.run(step.phase, inputs, step.config, force=force)
                self._write_outputs(step, result)
                phase_finished(step.phase, result.elapsed_ms, result.hit)
            return result
        except MissingBlob as exc:
            if depth > len(self.producers):
                raise
            # a blob this step needs is gone for good: re-make the inputs whose blobs are
            # missing with their own steps, then run this step again
            log.warning("re-running the steps that made lost cache results", step=step.task_name,
                        blob=exc.digest[:16])
            for slot, artifact in step.inputs.items():
                producer = self.producers.get(artifact)
                if producer is not None and not self.engine.available(inputs[slot]):
                    self._execute(producer, True, depth + 1)
            return self._execute(step, True, depth + 1)

    def _prepare_device(self, step: Step) -> None:
        """As a target's first phase runs here, let the device it runs on ready itself (the
        simulator compiles its C helpers on a new machine) while the phases before it run. A
        target's steps share its name (their doit names are ``<task>:<target>``)."""
        if step.name in self._prepared:
            return
        self._prepared.add(step.name)
        device = next((s.config.get("target", {}).get("device") for s in self.producers.values()
                       if s.phase == "run_device" and s.name == step.name), None)
        if device:
            executors.background(functools.partial(_ready_device, device))

    def _write_outputs(self, step: Step, result: Result) -> None:
        for slot, artifact in step.outputs.items():
            if slot not in result.outputs:
                raise KeyError(f"phase {step.phase} did not produce {slot}")
            write_if_changed(self.ref_path(artifact), result.outputs[slot].encode() + b"\n")
        for slot, path in step.files.items():
            self.restore(self.root / path, result.outputs[slot])

    def restore_artifact(self, artifact: str, path: Path) -> None:
        """Make the file at ``path`` hold the artifact (rebuilding it if the cache lost it)."""
        d = self.digest_of(artifact)
        if self.digests.digest(path) != d:
            write_if_changed(path, self.fetch_artifact(artifact))

    def restore(self, path: Path, digest: str) -> bool:
        """Make the file at ``path`` hold the blob ``digest`` (unless it already does); a profile
        it replaces is kept as the previous build's (``ipubuild.ui.profile_diff``)."""
        if self.digests.digest(path) == digest:
            return False
        from ..ui.profile_diff import previous_path
        kept = previous_path(Path(path))
        if kept is not None and Path(path).is_file():
            os.replace(path, kept)
        write_if_changed(path, self.engine.fetch(digest))
        return True


def _ready_device(name: str) -> None:
    from ..device.device import prepare
    prepare(name)
