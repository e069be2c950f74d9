"""The phase engine: pure, content-addressed phases memoised through the action cache.

A phase declares its name, its named inputs and outputs and the configuration keys it reads, and
is a pure function of them. Its *signature* is the digest of everything it depends on besides its
inputs — the phase name, the fingerprint of the code implementing it, the Python toolchain, the
fingerprints of the plugins it calls and the configuration it reads — and its action key is the
digest of that signature and its input digests. doit's up-to-date check uses the same signature
(``ipubuild.tasks``), so nothing can be in one and missing from the other. A hit returns the
recorded output digests without running anything.

An output declared ``name/*`` is a *family*: the phase returns any number of members
``name/<key>`` (one per tile, say); each member is a blob, and the output ``name`` is the family's
*index*, a canonical JSON ``{key: digest}`` blob, read with ``Context.family(name)``.
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import gc
import threading
import time
from typing import Callable

from . import canonical, registry
from .errors import UserError
from .fingerprint import code_fingerprint
from .log import log
from .store import Store


class MissingBlob(UserError):
    """A blob that is not in the store and that no recorded producer could rebuild."""

    def __init__(self, digest: str, why: str = "missing and no recorded producer can rebuild it"):
        super().__init__(f"cache blob {digest[:16]}", why)
        self.digest = digest


@dataclasses.dataclass(frozen=True)
class Phase:
    """A compiler phase. ``fn(ctx)`` returns ``{output_name: bytes}``."""
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
    """The Python-side toolchain every phase runs on: part of every signature, so that an
    upgrade of Python, numpy, ml_dtypes or pluggy never gives a stale hit."""
    import platform
    from importlib.metadata import PackageNotFoundError, version
    out = {"python": platform.python_version(), "implementation": platform.python_implementation()}
    for dist in ("numpy", "ml-dtypes", "pluggy", "orjson"):
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

    def family(self, name: str) -> dict[str, str]:
        """A family's members by key: the index behind the input ``name`` (a family output of
        another phase), or the input slots ``name/<key>`` given one by one (sources)."""
        name = name.rstrip("/*")
        if name in self.input_digests:
            return dict(self.engine.decoded(self.input_digests[name]))
        p = name + "/"
        return {k[len(p):]: d for k, d in self.input_digests.items() if k.startswith(p)}


@dataclasses.dataclass
class Result:
    outputs: dict[str, str]
    hit: bool
    elapsed_ms: int
    key: str
    remote: bool = False        # a hit found in the shared (remote) tier, not the local cache


class Engine:
    """Runs phases through the store; ``plugin_fingerprints(hooks)`` names plugins taking part."""

    RECENT_BYTES = 256 * 2**20     # blobs this process made, handed to their readers directly
    RECENT_BLOB_MAX = 64 * 2**20
    # and of the larger ones only the last (a package: ViT-B/16's 426 MB, which the device run
    # reads next) when no decoded value stands for it: reading it back from the store and
    # verifying it cost 0.4 s of a 5.8 s device run

    def __init__(self, store: Store, plugin_fingerprints: Callable[[tuple], dict] | None = None):
        self.store = store
        self.plugin_fingerprints = plugin_fingerprints or (lambda hooks: {})
        self._decoded: collections.OrderedDict[str, tuple] = collections.OrderedDict()   # digest -> (value, size)
        self._decoded_bytes = 0
        self._recent: collections.OrderedDict[str, bytes] = collections.OrderedDict()
        self._recent_bytes = 0
        self._last_large: tuple[str, bytes] | None = None
        self._lock = threading.Lock()
        self._local = threading.local()
        self.stats = collections.Counter()   # "hit" / "miss" counts of run()

    # keys -----------------------------------------------------------------------------------
    def signature(self, ph: Phase, config: dict) -> str:
        """Everything a phase's result depends on besides its inputs, as one digest."""
        return canonical.digest_of({
            "phase": ph.name, "code": ph.code, "toolchain": toolchain(),
            "plugins": self.plugin_fingerprints(ph.hooks) if ph.hooks else {},
            "config": config_subset(config, ph.config)})

    def action_key(self, ph: Phase, inputs: dict[str, str], config: dict) -> str:
        return canonical.digest_of({"signature": self.signature(ph, config), "inputs": inputs})

    # running ----------------------------------------------------------------------------------
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
                self._count("hit")
                return Result(recorded, True, int((time.perf_counter() - t0) * 1000), key,
                              remote=getattr(self.store, "last_hit_remote", lambda: False)())
        self._count("miss")
        subset = config_subset(config, ph.config)
        # the phase sees only the configuration it declared: an undeclared read fails at once
        with _gc_paused():
            blobs = ph.fn(Context(self, ph, inputs, _unflatten(subset)))
        for out_name in blobs:
            if out_name not in ph.outputs and _family(ph, out_name) is None:
                raise KeyError(f"phase {name} returned undeclared output {out_name}")
        # a blob kept in a file of its own is written first, in its own transaction: an open batch
        # holds its index's write lock, which other processes' writes (and reads of blobs, which
        # record the access) wait for, so a batch must not spend it writing files
        inline_max = self.store.inline_max
        own_file = {n: self.put(data) for n, data in sorted(blobs.items()) if len(data) >= inline_max}
        outputs, families = {}, {}
        with self.store.batch():            # the other outputs, the provenance and the record: one commit
            for out_name, data in sorted(blobs.items()):
                family = _family(ph, out_name)
                d = own_file.get(out_name) or self.put(data)
                self.store.add_provenance(d, {"phase": name, "inputs": inputs, "config": subset, "output": out_name})
                if family is None:
                    outputs[out_name] = d
                else:
                    families.setdefault(family, {})[out_name[len(family) + 1:]] = d
            for family in (o[:-2] for o in ph.outputs if o.endswith("/*")):
                index = self.put(canonical.dumps(families.get(family, {})))
                self.store.add_provenance(index, {"phase": name, "inputs": inputs, "config": subset, "output": family})
                outputs[family] = index
            self.store.put_action(key, outputs)
        return Result(outputs, False, int((time.perf_counter() - t0) * 1000), key)

    def _count(self, what: str) -> None:
        with self._lock:
            self.stats[what] += 1

    def put(self, data: bytes, *, pin: bool = False) -> str:
        """Store a blob this process made, keeping it at hand for its readers (and, for
        ``canonical.Json``, its value); ``pin`` as ``Store.put``."""
        d = self.store.put(data, pin=pin)
        valued = False
        if hasattr(data, "value"):          # canonical.Json: its value at hand
            self._remember(d, data.value, _memory(data))
            valued = True
        elif canonical.is_plan_blob(data):  # a plan blob this process made: its value too
            made, value = registry.load(registry.PLAN_CODEC).take_value(data)
            if made:
                self._remember(d, value, _memory(data))
                valued = True
        if len(data) > self.RECENT_BLOB_MAX and not valued:
            with self._lock:
                self._last_large = (d, bytes(data))
        elif len(data) <= self.RECENT_BLOB_MAX:
            with self._lock:
                if d not in self._recent:
                    self._recent[d] = data
                    self._recent_bytes += len(data)
                self._recent.move_to_end(d)
                while self._recent_bytes > self.RECENT_BYTES:
                    _, old = self._recent.popitem(last=False)
                    self._recent_bytes -= len(old)
        return d

    # reading ----------------------------------------------------------------------------------
    def available(self, digest: str) -> bool:
        """Whether a blob can be read without rebuilding it."""
        return digest in self._recent or self.store.has(digest)

    def fetch(self, digest: str) -> bytes:
        """A verified blob; a missing or corrupt one is rebuilt by re-running a phase that made
        it (one whose inputs do not need the blob itself: rebuilding never goes round in a
        circle). Raises MissingBlob when none can."""
        with self._lock:
            data = self._recent.get(digest)
            if data is None and self._last_large is not None and self._last_large[0] == digest:
                data = self._last_large[1]
        if data is not None:
            return data
        data = self.store.get(digest)
        if data is not None:
            return data
        return self._rebuild(digest)

    def _rebuild(self, digest: str) -> bytes:
        busy = self._local.__dict__.setdefault("rebuilding", set())
        records = [r for r in self.store.get_provenance(digest)
                   if r.get("phase") in PHASES and digest not in r.get("inputs", {}).values()
                   and not busy.intersection(r.get("inputs", {}).values())]
        if digest in busy or not records:
            raise MissingBlob(digest, "missing and its producer is unknown" if not records
                              else "missing, and rebuilding it needs itself")
        for rec in records:
            log.warning("rebuilding missing cache blob by re-running its phase", phase=rec["phase"],
                        digest=digest[:16])
            busy.add(digest)
            try:
                result = self.run(rec["phase"], rec["inputs"], _unflatten(rec["config"]), force=True)
            except MissingBlob:
                continue
            finally:
                busy.discard(digest)
            got = result.outputs.get(rec["output"])
            if got is None and "/" in rec["output"]:       # a family member: look in the index
                family, _, member = rec["output"].rpartition("/")
                got = canonical.loads(self.fetch(result.outputs[family])).get(member)
            if got != digest:
                raise UserError(f"phase {rec['phase']}", "re-running it gave different bytes (a "
                                "non-deterministic phase); delete .ipubuild and rebuild")
            with self._lock:
                data = self._recent.get(digest)
            return data if data is not None else self.store.get(digest)
        raise MissingBlob(digest)

    def decoded(self, digest: str):
        """The JSON value of a blob, memoised by digest (readers must not modify it)."""
        with self._lock:
            if digest in self._decoded:
                self._decoded.move_to_end(digest)
                return self._decoded[digest][0]
        data = self.fetch(digest)
        value = _loads(data)
        self._remember(digest, value, _memory(data))
        return value

    # decoded values kept, by their memory (``_memory``), 3 GiB of it: a ViT-B/16 candidate's values
    # (its program alone 1.5 GB, about 2 GB with its schedules, tables and storage) and not
    # several candidates' in a search worker
    DECODED_BYTES = 3 << 30

    def forget_values(self) -> None:
        """Drop the decoded values and recent blobs kept at hand (readers then read the store)."""
        with self._lock:
            self._decoded.clear()
            self._decoded_bytes = 0
            self._recent.clear()
            self._recent_bytes = 0
            self._last_large = None

    def _remember(self, digest: str, value, size: int) -> None:
        with self._lock:
            if digest not in self._decoded:
                self._decoded_bytes += size
            self._decoded[digest] = (value, size)
            self._decoded.move_to_end(digest)
            while self._decoded_bytes > self.DECODED_BYTES and len(self._decoded) > 1:
                self._decoded_bytes -= self._decoded.popitem(last=False)[1][1]


def _loads(data: bytes):
    """JSON bytes decoded (orjson, several times faster than ``json`` on planning artifacts;
    ``json`` for what orjson refuses, such as integers beyond 64 bits)."""
    if canonical.is_plan_blob(data):
        return registry.load(registry.PLAN_CODEC).from_plan_blob(data)
    import orjson
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError:
        return canonical.loads(data)


def _memory(data: bytes) -> int:
    """About how much memory a blob's decoded value takes."""
    if canonical.is_plan_blob(data):
        return registry.load(registry.PLAN_CODEC).plan_blob_memory(data)
    return canonical.heap_estimate(data)


_gc_depth = [0]
_gc_lock = threading.Lock()


@contextlib.contextmanager
def _gc_paused():
    """Python's cyclic collector off while phases run: they build large acyclic structures
    (programs, tables), which reference counting frees, and that the collector would otherwise
    traverse again and again (a third of a search candidate's time). When the last phase ends,
    what exists is frozen (``gc.freeze``): the values the engine keeps at hand for readers are
    never traversed either (on ViT-B/16, 1.3 s of a candidate), and reference counting still
    frees them; only a reference cycle made during a phase outlives its last reference."""
    with _gc_lock:
        _gc_depth[0] += 1
        if _gc_depth[0] == 1:
            was = gc.isenabled()
            gc.disable()
            _gc_was[0] = was
    try:
        yield
    finally:
        with _gc_lock:
            _gc_depth[0] -= 1
            if _gc_depth[0] == 0 and _gc_was[0]:
                gc.freeze()
                gc.enable()


_gc_was = [True]


def _family(ph: Phase, out_name: str) -> str | None:
    """The output family (``name/*``) ``out_name`` belongs to, if any."""
    return next((o[:-2] for o in ph.outputs if o.endswith("/*") and out_name.startswith(o[:-1])), None)


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
