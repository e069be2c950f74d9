"""The phase engine: pure, content-addressed phases memoised through the action cache.

A phase declares its name, its named inputs and outputs and the configuration keys it reads, and
is a pure function of them. Its action key is the digest of the phase name, the fingerprint of
the code implementing it, the fingerprints of the plugins it calls, its input digests and the
configuration it reads. A hit returns the recorded output digests without running anything.
"""
from __future__ import annotations

import collections
import dataclasses
import functools
import threading
import time
from typing import Callable

from . import canonical
from .errors import UserError
from .fingerprint import code_fingerprint
from .log import log
from .store import Store


@dataclasses.dataclass(frozen=True)
class Phase:
    """A compiler phase. ``fn(ctx)`` returns ``{output_name: bytes}``.

    An output name ending in ``/*`` is a family: the function returns any number of outputs
    ``name/<key>`` under it (one per tile, say).
    """
    name: str
    fn: Callable
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    config: tuple[str, ...] = ()
    hooks: tuple[str, ...] = ()

    @property
    def code(self) -> str:
        return code_fingerprint(self.fn.__module__)


PHASES: dict[str, Phase] = {}


@functools.lru_cache(maxsize=None)
def toolchain() -> dict:
    """The Python-side toolchain every phase runs on: part of every action key, so that an
    upgrade of Python, numpy or ml_dtypes never gives a stale hit."""
    import platform
    from importlib.metadata import PackageNotFoundError, version
    out = {"python": platform.python_version()}
    for dist in ("numpy", "ml-dtypes", "pluggy"):
        try:
            out[dist] = version(dist)
        except PackageNotFoundError:
            out[dist] = None
    return out


def phase(name: str, inputs=(), outputs=(), config=(), hooks=()):
    """Register ``fn`` as the phase ``name`` (decorator)."""
    def register(fn):
        PHASES[name] = Phase(name, fn, tuple(inputs), tuple(outputs), tuple(config), tuple(hooks))
        return fn
    return register


def config_subset(config: dict, keys) -> dict:
    """The values of dotted ``keys`` (``"search.rounds"``) in a nested config; absent → None."""
    out = {}
    for key in keys:
        value = config
        for part in key.split("."):
            value = value.get(part) if isinstance(value, dict) else None
        out[key] = value
    return out


class Context:
    """What a running phase sees: its inputs, its configuration, and decoders for both."""

    def __init__(self, engine: "Engine", phase: Phase, inputs: dict, config: dict):
        self.engine, self.phase, self.input_digests, self.config = engine, phase, inputs, config

    def digest(self, name: str) -> str:
        return self.input_digests[name]

    def bytes(self, name: str) -> bytes:
        return self.engine.fetch(self.input_digests[name])

    def json(self, name: str):
        return self.engine.decoded(self.input_digests[name])

    def family(self, prefix: str) -> dict[str, str]:
        """Input digests of a family, keyed by member (``tile_code/3`` → ``"3"``)."""
        p = prefix.rstrip("*")
        return {k[len(p):]: d for k, d in self.input_digests.items() if k.startswith(p)}


@dataclasses.dataclass
class Result:
    outputs: dict[str, str]
    hit: bool
    elapsed_ms: int
    key: str


class Engine:
    """Runs phases through the store; ``plugin_fingerprints(hooks)`` names plugins taking part."""

    def __init__(self, store: Store, plugin_fingerprints: Callable[[tuple], dict] | None = None):
        self.store = store
        self.plugin_fingerprints = plugin_fingerprints or (lambda hooks: {})
        self._decoded: collections.OrderedDict[str, object] = collections.OrderedDict()
        self._lock = threading.Lock()
        self.stats = collections.Counter()   # "hit" / "miss" counts of run()

    def action_key(self, ph: Phase, inputs: dict[str, str], config: dict) -> str:
        return canonical.digest_of({
            "phase": ph.name, "code": ph.code, "toolchain": toolchain(),
            "plugins": self.plugin_fingerprints(ph.hooks) if ph.hooks else {},
            "inputs": inputs, "config": config_subset(config, ph.config)})

    def run(self, name: str, inputs: dict[str, str], config: dict, *, force: bool = False) -> Result:
        """Run phase ``name`` on input digests, or return its recorded outputs."""
        ph = PHASES[name]
        missing = [i for i in ph.inputs if not i.endswith("/*") and i not in inputs]
        if missing:
            raise KeyError(f"phase {name} lacks inputs {missing}")
        key = self.action_key(ph, inputs, config)
        t0 = time.perf_counter()
        if not force:
            recorded = self.store.get_action(key)
            if recorded is not None:
                self.stats["hit"] += 1
                return Result(recorded, True, int((time.perf_counter() - t0) * 1000), key)
        self.stats["miss"] += 1
        # the phase sees only the configuration it declared: an undeclared read fails at once
        blobs = ph.fn(Context(self, ph, inputs, _unflatten(config_subset(config, ph.config))))
        outputs = {}
        subset = config_subset(config, ph.config)
        for out_name, data in sorted(blobs.items()):
            if not any(out_name == o or (o.endswith("/*") and out_name.startswith(o[:-1]))
                       for o in ph.outputs):
                raise KeyError(f"phase {name} returned undeclared output {out_name}")
            d = outputs[out_name] = self.store.put(data)
            self.store.put_provenance(d, {"phase": name, "inputs": inputs, "config": subset,
                                          "output": out_name})
        self.store.put_action(key, outputs)
        return Result(outputs, False, int((time.perf_counter() - t0) * 1000), key)

    def fetch(self, digest: str) -> bytes:
        """A verified blob; a missing or corrupt one is rebuilt by re-running its producer."""
        data = self.store.get(digest)
        if data is not None:
            return data
        prov = self.store.get_provenance(digest)
        if prov is None or prov["phase"] not in PHASES:
            raise UserError(f"cache blob {digest[:16]}",
                            "missing and its producer is unknown; delete .ipubuild and rebuild")
        log.warning("rebuilding missing cache blob by re-running its phase",
                    phase=prov["phase"], digest=digest[:16])
        result = self.run(prov["phase"], prov["inputs"], _unflatten(prov["config"]), force=True)
        if result.outputs.get(prov["output"]) != digest:
            raise UserError(f"phase {prov['phase']}",
                            "re-running it gave different bytes (a non-deterministic phase); "
                            "delete .ipubuild and rebuild")
        return self.store.get(digest)

    def decoded(self, digest: str):
        """The JSON value of a blob, memoised by digest."""
        with self._lock:
            if digest in self._decoded:
                self._decoded.move_to_end(digest)
                return self._decoded[digest]
        value = canonical.loads(self.fetch(digest))
        with self._lock:
            self._decoded[digest] = value
            if len(self._decoded) > 512:
                self._decoded.popitem(last=False)
        return value


def _unflatten(subset: dict) -> dict:
    """Turn ``{"a.b": 1}`` back into ``{"a": {"b": 1}}``."""
    out: dict = {}
    for key, value in subset.items():
        node = out
        *parents, last = key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[last] = value
    return out


@phase("read_machine", inputs=("file",), outputs=("machine",))
def read_machine(ctx):
    """The machine description as an artifact (its file's bytes)."""
    return {"machine": ctx.bytes("file")}
