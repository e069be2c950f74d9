"""The remote cache tier: the store shared by a team and CI through a cache backend.

Off unless ``$IPUBUILD_REMOTE_CACHE`` holds a URL; the backend for its scheme comes from the
``ipubuild_cache_backends`` hook (``http``/``https``, Bazel's HTTP cache protocol, is built in:
``ipubuild.remote.http``). The local store (``ipubuild.store.Store``) asks this tier on a local
miss and hands it what it stores:

* **Reads** are verified before use: a blob against its sha256, an action entry against its
  checksum, key and shape. What fails is counted, warned about once, treated as a miss and
  never stored. An action hit does not download its outputs (a blob comes down only when it is
  read) but brings how to rebuild each of them (their provenance), and is a hit only then: so a
  blob the remote has lost or lies about is rebuilt from its producer, as a local one is.
* **Writes** go behind the build: a queue bounded in bytes, drained by one thread in order (an
  action entry is uploaded after the blobs it names), flushed with a bounded wait at the end of
  a build. ``IPUBUILD_REMOTE_CACHE_UPLOAD=0`` makes a read-only client.
* **Failures** (unreachable, slow, HTTP errors, garbage, a lying server) cost one warning line
  per build, and the build goes on locally. An unreachable or timed-out remote is not asked
  again in this process; other failures switch a direction (reads, writes) off after
  ``MAX_FAILURES``. Nothing here raises into the build.

Remote keys: blobs ``cas/<sha256>``; actions ``ac/<action key>``, one entry each
(``action_entry``): a checksummed record in the store's format whose payload names its format
and its own key (so an entry served under another key is refused) and holds the action's output
digests and the provenance of each. One GET per action hit, one PUT per action run.

Counters (``stats``) are per process. A forked search worker hands its counters, and any warning
it would print, to the parent with each evaluation (``take`` / ``merge``).

The folder ``ipubuild/remote/`` is "elsewhere": this tier and the Dask cluster (``cluster``) that
``ipubuild.engine.executors`` sends work to. It may import the engine, plugins, the graph and the
compiler; the engine reaches it only by name (``ipubuild.engine.registry``).
"""
from __future__ import annotations

import collections
import multiprocessing.util
import os
import re
import threading
import time
import urllib.parse
import weakref

from ..engine import canonical
from ..engine.errors import UserError
from ..engine.log import log

MAX_FAILURES = 3                  # failures of one direction before it is switched off
QUEUE_BYTES = 256 * 2**20         # uploads waiting in memory, at most
QUEUE_WAIT = 1.0                  # seconds a put may wait for room before its upload is dropped
DEFAULT_TIMEOUTS = (2.0, 10.0)    # connect, read (seconds)
_HEX64 = re.compile(r"[0-9a-f]{64}\Z")


class RemoteError(Exception):
    """A failed remote request; raised by backends. Its message names the request and what went
    wrong and must never hold a credential. ``unreachable=True`` (connection refused, timed out,
    host unknown) switches the remote off for the rest of the process at once."""

    def __init__(self, message: str, *, unreachable: bool = False):
        super().__init__(message)
        self.unreachable = unreachable


# configuration ---------------------------------------------------------------------------------
def redact(url: str) -> str:
    """``url`` without its user:password part, for every message that names the remote."""
    parts = urllib.parse.urlsplit(url)
    netloc = parts.netloc.rpartition("@")[2]
    return urllib.parse.urlunsplit((parts.scheme, netloc, parts.path, "", ""))


def _seconds(name: str, default: float) -> float:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not 0 < value < 3600:
        raise UserError(name, f"expected a number of seconds (0 < s < 3600), got {raw!r}")
    return value


def timeouts() -> tuple[float, float]:
    """(connect, read) timeouts in seconds: ``$IPUBUILD_REMOTE_CACHE_CONNECT_TIMEOUT`` (default
    2) and ``$IPUBUILD_REMOTE_CACHE_READ_TIMEOUT`` (default 10; also bounds the final flush)."""
    return (_seconds("IPUBUILD_REMOTE_CACHE_CONNECT_TIMEOUT", DEFAULT_TIMEOUTS[0]),
            _seconds("IPUBUILD_REMOTE_CACHE_READ_TIMEOUT", DEFAULT_TIMEOUTS[1]))


def _upload_enabled() -> bool:
    raw = os.environ.get("IPUBUILD_REMOTE_CACHE_UPLOAD", "1").strip().lower()
    if raw in ("1", "true", "yes", "on", ""):
        return True
    if raw in ("0", "false", "no", "off"):
        return False
    raise UserError("IPUBUILD_REMOTE_CACHE_UPLOAD", f"expected 1 or 0, got {raw!r}")


def backends() -> dict:
    """``{scheme: factory}`` from every plugin's ``ipubuild_cache_backends``."""
    from ..plugins import get_plugin_manager
    return get_plugin_manager().collect("ipubuild_cache_backends", callable,
                                        "a dict {scheme: factory(url)}", mapping=True)


def from_environment() -> "RemoteCache | None":
    """The tier ``$IPUBUILD_REMOTE_CACHE`` asks for, or None when it is unset or empty.
    A malformed setting is a UserError naming the variable (the URL shown without credentials)."""
    url = os.environ.get("IPUBUILD_REMOTE_CACHE", "").strip()
    if not url:
        return None
    scheme = urllib.parse.urlsplit(url).scheme.lower()
    found = backends()
    if scheme not in found:
        raise UserError("IPUBUILD_REMOTE_CACHE", f"no cache backend for {redact(url)!r}; known schemes: "
                        f"{', '.join(sorted(found)) or 'none'} (a plugin adds others via ipubuild_cache_backends)")
    return RemoteCache(url, found[scheme], upload=_upload_enabled(), flush_seconds=timeouts()[1])


# the remote action entry --------------------------------------------------------------------------
ENTRY_FORMAT = "ipubuild-action/1"


def action_entry(action_key: str, outputs: dict, provenance: dict) -> bytes:
    """The bytes stored at ``ac/<action key>``: a checksummed record, in the store's format (the
    sha256 hex of the canonical-JSON payload, then the payload), whose payload names its format
    and its key and holds the output digests and how to rebuild each of them."""
    payload = canonical.dumps({"format": ENTRY_FORMAT, "key": action_key, "outputs": outputs,
                               "provenance": provenance})
    return canonical.digest(payload).encode() + payload


def read_entry(action_key: str, raw: bytes) -> tuple[dict, dict] | str | None:
    """(outputs, {output digest: provenance}) of an entry that verifies — its checksum, format,
    key and shape, with the provenance of every output —; ``"other format"`` for an intact
    record of another format (another version, another tool: a miss, not a lie); else None."""
    if len(raw) < 64 or canonical.digest(raw[64:]).encode() != raw[:64]:
        return None
    try:
        value = canonical.loads(raw[64:])
    except ValueError:
        return None
    if not isinstance(value, dict) or value.get("format") != ENTRY_FORMAT:
        return "other format"
    if value.get("key") != action_key:
        return None
    outputs, provenance = value.get("outputs"), value.get("provenance")
    if not _digests(outputs) or not isinstance(provenance, dict) or set(provenance) != set(outputs.values()) \
            or not all(_provenance_ok(p) for p in provenance.values()):
        return None
    return outputs, provenance


def _digests(value) -> bool:
    return isinstance(value, dict) and all(isinstance(k, str) and isinstance(v, str) and _HEX64.match(v)
                                           for k, v in value.items())


def _provenance_ok(value) -> bool:
    """A blob's provenance as ``Store.get_provenance`` gives it: a non-empty list of producers."""
    return isinstance(value, list) and bool(value) and all(
        isinstance(r, dict) and isinstance(r.get("phase"), str) and _digests(r.get("inputs"))
        and isinstance(r.get("config"), dict) and isinstance(r.get("output"), str) for r in value)


# the tier ---------------------------------------------------------------------------------------
_TIERS: "weakref.WeakSet[RemoteCache]" = weakref.WeakSet()


class RemoteCache:
    """The remote tier over one backend. Thread-safe; after a fork the child gets fresh locks,
    an empty upload queue, zeroed counters and its own backend (``factory(url)`` again)."""

    def __init__(self, url: str, factory, *, upload: bool = True, flush_seconds: float = DEFAULT_TIMEOUTS[1],
                 queue_bytes: int = QUEUE_BYTES):
        self.url, self.where, self.upload = url, redact(url), upload
        self.flush_seconds, self.queue_bytes = flush_seconds, queue_bytes
        self._factory = factory
        self._failures = {"read": 0, "write": 0}
        self._off: set[str] = set()          # directions switched off
        self._warned: set[str] = set()       # warning kinds already printed by this build
        self._parent_pid = None              # set in a forked child
        self._fresh_process()
        self._backend = self._make_backend()  # a bad URL fails here, as a UserError
        _TIERS.add(self)

    def _fresh_process(self) -> None:
        self.stats: collections.Counter = collections.Counter()
        # one lock guards the counters, the queue and the flags; it is never held while calling
        # the backend or logging
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._queue: collections.deque = collections.deque()
        self._queued_bytes = 0
        self._busy = 0                       # uploads taken off the queue, not yet finished
        self._thread = None
        self._backend = None
        self._pending: list[tuple[str, str]] = []   # warnings a forked child hands its parent

    def _make_backend(self):
        try:
            return self._factory(self.url)
        except UserError:
            raise
        except Exception as exc:  # noqa: BLE001 - a plugin's factory: named, not a traceback
            raise UserError("IPUBUILD_REMOTE_CACHE", f"the cache backend for {self.where} failed to start: "
                            f"{type(exc).__name__}") from None

    def _after_fork(self) -> None:
        self._parent_pid = self._parent_pid or os.getppid()
        self._failures = {"read": 0, "write": 0}   # the parent counts its own
        self._fresh_process()

    def _client(self):
        if self._backend is None:
            with self._lock:
                if self._backend is None:
                    self._backend = self._make_backend()
        return self._backend

    # failures and warnings ----------------------------------------------------------------
    def _warn(self, kind: str, message: str) -> None:
        """Print ``message`` unless a warning of this kind was printed (a forked worker hands it
        to its parent instead, which prints it at most once)."""
        with self._lock:
            if kind in self._warned:
                return
            first = not self._warned             # one warning line per remote per build
            self._warned.add(kind)
            if self._parent_pid is not None:
                self._pending.append((kind, message))
                return
        if first:
            log.warning(message)
        else:
            log.info("remote cache: another kind of failure (see the warning above)", detail=message)

    def _failed(self, direction: str, exc: BaseException) -> None:
        if isinstance(exc, RemoteError):
            what, unreachable = str(exc), exc.unreachable
        else:   # a plugin backend's bug: named by type only (its message might hold a secret)
            what, unreachable = f"the backend raised {type(exc).__name__}", False
        with self._lock:
            self.stats["errors"] += 1
            self._failures[direction] += 1
            before = set(self._off)
            if unreachable:
                self._off.update(("read", "write"))
            elif self._failures[direction] >= MAX_FAILURES:
                self._off.add(direction)
            newly = self._off - before
        self._warn("transport", f"remote cache {self.where}: {what}; the build goes on with the local cache")
        if newly:
            log.info("remote cache switched off for the rest of this build", directions=",".join(sorted(newly)))
        if "write" in newly:
            self._drop_queue()

    def _call(self, direction: str, fn):
        """``fn()`` (a backend call); (True, its result), or (False, None) after a failure or
        when this direction is off."""
        if direction in self._off:
            return False, None
        try:
            return True, fn()
        except Exception as exc:  # noqa: BLE001 - fail open: any backend failure is a miss
            self._failed(direction, exc)
            return False, None

    def _verify_failed(self, what: str) -> None:
        with self._lock:
            self.stats["verify_failures"] += 1
            self._failures["read"] += 1
            tripped = self._failures["read"] >= MAX_FAILURES and "read" not in self._off
            if tripped:
                self._off.add("read")
        self._warn("verify", f"remote cache {self.where}: {what} failed verification (corrupt or tampered "
                   "remote entry); ignored, the build uses or rebuilds its own copy")
        if tripped:
            log.info("remote cache switched off for the rest of this build", directions="read")

    # reads ---------------------------------------------------------------------------------
    def _download(self, kind: str, key: str) -> bytes | None:
        ok, data = self._call("read", lambda: self._client().get(kind, key))
        if not ok or data is None:
            return None
        if not isinstance(data, (bytes, bytearray)):
            self._failed("read", RemoteError(f"GET {kind}/{key[:12]}: the backend returned {type(data).__name__}"))
            return None
        with self._lock:
            self.stats["down"] += len(data)
        return bytes(data)

    def get_blob(self, digest: str) -> bytes | None:
        """The verified blob ``digest`` from the remote, or None."""
        data = self._download("cas", digest)
        if data is None:
            return None
        if canonical.digest(data) != digest:
            self._verify_failed(f"blob {digest[:16]}")
            return None
        with self._lock:
            self.stats["blobs_down"] += 1
        return data

    def get_action(self, action_key: str, *, local_hit: bool) -> tuple[dict, dict] | None:
        """Count an action lookup. On a local miss: the verified outputs ``{name: digest}`` of
        the action from the remote and ``{output digest: provenance record}`` (how to rebuild
        each of them), or None. The outputs themselves are not downloaded."""
        if local_hit:
            with self._lock:
                self.stats["local_hits"] += 1
            return None
        raw = self._download("ac", action_key)
        found = read_entry(action_key, raw) if raw is not None else None
        if raw is not None and found is None:
            self._verify_failed(f"action record {action_key[:16]}")
        if isinstance(found, str):
            found = None
        with self._lock:
            self.stats["remote_hits" if found is not None else "misses"] += 1
        return found

    # writes --------------------------------------------------------------------------------
    def put_blob(self, digest: str, data: bytes) -> None:
        self._enqueue("cas", digest, data)

    def put_action(self, action_key: str, outputs: dict, provenance: dict) -> None:
        """Upload an action's outputs with the provenance of each (``{digest: record}``); an
        action some output of which has no provenance is not shared (no one could rebuild it)."""
        if set(provenance) != set(outputs.values()) or not all(_provenance_ok(p) for p in provenance.values()):
            return
        self._enqueue("ac", action_key, action_entry(action_key, outputs, provenance))

    def _enqueue(self, kind: str, key: str, data: bytes) -> None:
        if not self.upload or "write" in self._off:
            return
        data = bytes(data)
        deadline = time.monotonic() + QUEUE_WAIT
        with self._cond:
            # room for it, or an empty queue (a blob larger than the bound still goes, alone)
            while self._queued_bytes and self._queued_bytes + len(data) > self.queue_bytes:
                left = deadline - time.monotonic()
                if left <= 0 or "write" in self._off:
                    self.stats["upload_dropped"] += 1
                    return
                self._cond.wait(left)
            self._queue.append((kind, key, data))
            self._queued_bytes += len(data)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._uploader, name="ipubuild-remote-upload", daemon=True)
                self._thread.start()
            self._cond.notify_all()

    def _uploader(self) -> None:
        while True:
            with self._cond:
                while not self._queue:
                    self._cond.wait()
                kind, key, data = self._queue.popleft()
                self._busy += 1
            ok, _ = self._call("write", lambda: self._client().put(kind, key, data))
            with self._cond:
                self._busy -= 1
                self._queued_bytes -= len(data)
                if ok:
                    self.stats["up"] += len(data)
                    self.stats["uploads"] += 1
                self._cond.notify_all()

    def _drop_queue(self) -> None:
        with self._cond:
            self.stats["upload_dropped"] += len(self._queue)
            self._queued_bytes -= sum(len(d) for _, _, d in self._queue)
            self._queue.clear()
            self._cond.notify_all()

    def flush(self, timeout: float | None = None) -> bool:
        """Wait (at most ``timeout``, default the read timeout) for queued uploads; True when
        none is left. What is left keeps going in the background until the process ends."""
        deadline = time.monotonic() + (self.flush_seconds if timeout is None else timeout)
        with self._cond:
            while self._queue or self._busy:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def close(self) -> None:
        """Flush (bounded) and close the backend's connections."""
        if not self.flush():
            log.info("remote cache: uploads left unfinished", pending=len(self._queue))
        backend = self._backend
        if backend is not None and hasattr(backend, "close"):
            try:
                backend.close()
            except Exception:  # noqa: BLE001 - closing never fails a build
                pass

    # counters ------------------------------------------------------------------------------
    def summary(self) -> str:
        """The build's one-line account, after a bounded flush of the uploads."""
        t0 = time.monotonic()
        if not self.flush():
            log.info("remote cache: uploads left unfinished", pending=len(self._queue))
        if time.monotonic() - t0 > 0.05:
            log.info("remote cache: waited for uploads", seconds=f"{time.monotonic() - t0:.2f}")
        s = self.stats
        return (f"cache: local_hits={s['local_hits']} remote_hits={s['remote_hits']} misses={s['misses']} "
                f"down={s['down']}B up={s['up']}B verify_failures={s['verify_failures']} errors={s['errors']}")

    def take(self) -> dict:
        """In a forked worker: flush (bounded), then hand over and reset the counters, the
        failures and the warnings not yet printed, for ``merge`` in the parent."""
        self.flush()
        with self._lock:
            report = {"stats": dict(self.stats), "failures": dict(self._failures),
                      "off": sorted(self._off), "warnings": list(self._pending)}
            self.stats.clear()
            self._failures = {"read": 0, "write": 0}
            self._pending.clear()
        return report

    def merge(self, report: dict | None) -> None:
        """Add a worker's ``take`` to this process's counters; print its warnings (once)."""
        if not report:
            return
        with self._lock:
            self.stats.update(report["stats"])
            for direction, n in report["failures"].items():
                self._failures[direction] += n
            newly = set(report["off"]) - self._off
            self._off.update(newly)
        for kind, message in report["warnings"]:
            self._warn(kind, message)
        if "write" in newly:
            self._drop_queue()


def _after_fork_in_child() -> None:
    for tier in list(_TIERS):
        tier._after_fork()


def _at_exit() -> None:
    """Flush every tier (bounded) when a process ends; a forked child first prints the warnings
    it could not hand to its parent."""
    for tier in list(_TIERS):
        pending, tier._pending = tier._pending, []
        for _, message in pending:
            log.warning(message)
        if not tier.flush():
            log.info("remote cache: uploads left unfinished", pending=len(tier._queue))


def _flush_at_exit(_=None) -> None:
    multiprocessing.util.Finalize(None, _at_exit, exitpriority=10)


os.register_at_fork(after_in_child=_after_fork_in_child)
# multiprocessing runs its finalizers when the main process exits (through atexit) and when a
# child of its own exits (which skips atexit, and starts with an empty finalizer registry: so
# the finalizer is registered again in each such child)
_flush_at_exit()
multiprocessing.util.register_after_fork(_TIERS, _flush_at_exit)
