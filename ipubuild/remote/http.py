"""Bazel's HTTP cache protocol (as served by bazel-remote, or nginx with WebDAV), on the stdlib.

``GET <base>/<kind>/<key>`` answers 200 with the bytes or 404; ``PUT`` stores (any 2xx). One
persistent (keep-alive) connection per thread and process; connect and read timeouts; a body's
size and transfer time are bounded. Credentials come from, in order: the URL's
``user:password@``, ``$IPUBUILD_REMOTE_CACHE_HEADER`` (``Name: value``, several separated by
newlines), or the ``~/.netrc`` / ``$NETRC`` entry for the host. They are sent, never shown: every
message names the remote without its userinfo, and no header value ever enters a message.

Why the stdlib and not ``requests``/``urllib3``: what is needed is two verbs on one host with
keep-alive, timeouts and a size cap; http.client does that in a page, adds no dependency and no
import cost for builds without a remote. (urllib.request opens a new connection per request.)
"""
from __future__ import annotations

import base64
import functools
import http.client
import netrc
import os
import socket
import ssl
import threading
import time
import urllib.parse

from .. import __version__
from ..engine.errors import UserError
from . import RemoteError, redact, timeouts

MAX_BODY = 4 * 2**30          # bytes a GET may return at most
MIN_RATE = 1 * 2**20          # bytes/s a body must arrive at, at least (after the read timeout)
_CHUNK = 1 * 2**20
_STALE = (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError, ConnectionAbortedError)


class HttpCache:
    """A backend for ``http://`` and ``https://`` URLs (see ``ipubuild.remote`` for the contract)."""

    def __init__(self, url: str):
        parts = urllib.parse.urlsplit(url)
        self.where = redact(url)
        try:
            port = parts.port
        except ValueError:
            port = -1
        if parts.scheme not in ("http", "https") or not parts.hostname or port == -1 or parts.query \
                or parts.fragment or not all(c.isprintable() and not c.isspace() for c in parts.path):
            raise UserError("IPUBUILD_REMOTE_CACHE", f"expected http(s)://host[:port][/prefix], got {self.where!r}")
        self.https = parts.scheme == "https"
        self.host, self.port = parts.hostname, port or (443 if self.https else 80)
        self.prefix = parts.path.rstrip("/")
        self.connect_timeout, self.read_timeout = timeouts()
        self.headers = {"User-Agent": f"ipubuild/{__version__}",
                        **_credentials(url, os.environ.get("IPUBUILD_REMOTE_CACHE_HEADER", ""),
                                       os.environ.get("NETRC") or None)}
        self._tls = ssl.create_default_context() if self.https else None
        self._local = threading.local()
        self._open: list[http.client.HTTPConnection] = []
        self._lock = threading.Lock()

    # the two verbs -------------------------------------------------------------------------
    def get(self, kind: str, key: str) -> bytes | None:
        status, reason, body = self._request("GET", kind, key)
        if status == 200:
            return body
        if status == 404:
            return None
        raise RemoteError(f"GET {kind}/{key[:12]}…: HTTP {status} {reason}{_hint(status, 'GET', kind)}")

    def put(self, kind: str, key: str, data: bytes) -> None:
        status, reason, _ = self._request("PUT", kind, key, data)
        if not 200 <= status < 300:
            raise RemoteError(f"PUT {kind}/{key[:12]}…: HTTP {status} {reason}{_hint(status, 'PUT', kind)}")

    def close(self) -> None:
        with self._lock:
            conns, self._open = self._open, []
        for conn in conns:
            conn.close()

    # connections ---------------------------------------------------------------------------
    def _connection(self) -> tuple[http.client.HTTPConnection, bool]:
        """This thread's connection (and whether it served a request before)."""
        held = getattr(self._local, "conn", None)
        if held is not None and held[0] == os.getpid():
            return held[1], True
        conn = None
        try:
            if self.https:
                conn = http.client.HTTPSConnection(self.host, self.port, timeout=self.connect_timeout,
                                                   context=self._tls)
            else:
                conn = http.client.HTTPConnection(self.host, self.port, timeout=self.connect_timeout)
            conn.connect()
        except (OSError, ValueError, http.client.HTTPException) as exc:
            if conn is not None:
                conn.close()
            raise RemoteError(f"cannot connect: {_describe(exc)}", unreachable=True) from None
        conn.sock.settimeout(self.read_timeout)
        conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._local.conn = (os.getpid(), conn)
        with self._lock:
            self._open.append(conn)
        return conn, False

    def _drop(self, conn) -> None:
        self._local.conn = None
        conn.close()
        with self._lock:
            if conn in self._open:
                self._open.remove(conn)

    def _request(self, method: str, kind: str, key: str, body: bytes | None = None) -> tuple[int, str, bytes]:
        what = f"{method} {kind}/{key[:12]}…"
        path = f"{self.prefix}/{kind}/{key}"
        for attempt in (1, 2):
            conn, reused = self._connection()
            try:
                conn.request(method, path, body=body, headers=self.headers)
                resp = conn.getresponse()
                data = self._body(resp, ok=method == "GET" and resp.status == 200)
            except _STALE as exc:
                self._drop(conn)
                if reused and attempt == 1:     # the server closed an idle keep-alive connection
                    continue
                raise RemoteError(f"{what}: {_describe(exc)}") from None
            except (OSError, http.client.HTTPException) as exc:
                self._drop(conn)
                timed_out = isinstance(exc, TimeoutError)
                raise RemoteError(f"{what}: {_describe(exc)}", unreachable=timed_out) from None
            if resp.will_close:
                self._drop(conn)
            return resp.status, _printable(resp.reason), data
        raise AssertionError("unreachable")

    def _body(self, resp: http.client.HTTPResponse, *, ok: bool) -> bytes:
        """The response body: all of it for a 200 GET (bounded in size and time), otherwise
        read and dropped (so the connection can serve the next request)."""
        limit = MAX_BODY if ok else 2**20
        length = resp.getheader("Content-Length")
        try:
            expected = int(length) if length is not None else None
        except ValueError:
            raise http.client.HTTPException("bad Content-Length") from None
        if expected is not None and (expected < 0 or expected > limit):
            raise http.client.HTTPException("response too large")
        deadline = time.monotonic() + self.read_timeout + (expected or 0) / MIN_RATE
        chunks, total = [], 0
        while True:
            chunk = resp.read(_CHUNK)
            if not chunk:
                break
            total += len(chunk)
            if total > limit:
                raise http.client.HTTPException("response too large")
            if time.monotonic() > deadline:
                raise TimeoutError("body too slow")
            if ok:
                chunks.append(chunk)
        if expected is not None and total != expected:
            raise http.client.IncompleteRead(b"", expected - total)
        return b"".join(chunks)


@functools.lru_cache(maxsize=8)   # once per process and its forked workers (one netrc warning)
def _credentials(url: str, raw: str, path: str | None) -> dict[str, str]:
    """The authentication headers for the URL: its userinfo, else ``raw``
    ($IPUBUILD_REMOTE_CACHE_HEADER), else the entry for its host in the netrc file ``path``
    ($NETRC; None: ``~/.netrc``, which the netrc module refuses if others can read it)."""
    parts = urllib.parse.urlsplit(url)
    if parts.username is not None:
        user = urllib.parse.unquote(parts.username)
        password = urllib.parse.unquote(parts.password or "")
        return {"Authorization": _basic(user, password)}
    if raw.strip():
        out = {}
        for n, line in enumerate(raw.strip().splitlines(), 1):
            name, sep, value = line.partition(":")
            name, value = name.strip(), value.strip()
            # checked here, so that http.client never quotes a bad value in an error
            if not sep or not name or not all(c.isalnum() or c in "-_" for c in name) \
                    or not value.isprintable() or not value.isascii():
                raise UserError("IPUBUILD_REMOTE_CACHE_HEADER",
                                f"line {n}: expected 'Name: value' (printable ASCII); value not shown")
            out[name] = value
        return out
    if not os.path.isfile(path or os.path.expanduser("~/.netrc")):
        return {}
    try:
        entry = netrc.netrc(path).authenticators(parts.hostname)
    except (OSError, netrc.NetrcParseError) as exc:
        # its message may quote a token of the file: name the file and line only
        line = getattr(exc, "lineno", None)
        from ..engine.log import log
        log.warning(f"remote cache: {path or '~/.netrc'}{f' line {line}' if line else ''} could not be read "
                    f"({type(exc).__name__}); going on without its credentials")
        return {}
    if entry is None:
        return {}
    login, _, password = entry
    return {"Authorization": _basic(login or "", password or "")}


def _basic(user: str, password: str) -> str:
    return "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()


def _describe(exc: BaseException) -> str:
    """What went wrong, in words that cannot carry a secret (never the exception's own text,
    except an OS error's fixed description)."""
    if isinstance(exc, TimeoutError):
        return "timed out"
    if isinstance(exc, ConnectionRefusedError):
        return "connection refused"
    if isinstance(exc, http.client.RemoteDisconnected):
        return "connection closed without a response"
    if isinstance(exc, (ConnectionResetError, ConnectionAbortedError, BrokenPipeError)):
        return "connection reset"
    if isinstance(exc, http.client.IncompleteRead):
        return "connection closed mid-transfer"
    if isinstance(exc, http.client.BadStatusLine):
        return "not an HTTP response"
    if isinstance(exc, http.client.HTTPException):
        return f"bad HTTP response ({_printable(str(exc)) or type(exc).__name__})"
    if isinstance(exc, ssl.SSLError):
        return f"TLS error ({_printable(exc.reason or '') or type(exc).__name__})"
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    return type(exc).__name__


def _printable(text: str) -> str:
    return "".join(c for c in str(text)[:60] if c.isprintable())


def _hint(status: int, method: str, kind: str) -> str:
    if status in (401, 403):
        return (" (set IPUBUILD_REMOTE_CACHE_UPLOAD=0 for a read-only cache)" if method == "PUT" and status == 403
                else " (check the credentials: the URL's user:password, IPUBUILD_REMOTE_CACHE_HEADER or ~/.netrc)")
    if status == 400 and method == "PUT" and kind == "ac":
        return " (bazel-remote: start it with --disable_http_ac_validation)"
    if status == 413:
        return " (nginx: raise client_max_body_size)"
    return ""
