"""A build as a list of steps over named artifacts, run by doit or in-process alike.

A step runs one phase: its inputs are artifacts (whose digests sit in small reference files
under ``.ipubuild/refs``) or real source files; its outputs are reference files, rewritten only
when the digest changes, so that a phase re-run with identical output leaves everything
downstream up to date (early cutoff through doit's md5 checker).
"""
from __future__ import annotations

import contextlib
import dataclasses
import threading
from pathlib import Path

from . import canonical
from .engine import PHASES, Engine, Result, config_subset
from .files import write_if_changed
from .log import phase_finished, span
from .store import Store, cache_dir, size_limit


@dataclasses.dataclass
class Step:
    """One phase run in a build; ``task`` and ``name`` make its doit name ``task:name``."""
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

    @property
    def task_name(self) -> str:
        return f"{self.task}:{self.name}"


class Workspace:
    """A project tree: where refs, artifacts and the cache live, and the engine over them."""

    _open: dict[Path, "Workspace"] = {}
    _lock = threading.Lock()

    def __init__(self, root: Path):
        from .plugins import get_plugin_manager
        self.root = Path(root).resolve()
        self.refs = self.root / ".ipubuild" / "refs"
        self.artifacts = self.root / "artifacts"
        self.store = Store(cache_dir(self.root), size_limit())
        self.plugins = get_plugin_manager()
        self.engine = Engine(self.store, self.plugins.fingerprints)

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
                ws.store.close()
            cls._open.clear()

    def ref_path(self, artifact: str) -> Path:
        return self.refs / f"{artifact}.ref"

    def read_ref(self, artifact: str) -> str:
        return self.ref_path(artifact).read_text().strip()

    def signature(self, step: Step) -> str:
        """What doit must see change to re-run a step besides its files: code, plugins, config."""
        ph = PHASES[step.phase]
        return canonical.digest_of({"code": ph.code,
                                    "plugins": self.plugins.fingerprints(ph.hooks) if ph.hooks else {},
                                    "config": config_subset(step.config, ph.config)})

    def _spans(self, step: Step) -> tuple:
        """The step's spans, with the build span's ``operations`` once its graph exists."""
        if not step.spans or step.spans[0][0] != "build":
            return step.spans
        name, kv = step.spans[0]
        ref = self.ref_path(f"{kv['target']}/graph")
        if ref.exists():
            try:
                kv = dict(kv, operations=len(self.engine.decoded(ref.read_text().strip())["ops"]))
            except Exception:  # noqa: BLE001 - a label only; the build reports real problems
                pass
        return ((name, kv),) + step.spans[1:]

    def execute(self, step: Step) -> Result:
        """Run a step: read input refs, run (or hit) its phase, write output refs and files."""
        inputs = {slot: self.read_ref(a) for slot, a in step.inputs.items()}
        for slot, path in step.sources.items():
            inputs[slot] = self.store.put(Path(path).read_bytes(), pin=True)
        with contextlib.ExitStack() as spans:
            for name, kv in self._spans(step) + (("phase", {"phase": step.phase}),):
                spans.enter_context(span(name, **kv))
            result = self.engine.run(step.phase, inputs, step.config)
            for slot, artifact in step.outputs.items():
                if slot not in result.outputs:
                    raise KeyError(f"phase {step.phase} did not produce {slot}")
                write_if_changed(self.ref_path(artifact), result.outputs[slot].encode() + b"\n")
            for slot, path in step.files.items():
                write_if_changed(path, self.engine.fetch(result.outputs[slot]))
            phase_finished(step.phase, result.elapsed_ms, result.hit)
        return result
