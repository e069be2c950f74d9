"""The remote cache tier against a real server: nginx with WebDAV on loopback, started per test
module with its own config, pid file, logs and temp folder (skipped only when nginx is not
installed; `.ci/run` installs it).

Unit tests drive ``ipubuild.remote`` (the tier) and ``ipubuild.remote.http`` (the client)
in-process: round trips, misses, verification, timeouts, garbage, resets, the circuit breaker,
the bounded upload queue, forked workers, credentials and their redaction, a third-party backend
plugin. Whole builds of the small target of tests/buildtree.py run through doit: two trees
sharing one remote, a read-only client, a corrupted remote, the server stopped mid-build, a
password-protected location with and without credentials.
"""
from __future__ import annotations

import base64
import concurrent.futures
import hashlib
import io
import multiprocessing
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from buildtree import assert_passed, doit, env, make_tree, package, start

from ipubuild.engine import canonical
from ipubuild import remote
from ipubuild.errors import UserError
from ipubuild.log import log
from ipubuild.remote.http import HttpCache
from ipubuild.engine.store import Store

NAME = "small"
USER, PASSWORD = "builder", "s3cret-Pa55"
NGINX = shutil.which("nginx") or next((p for p in ("/usr/sbin/nginx", "/usr/local/sbin/nginx")
                                       if os.access(p, os.X_OK)), None)
needs_nginx = pytest.mark.skipif(NGINX is None, reason="nginx is not installed (apt-get install nginx; "
                                 ".ci/run installs it): the remote cache is tested against a real server")

CONF = """\
user root; daemon off; worker_processes 1; pid {root}/nginx.pid; error_log {root}/error.log;
events {{ worker_connections 256; }}
http {{
  log_format cache '$request_method $uri $status conn=$connection';
  access_log {root}/access.log cache;
  client_body_temp_path {root}/tmp; proxy_temp_path {root}/tmp; fastcgi_temp_path {root}/tmp;
  uwsgi_temp_path {root}/tmp; scgi_temp_path {root}/tmp;
  client_max_body_size 2g;
  server {{
    listen 127.0.0.1:{port};
    location / {{
      root {root}/data; dav_methods PUT DELETE; create_full_put_path on; dav_access user:rw all:r;
    }}
    location /secure/ {{
      root {root}/data; dav_methods PUT DELETE; create_full_put_path on; dav_access user:rw all:r;
      auth_basic "ipubuild cache"; auth_basic_user_file {root}/htpasswd;
    }}
    location /broken/ {{ return 500; }}
  }}
{tls}}}
"""
TLS = """  server {{
    listen 127.0.0.1:{port} ssl; ssl_certificate {root}/cert.pem; ssl_certificate_key {root}/key.pem;
    location / {{
      root {root}/data; dav_methods PUT DELETE; create_full_put_path on; dav_access user:rw all:r;
    }}
  }}
"""
OPENSSL = shutil.which("openssl")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Nginx:
    """A WebDAV nginx on a free loopback port (and, with openssl, HTTPS on another, with a
    self-signed certificate for 127.0.0.1); everything it writes lives under ``root``."""

    def __init__(self, root: Path):
        self.root = Path(root)
        self.data = self.root / "data"
        for d in (self.data, self.root / "tmp"):
            d.mkdir(parents=True, exist_ok=True)
        (self.root / "htpasswd").write_text(f"{USER}:{{PLAIN}}{PASSWORD}\n")
        self.cert = self.root / "cert.pem"
        if OPENSSL and subprocess.run(
                [OPENSSL, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=127.0.0.1",
                 "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(self.root / "key.pem"),
                 "-out", str(self.cert)], capture_output=True).returncode != 0:
            self.cert.unlink(missing_ok=True)
        self.proc = None
        for _ in range(5):    # the free port may be taken between picking and binding it
            self.port, self.tls_port = _free_port(), _free_port()
            tls = TLS.format(root=self.root, port=self.tls_port) if self.cert.exists() else ""
            (self.root / "nginx.conf").write_text(CONF.format(root=self.root, port=self.port, tls=tls))
            self.proc = subprocess.Popen([NGINX, "-e", str(self.root / "error.log"), "-c",
                                          str(self.root / "nginx.conf"), "-p", str(self.root)],
                                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            if self._wait_listening():
                return
            self.stop()
        raise AssertionError(f"nginx did not start: {(self.root / 'error.log').read_text()[-2000:]}")

    def _wait_listening(self) -> bool:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and self.proc.poll() is None:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                return True
            except OSError:
                time.sleep(0.05)
        return False

    def url(self, prefix: str, userinfo: str = "") -> str:
        return f"http://{userinfo + '@' if userinfo else ''}127.0.0.1:{self.port}/{prefix}"

    def requests(self) -> list[str]:
        """The access log: ``METHOD /uri STATUS conn=N`` per request. nginx logs a request once
        it has sent the response, so the client may be done first: the log is read when it has
        not grown for 0.2 s (at most 3 s)."""
        path = self.root / "access.log"
        lines, deadline = None, time.monotonic() + 3
        while True:
            now = path.read_text().splitlines() if path.exists() else []
            if now == lines or time.monotonic() > deadline:
                return now
            lines = now
            time.sleep(0.2)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    if NGINX is None:
        pytest.skip("nginx is not installed (apt-get install nginx; .ci/run installs it)")
    srv = Nginx(tmp_path_factory.mktemp("nginx"))
    yield srv
    srv.stop()


@pytest.fixture
def logged(monkeypatch):
    """What ipubuild logs during the test."""
    buf = io.StringIO()
    monkeypatch.setattr(log, "stream", buf)
    return buf


@pytest.fixture
def fast(monkeypatch):
    monkeypatch.setenv("IPUBUILD_REMOTE_CACHE_CONNECT_TIMEOUT", "0.5")
    monkeypatch.setenv("IPUBUILD_REMOTE_CACHE_READ_TIMEOUT", "0.5")
    for k in ("IPUBUILD_REMOTE_CACHE_HEADER", "IPUBUILD_REMOTE_CACHE_UPLOAD"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("NETRC", "/nonexistent")


def tier(url: str, **kw) -> remote.RemoteCache:
    return remote.RemoteCache(url, HttpCache, **kw)


def warnings(text: str) -> list[str]:
    return [ln for ln in text.splitlines() if " WARN " in ln]


def _record(value) -> bytes:
    payload = canonical.dumps(value)
    return canonical.digest(payload).encode() + payload


# --- the client, unit by unit ---------------------------------------------------------------------

@needs_nginx
def test_round_trip_miss_and_keep_alive(server, fast):
    client = HttpCache(server.url("unit/rt"))
    blob = os.urandom(3 * 2**20 + 17)
    key = canonical.digest(blob)
    assert client.get("cas", key) is None
    client.put("cas", key, blob)
    client.put("ac", "a" * 64, b"record")
    assert client.get("cas", key) == blob
    assert client.get("ac", "a" * 64) == b"record"
    assert (server.data / "unit" / "rt" / "cas" / key).read_bytes() == blob   # Bazel's layout
    for _ in range(20):
        assert client.get("ac", "b" * 64) is None
    client.close()
    ours = [ln for ln in server.requests() if "/unit/rt/" in ln]
    assert len(ours) == 25
    assert len({ln.rsplit("conn=", 1)[1] for ln in ours}) == 1, ours   # one keep-alive connection


@needs_nginx
def test_https_with_a_trusted_certificate_and_not_without(server, fast, monkeypatch, logged):
    if not server.cert.exists():
        pytest.skip("openssl could not make a test certificate")
    url = f"https://127.0.0.1:{server.tls_port}/unit/tls"
    monkeypatch.setenv("SSL_CERT_FILE", str(server.cert))
    client = HttpCache(url)
    client.put("cas", "3" * 64, b"over TLS")
    assert client.get("cas", "3" * 64) == b"over TLS"
    monkeypatch.delenv("SSL_CERT_FILE")
    t = tier(url)
    assert t.get_blob("3" * 64) is None
    lines = warnings(logged.getvalue())
    assert len(lines) == 1 and "TLS error" in lines[0] and "CERTIFICATE_VERIFY_FAILED" in lines[0], lines


@needs_nginx
def test_a_stale_keep_alive_connection_is_retried(server, fast):
    client = HttpCache(server.url("unit/stale"))
    assert client.get("ac", "c" * 64) is None
    conn = client._local.conn[1]
    conn.sock.shutdown(socket.SHUT_RDWR)     # as if the server had closed the idle connection
    assert client.get("ac", "c" * 64) is None


@needs_nginx
def test_tier_verifies_blobs_and_records_and_never_stores_a_bad_one(server, fast, logged, tmp_path, monkeypatch):
    base = server.url("unit/verify")
    good = b"good bytes" * 1000
    key = canonical.digest(good)
    bad = HttpCache(base)
    bad.put("cas", key, good[:-1] + b"X")                       # lies about its content
    prov = [{"phase": "p", "inputs": {}, "config": {}, "output": "o"}]
    good_entry = remote.action_entry("3" * 64, {"o": key}, {key: prov})
    bad.put("ac", "d" * 64, b"0" * 64 + good_entry[64:])              # checksum does not match
    bad.put("ac", "e" * 64, remote.action_entry("e" * 64, {"o": "not a digest"}, {}))   # shape
    bad.put("ac", "f" * 64, remote.action_entry("f" * 64, {"o": key}, {}))   # no provenance: cannot be rebuilt
    bad.put("ac", "1" * 64, good_entry)                               # another action's entry
    bad.put("ac", "2" * 64, _record({"o": key}))                      # another format: a plain miss
    bad.put("ac", "3" * 64, good_entry)                               # all well
    monkeypatch.setenv("IPUBUILD_REMOTE_CACHE", base)
    monkeypatch.setattr(remote, "MAX_FAILURES", 10)
    store = Store(tmp_path / "cache")
    try:
        assert store.get(key) is None
        assert key not in store.blobs                             # never stored locally
        for k in "def12":
            assert store.get_action(k * 64) is None
            assert store._get_record("ac:" + k * 64) is None
        assert store.get_provenance(key) == []
        assert store.get_action("3" * 64) == {"o": key}
        assert store.get_provenance(key) == prov                  # kept with the record
        stats = store.remote.stats
        assert stats["verify_failures"] == 5 and stats["misses"] == 5 and stats["remote_hits"] == 1
        assert stats["blobs_down"] == 0
    finally:
        store.close()
    lines = warnings(logged.getvalue())
    assert len(lines) == 1 and "failed verification" in lines[0], logged.getvalue()


@needs_nginx
def test_store_reads_through_and_writes_behind(server, fast, tmp_path, monkeypatch):
    monkeypatch.setenv("IPUBUILD_REMOTE_CACHE", server.url("unit/store"))
    one = Store(tmp_path / "one")
    blob = b"an output" * 100
    key = one.put(blob)
    src = one.put(b"a source file", pin=True)
    one.add_provenance(key, {"phase": "p", "inputs": {"x": src}, "config": {}, "output": "o"})
    one.put_action("f" * 64, {"o": key})
    one.put_action("e" * 64, {"o": "4" * 64})                # no provenance: not shared
    assert one.remote.flush(10)
    assert one.remote.stats["uploads"] == 3                  # blob, source, action entry
    one.close()

    two = Store(tmp_path / "two")
    try:
        assert two.get_action("e" * 64) is None
        assert two.get_action("f" * 64) == {"o": key}
        assert two.remote.stats["blobs_down"] == 0            # a record hit downloads no output
        assert two.get_provenance(key)[0]["inputs"] == {"x": src}   # but says how to rebuild it
        assert two.get(src) == b"a source file"               # pinned blobs are shared too
        assert two.get(key) == blob
        assert two.get_action("f" * 64) == {"o": key}        # now a local hit
        s = two.remote.stats
        assert (s["local_hits"], s["remote_hits"], s["misses"], s["blobs_down"]) == (1, 1, 1, 2)
        assert s["up"] == 0                                    # what came down is not sent back
        assert re.fullmatch(r"cache: local_hits=1 remote_hits=1 misses=1 down=\d+B up=0B "
                            r"verify_failures=0 errors=0", two.remote.summary())
    finally:
        two.close()


@needs_nginx
def test_read_only_client_uploads_nothing(server, fast, tmp_path, monkeypatch):
    monkeypatch.setenv("IPUBUILD_REMOTE_CACHE", server.url("unit/ro"))
    monkeypatch.setenv("IPUBUILD_REMOTE_CACHE_UPLOAD", "0")
    store = Store(tmp_path / "c")
    store.put(b"local only")
    store.put_action("1" * 64, {"o": "2" * 64})
    store.close()
    assert not [ln for ln in server.requests() if "/unit/ro/" in ln]


@needs_nginx
def test_http_500_counts_and_the_breaker_stops_asking(server, fast, logged):
    t = tier(server.url("broken/x"))
    for i in range(10):
        assert t.get_blob(f"{i:064x}") is None
    assert len([ln for ln in server.requests() if "/broken/" in ln]) == remote.MAX_FAILURES
    lines = warnings(logged.getvalue())
    assert len(lines) == 1 and "HTTP 500" in lines[0], logged.getvalue()
    assert t.stats["errors"] == remote.MAX_FAILURES


class RawServer:
    """A TCP server on loopback whose every connection is handled by ``handler(conn)``;
    counts connections."""

    def __init__(self, handler):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.port = self.sock.getsockname()[1]
        self.accepted = 0
        self.handler = handler
        self.conns = []
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.accepted += 1
            self.conns.append(conn)
            threading.Thread(target=self.handler, args=(conn,), daemon=True).start()

    def close(self):
        self.sock.close()
        for c in self.conns:
            c.close()


def _silent(conn):
    conn.recv(65536)          # reads the request, never answers


def _garbage(conn):
    try:
        conn.recv(65536)
        conn.sendall(b"garbage, not HTTP\r\n\r\n")
    finally:
        conn.close()


def _cut(conn):
    try:
        conn.recv(65536)
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 100000\r\n\r\n" + b"x" * 1000)
    finally:
        conn.close()


@pytest.mark.parametrize("handler,words,unreachable", [
    (_silent, "timed out", True), (_garbage, "not an HTTP response", False),
    (_cut, "connection closed mid-transfer", False)])
def test_a_bad_server_is_a_miss_with_one_warning(fast, logged, handler, words, unreachable):
    srv = RawServer(handler)
    try:
        t = tier(f"http://127.0.0.1:{srv.port}/x")
        t0 = time.monotonic()
        for i in range(6):
            assert t.get_blob(f"{i:064x}") is None
            assert t.get_action(f"{i:064x}", local_hit=False) is None
        elapsed = time.monotonic() - t0
    finally:
        srv.close()
    lines = warnings(logged.getvalue())
    assert len(lines) == 1 and words in lines[0], logged.getvalue()
    assert "the build goes on with the local cache" in lines[0]
    # the breaker: a remote that timed out is not asked again; others after MAX_FAILURES
    assert t.stats["errors"] == (1 if unreachable else remote.MAX_FAILURES)
    assert elapsed < 3, elapsed
    assert t.stats["misses"] == 6


def test_unreachable_remote_costs_one_quick_warning(fast, logged):
    port = _free_port()           # nothing listens there
    t = tier(f"http://127.0.0.1:{port}/x")
    t0 = time.monotonic()
    for i in range(50):
        t.get_blob(f"{i:064x}")
        t.put_blob(f"{i:064x}", b"data")
    assert t.flush(5)
    assert time.monotonic() - t0 < 2
    lines = warnings(logged.getvalue())
    assert len(lines) == 1 and "connection refused" in lines[0], logged.getvalue()
    assert t.stats["errors"] <= 2     # one read (and at most one upload already under way)


class SlowBackend:
    """A backend whose puts wait for ``release``; records what it was given."""

    def __init__(self, url):
        self.release = threading.Event()
        self.got = []

    def get(self, kind, key):
        return None

    def put(self, kind, key, data):
        self.release.wait(30)
        self.got.append((kind, key))


def test_upload_queue_is_bounded_and_never_blocks_for_long(monkeypatch):
    monkeypatch.setattr(remote, "QUEUE_WAIT", 0.05)
    t = remote.RemoteCache("slow://x", SlowBackend, queue_bytes=10_000)
    t0 = time.monotonic()
    for i in range(40):
        t.put_blob(f"{i:064x}", bytes(1000))
    assert time.monotonic() - t0 < 40 * 0.05 + 1
    assert t._queued_bytes <= 10_000
    assert t.stats["upload_dropped"] >= 25
    assert not t.flush(0.1)          # bounded: gives up while the backend hangs
    t._backend.release.set()
    assert t.flush(10)
    got = t._backend.got
    assert [k for _, k in got] == sorted(k for _, k in got)   # in order
    assert len(got) + t.stats["upload_dropped"] == 40


_FORKED: dict = {}


def _in_worker(i: int) -> dict:
    t = _FORKED["tier"]
    t.get_action(f"{i:064x}", local_hit=False)
    t.put_blob(canonical.digest(b"w%d" % i), b"w%d" % i)
    return t.take()


@needs_nginx
def test_forked_workers_hand_their_counters_and_warnings_to_the_parent(server, fast, logged):
    t = tier(server.url("unit/fork"))
    _FORKED["tier"] = t
    with concurrent.futures.ProcessPoolExecutor(2, mp_context=multiprocessing.get_context("fork")) as pool:
        reports = list(pool.map(_in_worker, range(6)))
    for r in reports:
        t.merge(r)
    assert t.stats["misses"] == 6 and t.stats["uploads"] == 6 and t.stats["up"] == 12
    assert len([ln for ln in server.requests() if "PUT /unit/fork/cas/" in ln]) == 6

    # a worker's failure warns once, in the parent, and trips the parent's breaker
    dead = tier(f"http://127.0.0.1:{_free_port()}/x")
    _FORKED["tier"] = dead
    with concurrent.futures.ProcessPoolExecutor(2, mp_context=multiprocessing.get_context("fork")) as pool:
        reports = list(pool.map(_in_worker, range(4)))
    assert warnings(logged.getvalue()) == []
    for r in reports:
        dead.merge(r)
    lines = warnings(logged.getvalue())
    assert len(lines) == 1 and "connection refused" in lines[0]
    assert dead._off == {"read", "write"}


# --- credentials ---------------------------------------------------------------------------------

@needs_nginx
def test_credentials_from_the_url_the_header_or_netrc(server, fast, monkeypatch, tmp_path):
    key = "9" * 64
    HttpCache(server.url("secure/cred", f"{USER}:{PASSWORD}")).put("ac", key, b"x")
    assert HttpCache(server.url("secure/cred", f"{USER}:{PASSWORD}")).get("ac", key) == b"x"
    token = base64.b64encode(f"{USER}:{PASSWORD}".encode()).decode()
    monkeypatch.setenv("IPUBUILD_REMOTE_CACHE_HEADER", f"Authorization: Basic {token}")
    assert HttpCache(server.url("secure/cred")).get("ac", key) == b"x"
    monkeypatch.delenv("IPUBUILD_REMOTE_CACHE_HEADER")
    netrc = tmp_path / "netrc"
    netrc.write_text(f"machine 127.0.0.1 login {USER} password {PASSWORD}\n")
    netrc.chmod(0o600)
    monkeypatch.setenv("NETRC", str(netrc))
    assert HttpCache(server.url("secure/cred")).get("ac", key) == b"x"
    monkeypatch.setenv("NETRC", "/nonexistent")
    with pytest.raises(remote.RemoteError, match="HTTP 401"):
        HttpCache(server.url("secure/cred")).get("ac", key)


@needs_nginx
def test_credentials_never_appear_in_messages(server, fast, logged, monkeypatch):
    t = tier(server.url("secure/redact", f"{USER}:wrong-{PASSWORD}"))
    assert t.get_blob("0" * 64) is None
    assert t.where == server.url("secure/redact")
    monkeypatch.setenv("IPUBUILD_REMOTE_CACHE_HEADER", "Authorization: Bearer tok-" + PASSWORD)
    t2 = tier(server.url("secure/redact"))
    assert t2.get_blob("0" * 64) is None
    text = logged.getvalue()
    assert len(warnings(text)) == 2 and "HTTP 401" in text and "check the credentials" in text, text
    assert PASSWORD not in text and USER not in text
    # a malformed header is refused without echoing it
    monkeypatch.setenv("IPUBUILD_REMOTE_CACHE_HEADER", f"Authorization Basic {PASSWORD}")
    with pytest.raises(UserError) as err:
        tier(server.url("x"))
    assert PASSWORD not in str(err.value) and "IPUBUILD_REMOTE_CACHE_HEADER" in str(err.value)
    monkeypatch.delenv("IPUBUILD_REMOTE_CACHE_HEADER")
    with pytest.raises(UserError) as err:
        tier(f"http://{USER}:{PASSWORD}@127.0.0.1:notaport/x")
    assert PASSWORD not in str(err.value) and "IPUBUILD_REMOTE_CACHE" in str(err.value)


# --- configuration and the plugin hook -------------------------------------------------------------

@pytest.mark.parametrize("var,value,words", [
    ("IPUBUILD_REMOTE_CACHE", "ftp://host/x", "no cache backend"),
    ("IPUBUILD_REMOTE_CACHE_READ_TIMEOUT", "soon", "expected a number of seconds"),
    ("IPUBUILD_REMOTE_CACHE_UPLOAD", "maybe", "expected 1 or 0")])
def test_bad_settings_are_one_line_errors(tmp_path, code, var, value, words):
    tree = make_tree(tmp_path / "tree")
    environ = env(code, **{"IPUBUILD_REMOTE_CACHE": "http://127.0.0.1:9/x", var: value})
    run = doit(tree, f"build:{NAME}", environ=environ)
    assert run.returncode != 0
    assert len(run.error_lines) == 1 and var in run.error_lines[0] and words in run.error_lines[0], run.tail()
    assert "Traceback" not in run.output


PLUGIN = '''
from ipubuild import hookimpl

ENTRIES = {}


class Memory:
    def __init__(self, url):
        self.url = url

    def get(self, kind, key):
        return ENTRIES.get((kind, key))

    def put(self, kind, key, data):
        ENTRIES[(kind, key)] = bytes(data)


@hookimpl
def ipubuild_cache_backends():
    return {"memtest": Memory}
'''


def test_a_plugin_adds_a_backend(tmp_path, monkeypatch):
    from ipubuild import plugins
    (tmp_path / "memtest_cache.py").write_text(PLUGIN)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("IPUBUILD_PLUGINS", "memtest_cache")
    monkeypatch.setenv("IPUBUILD_REMOTE_CACHE", "memtest://team")
    plugins._manager.cache_clear()
    try:
        assert set(remote.backends()) >= {"http", "https", "memtest"}
        one = Store(tmp_path / "one")
        key = one.put(b"shared")
        one.add_provenance(key, {"phase": "p", "inputs": {}, "config": {}, "output": "o"})
        one.put_action("7" * 64, {"o": key})
        one.close()
        import memtest_cache
        assert ("cas", key) in memtest_cache.ENTRIES
        two = Store(tmp_path / "two")
        assert two.get_action("7" * 64) == {"o": key} and two.get(key) == b"shared"
        two.close()
    finally:
        plugins._manager.cache_clear()


def test_the_hook_keeps_plugin_loading_light_and_the_tier_out_of_fingerprints():
    code = ("import sys, tempfile; from ipubuild.plugins import get_plugin_manager; get_plugin_manager(); "
            "from ipubuild.engine.store import Store; Store(tempfile.mkdtemp()).close(); "
            "print(sorted(m for m in ('ipubuild.remote', 'ipubuild.remote.http', 'http.client') if m in sys.modules))")
    e = {k: v for k, v in os.environ.items() if not k.startswith("IPUBUILD_REMOTE_CACHE")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=e, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
    from ipubuild.engine.fingerprint import closure
    assert not [m for m in closure("ipubuild.engine.engine") if m.startswith("ipubuild.remote")]


# --- whole builds through doit --------------------------------------------------------------------

SUMMARY = re.compile(r"^cache: local_hits=(\d+) remote_hits=(\d+) misses=(\d+) down=(\d+)B up=(\d+)B "
                     r"verify_failures=(\d+) errors=(\d+)$", re.MULTILINE)


def summary(run) -> dict:
    """The last cache line of a run (each build: task prints the process's counts so far)."""
    found = SUMMARY.findall(run.stdout)
    assert found, run.tail()
    return dict(zip(("local_hits", "remote_hits", "misses", "down", "up", "verify_failures", "errors"),
                    map(int, found[-1])))


def phase_lines(run) -> list[str]:
    return [ln for ln in run.stderr.splitlines() if "package build phase finished" in ln]


def remote_warnings(run) -> list[str]:
    return [ln for ln in warnings(run.stderr) if "remote cache" in ln]


@pytest.fixture(scope="module")
def filled(server, code, tmp_path_factory):
    """A remote filled by one clean build of the small target: (prefix, the tree, its run)."""
    tree = make_tree(tmp_path_factory.mktemp("filler"))
    run = doit(tree, f"build:{NAME}", environ=env(code, IPUBUILD_REMOTE_CACHE=server.url("filled")))
    assert_passed(run, NAME)
    return "filled", tree, run


def copy_remote(server, prefix: str, to: str) -> str:
    shutil.copytree(server.data / prefix, server.data / to)
    return to


@needs_nginx
def test_a_clean_build_fills_the_remote_and_counts_its_workers(server, filled):
    prefix, tree, run = filled
    s = summary(run)
    assert s["misses"] > 0 and s["remote_hits"] == 0 and s["up"] > 0 and s["errors"] == 0
    lookups = [ln for ln in server.requests() if ln.startswith(f"GET /{prefix}/ac/")]
    # every miss asked the remote once, the search's forked workers' misses included
    assert len(lookups) == s["misses"], (len(lookups), s)
    assert any("local_candidate" in ln for ln in phase_lines(run))     # the workers did run phases
    assert remote_warnings(run) == []


@needs_nginx
def test_a_second_tree_runs_no_phase_and_downloads_only_what_it_reads(server, filled, code, tmp_path):
    prefix, first, _ = filled
    before = len(server.requests())
    tree = make_tree(tmp_path / "second")
    run = doit(tree, f"build:{NAME}", environ=env(code, IPUBUILD_REMOTE_CACHE=server.url(prefix)))
    assert_passed(run, NAME)
    lines = phase_lines(run)
    assert lines and all("cached=true" in ln for ln in lines), run.tail()
    s = summary(run)
    assert s["misses"] == 0 and s["local_hits"] == 0 and s["remote_hits"] == len(lines)
    assert package(tree, NAME) == package(first, NAME)
    ours = server.requests()[before:]
    blobs_down = [ln for ln in ours if ln.startswith(f"GET /{prefix}/cas/") and " 200 " in ln]
    uploaded = len(list((server.data / prefix / "cas").iterdir()))
    assert 0 < len(blobs_down) < uploaded / 10, (len(blobs_down), uploaded)   # lazily
    # explain names the remote hits, and does not call them runs with no record
    told = doit(tree, f"explain:{NAME}", environ=env(code, IPUBUILD_REMOTE_CACHE=server.url(prefix)))
    assert re.search(r"tasks ran \(\d+ of them from the cache, \d+ remote: nothing computed\)", told.stdout), told.tail()
    assert "its result came from the remote cache" in told.stdout and "no earlier run" not in told.stdout, told.tail()


@needs_nginx
def test_a_read_only_client_hits_and_uploads_nothing(server, filled, code, tmp_path):
    prefix, first, _ = filled
    tree = make_tree(tmp_path / "ro")
    (tree / "targets" / "other.toml").write_text((tree / "targets" / f"{NAME}.toml").read_text()
                                                 .replace("rounds = 3", "rounds = 2"))
    before = len(server.requests())
    run = doit(tree, f"build:{NAME}", "build:other",
               environ=env(code, IPUBUILD_REMOTE_CACHE=server.url(prefix), IPUBUILD_REMOTE_CACHE_UPLOAD="0"))
    assert run.returncode == 0, run.tail()
    assert package(tree, NAME) == package(first, NAME)
    s = summary(run)
    assert s["up"] == 0 and s["remote_hits"] > 0 and s["misses"] > 0     # `other` ran its own phases
    assert not [ln for ln in server.requests()[before:] if ln.startswith("PUT ")]


@needs_nginx
def test_a_corrupted_remote_is_a_warning_and_heals(server, filled, code, tmp_path):
    prefix, first, _ = filled
    lied = copy_remote(server, prefix, "lied")
    digest = (first / ".ipubuild" / "refs" / NAME / "package.ref").read_text().strip()
    blob = server.data / lied / "cas" / digest
    data = bytearray(blob.read_bytes())
    data[len(data) // 2] ^= 1
    blob.write_bytes(bytes(data))
    tree = make_tree(tmp_path / "fresh")
    run = doit(tree, f"build:{NAME}", environ=env(code, IPUBUILD_REMOTE_CACHE=server.url(lied)))
    assert_passed(run, NAME)
    assert package(tree, NAME) == package(first, NAME)
    lines = remote_warnings(run)
    assert len(lines) == 1 and f"blob {digest[:16]} failed verification" in lines[0], run.tail()
    assert summary(run)["verify_failures"] == 1
    # rebuilt from the provenance the remote holds, and the good bytes went back up
    assert "rebuilding missing cache blob" in run.stderr
    assert hashlib.sha256(blob.read_bytes()).hexdigest() == digest


@needs_nginx
def test_the_server_stopped_mid_build_costs_one_warning(code, filled, tmp_path):
    _, first, _ = filled
    srv = Nginx(tmp_path / "nginx")
    try:
        tree = make_tree(tmp_path / "tree")
        log_path = tmp_path / "build.log"
        p = start(tree, f"build:{NAME}", log=log_path, environ=env(code, IPUBUILD_REMOTE_CACHE=srv.url("mid")))
        deadline = time.monotonic() + 120
        while sum(ln.startswith("PUT ") for ln in srv.requests()) < 20 and p.poll() is None \
                and time.monotonic() < deadline:
            time.sleep(0.05)
        srv.stop()
        assert p.poll() is None, "the build ended before the server was stopped"
        rc = p.wait(timeout=300)
    finally:
        srv.stop()
    out = log_path.read_text()
    assert rc == 0 and "numericalTest=PASS" in out and "Traceback" not in out, out[-3000:]
    lines = [ln for ln in out.splitlines() if " WARN " in ln and "remote cache" in ln]
    assert len(lines) == 1, lines
    assert package(tree, NAME) == package(first, NAME)


@needs_nginx
def test_a_protected_remote_with_and_without_credentials(server, filled, code, tmp_path):
    prefix, first, _ = filled
    copy_remote(server, prefix, "secure/team")
    token = base64.b64encode(f"{USER}:{PASSWORD}".encode()).decode()
    good = make_tree(tmp_path / "good")
    run = doit(good, f"build:{NAME}", environ=env(code, IPUBUILD_REMOTE_CACHE=server.url("secure/team"),
                                                  IPUBUILD_REMOTE_CACHE_HEADER=f"Authorization: Basic {token}"))
    assert_passed(run, NAME)
    assert summary(run)["misses"] == 0 and remote_warnings(run) == []
    secrets = [PASSWORD.encode(), token.encode()]
    assert not [s for s in secrets if s in run.output.encode()]
    for path in good.rglob("*"):      # the cache, the trace, the artifacts, doit's DB
        if path.is_file():
            body = path.read_bytes()
            assert not [s for s in secrets if s in body], path

    bad = make_tree(tmp_path / "bad")
    run = doit(bad, f"build:{NAME}", environ=env(code, IPUBUILD_REMOTE_CACHE=server.url("secure/team")))
    assert_passed(run, NAME)
    assert package(bad, NAME) == package(first, NAME)
    lines = remote_warnings(run)
    assert len(lines) == 1 and "HTTP 401" in lines[0] and "check the credentials" in lines[0], run.tail()
    assert summary(run)["remote_hits"] == 0 and summary(run)["up"] == 0


def test_a_remote_that_fails_in_several_ways_costs_one_warning_line(logged):
    """A transport error, then a blob that does not verify (after which reads are off): one
    warning line for this remote in this build, the rest in the log."""
    class Flaky:
        calls = 0

        def __init__(self, url):
            pass

        def get(self, kind, key):
            Flaky.calls += 1
            if Flaky.calls == 1:
                raise remote.RemoteError("connection reset")
            return b"not the bytes" if Flaky.calls == 2 else 12

        def put(self, kind, key, data):
            raise remote.RemoteError("HTTP 500")

        def close(self):
            pass
    t = remote.RemoteCache("flaky://cache", Flaky, upload=False)
    for d in ("1" * 64, "2" * 64, "3" * 64):
        assert t.get_blob(d) is None
    text = logged.getvalue()
    assert len(warnings(text)) == 1 and "connection reset" in warnings(text)[0], text
    assert "failed verification" in text      # in the log, not as a second warning line
