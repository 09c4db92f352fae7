"""A real S3 server on loopback for tests and benchmarks: moto's server in a subprocess, and a fault-injecting
HTTP proxy in front of it (503 SlowDown, connections cut mid-body, 403 for chosen keys).

Faults are deterministic: whether a request fails is a function of (seed, method, path, Range header, how
many times that same request was seen), and a request is faulted at most ``max_faults`` times in a row, so a
client that retries more often than that always gets through.
"""

from __future__ import annotations

import hashlib
import http.client
import os
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

__all__ = ["REQUEST_TIMEOUT", "FaultProxy", "MotoServer", "free_port"]

ACCESS_KEY, SECRET_KEY, REGION = "fastio-test", "fastio-test-secret", "us-east-1"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_port(port: int, proc: subprocess.Popen | None = None, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"server on port {port} exited with code {proc.returncode}")
        try:
            socket.create_connection(("127.0.0.1", port), 0.2).close()
            return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"nothing listens on 127.0.0.1:{port} after {timeout_s} s")


class MotoServer:
    """``python -m moto.server`` on 127.0.0.1 in a subprocess; ``endpoint`` is its URL. Stop with :meth:`stop`."""

    def __init__(self):
        self.port = free_port()
        env = dict(os.environ, MOTO_ALLOW_NONEXISTENT_REGION="true")
        self.proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
        try:
            _wait_port(self.port, self.proc)
        except BaseException:
            self.stop()
            raise
        self.endpoint = f"http://127.0.0.1:{self.port}"

    def create_bucket(self, name: str) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=10)
        try:
            conn.request("PUT", f"/{name}")
            resp = conn.getresponse()
            resp.read()
            if resp.status != 200:
                raise RuntimeError(f"create bucket {name}: HTTP {resp.status}")
        finally:
            conn.close()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def options(self, endpoint: str | None = None, **extra) -> dict:
        return {"endpoint": endpoint or self.endpoint, "region": REGION, "access_key_id": ACCESS_KEY,
                "secret_access_key": SECRET_KEY, **extra}


_SLOWDOWN = (b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>SlowDown</Code>'
             b"<Message>Please reduce your request rate.</Message></Error>")
_NO_SUCH_KEY = (b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>NoSuchKey</Code>'
                b"<Message>The specified key does not exist.</Message></Error>")
REQUEST_TIMEOUT = (400, b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>RequestTimeout</Code><Message>Your '
                   b"socket connection to the server was not read from or written to within the timeout period."
                   b"</Message></Error>")
"""What S3 answers a request whose body came too slowly: HTTP 400, yet worth retrying (as the AWS SDKs do)."""
_DENIED = (b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>AccessDenied</Code>'
           b"<Message>Access Denied</Message></Error>")


class FaultProxy:
    """An HTTP proxy on 127.0.0.1 in front of ``upstream_port`` that injects faults.

    Args:
        slowdown: fraction of requests answered ``503 SlowDown`` (or ``throttle``: another ``(status, body)``,
            e.g. :data:`REQUEST_TIMEOUT`).
        cut: fraction of GET requests whose response body is cut off halfway (connection closed).
        max_faults: the same request is faulted at most this many times in a row.
        seed: seeds the fault choice.
    ``forbidden`` (a set of path substrings) answers 403 AccessDenied, always; ``gone`` answers a GET or HEAD
    404 NoSuchKey (an object listed, then deleted); ``down`` answers 503 SlowDown, always (an outage of those
    keys). ``drop_headers`` (lower-case request header names) are not passed on: dropping ``if-none-match`` and
    ``if-match`` makes a store that ignores conditional writes. ``counts`` tallies what was done; ``requests`` logs
    every request that reached the proxy as ``(method, path with query)``.
    """

    def __init__(self, upstream_port: int, *, slowdown: float = 0.0, cut: float = 0.0, max_faults: int = 2,
                 seed: int = 0):
        self.upstream_port, self.slowdown, self.cut, self.max_faults, self.seed = (
            upstream_port, slowdown, cut, max_faults, seed)
        self.throttle: tuple[int, bytes] = (503, _SLOWDOWN)
        self.forbidden: set[str] = set()
        self.gone: set[str] = set()
        self.down: set[str] = set()
        self.drop_headers: set[str] = set()
        self.counts: Counter = Counter()
        self._seen: Counter = Counter()
        self.requests: list[tuple[str, str]] = []
        self._lock = threading.Lock()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:
                pass

            def _body(self) -> bytes:
                if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                    out = bytearray()
                    while True:
                        n = int(self.rfile.readline().split(b";")[0], 16)
                        if n == 0:
                            self.rfile.readline()
                            return bytes(out)
                        out += self.rfile.read(n)
                        self.rfile.readline()
                return self.rfile.read(int(self.headers.get("Content-Length") or 0))

            def _reply(self, status: int, body: bytes) -> None:
                self.send_response(status)
                self.send_header("Content-Type", "application/xml")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def _handle(self) -> None:
                body = self._body()
                decision = proxy._decide(self.command, self.path, self.headers.get("Range", ""))
                if decision == "forbid":
                    return self._reply(403, _DENIED)
                if decision == "gone":
                    return self._reply(404, _NO_SUCH_KEY)
                if decision == "slowdown":
                    return self._reply(*proxy.throttle)
                dropped = {"transfer-encoding", "content-length", *proxy.drop_headers}
                headers = {k: v for k, v in self.headers.items() if k.lower() not in dropped}
                conn = http.client.HTTPConnection("127.0.0.1", proxy.upstream_port, timeout=60)
                try:
                    conn.request(self.command, self.path, body=body if body or self.command in ("PUT", "POST")
                                 else None, headers=headers)
                    resp = conn.getresponse()
                    data = resp.read()
                finally:
                    conn.close()
                self.send_response(resp.status)
                for k, v in resp.getheaders():
                    if k.lower() not in ("content-length", "transfer-encoding", "connection", "server", "date"):
                        self.send_header(k, v)
                self.send_header("Content-Length", resp.getheader("Content-Length", "0") if self.command == "HEAD"
                                 else str(len(data)))
                self.end_headers()
                if decision == "cut" and len(data) > 1 and self.command == "GET" and resp.status < 300:
                    self.wfile.write(data[: len(data) // 2])
                    self.wfile.flush()
                    self.close_connection = True
                    self.connection.shutdown(socket.SHUT_RDWR)
                    return
                if self.command != "HEAD":
                    self.wfile.write(data)

            def _guarded(self) -> None:
                try:
                    self._handle()
                except (BrokenPipeError, ConnectionResetError):  # the client gave up on this response
                    self.close_connection = True

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _guarded

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.port = self._server.server_address[1]
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self._thread = threading.Thread(target=self._server.serve_forever, name="fault-proxy", daemon=True)
        self._thread.start()

    def _decide(self, method: str, path: str, range_header: str) -> str:
        with self._lock:
            self.requests.append((method, path))
            if any(f in path for f in self.forbidden):
                self.counts["forbid"] += 1
                return "forbid"
            if method in ("GET", "HEAD") and any(f in path for f in self.gone):
                self.counts["gone"] += 1
                return "gone"
            if any(f in path for f in self.down):
                self.counts["slowdown"] += 1
                return "slowdown"
            ident = f"{method} {path} {range_header}"
            seen = self._seen[ident]
            self._seen[ident] += 1
            self.counts["requests"] += 1
            if seen >= self.max_faults:
                return "pass"
            digest = hashlib.sha256(f"{self.seed}:{ident}:{seen}".encode()).digest()
            u = int.from_bytes(digest[:8], "big") / 2 ** 64
            if u < self.slowdown:
                self.counts["slowdown"] += 1
                return "slowdown"
            if method == "GET" and u < self.slowdown + self.cut and "list-type" not in path:
                self.counts["cut"] += 1
                return "cut"
            return "pass"

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(10)


def fails_at_once(call, match: str, within_s: float = 5.0) -> None:
    """``call()`` raises a :class:`fastio.errors.StorageError` matching ``match`` that is not transient, within
    ``within_s`` seconds: a fault no retry can cure, failed at once instead of retried until the deadline."""
    import pytest

    from fastio.errors import StorageError

    started = time.monotonic()
    with pytest.raises(StorageError, match=match) as info:
        call()
    assert time.monotonic() - started < within_s and not info.value.transient
