"""A real S3-compatible server for the tests: moto's standalone server, behind a small proxy that injects faults
(the server unreachable, 503 answers) without losing the server's buckets.

The server is the one ``.ci/run`` starts when ``SHARDGEN_TEST_S3_ENDPOINT`` (``http://127.0.0.1:PORT``) is set; else
the ``s3`` fixture starts its own in a subprocess on a free port (so ``python -m pytest`` alone works on a dev box).
Every test, the fault-injection ones included, reaches it through the fixture's proxy: an outage is the proxy
refusing connections, so no test stops or restarts the shared server and none keeps a private one.

The ``s3`` fixture (session-scoped, used through tests/conftest.py) sets the standard AWS variables (endpoint,
dummy credentials) in this process's environment, so in-process runs and child processes reach it alike; it skips,
saying why, where moto's server cannot be started or the given endpoint does not answer.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field

import pytest

ENDPOINT_VAR = "SHARDGEN_TEST_S3_ENDPOINT"  # set by .ci/run: the S3 server it started

def error_response(status: str, code: str) -> bytes:
    """An S3 error answer: ``status`` ("503 Slow Down") with the error ``code`` ("SlowDown") in its XML."""
    body = f"<Error><Code>{code}</Code><Message>{code} (injected by the test proxy)</Message></Error>".encode()
    return (f"HTTP/1.1 {status}\r\nContent-Type: application/xml\r\nContent-Length: {len(body)}\r\n"
            "Connection: close\r\n\r\n").encode() + body


SLOW_DOWN = error_response("503 Slow Down", "SlowDown")
ACCESS_DENIED = error_response("403 Forbidden", "AccessDenied")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class FaultProxy:
    """TCP proxy to ``target`` (a port of ``host``): ``down()`` drops every connection and refuses new ones until ``up()``;
    ``fail_next(n)``: the next ``n`` connections are answered 503 SlowDown (or ``answer``), counted from 0 in
    ``served_errors``; ``ignore_conditions()``: requests reach the server without their If-None-Match and If-Match
    headers, as from a store that ignores them, until ``ignore_conditions(False)``."""

    target: int
    host: str = "127.0.0.1"
    port: int = field(default_factory=free_port)
    is_down: bool = False
    errors_left: int = 0
    served_errors: int = 0
    refused: int = 0
    answer: bytes = SLOW_DOWN
    drop_conditions: bool = False
    _conns: list = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def start(self) -> None:
        self._sock = socket.create_server(("127.0.0.1", self.port))
        threading.Thread(target=self._accept, daemon=True).start()

    def down(self) -> None:
        self.is_down = True
        self._drop_all()

    def up(self) -> None:
        self.is_down = False

    def fail_next(self, n: int, answer: bytes = SLOW_DOWN) -> None:
        self.errors_left, self.answer, self.served_errors = n, answer, 0
        self._drop_all()  # pooled connections would bypass the faults

    def ignore_conditions(self, on: bool = True) -> None:
        self.drop_conditions = on
        self._drop_all()  # pooled connections keep the way they were made with

    def _drop_all(self) -> None:
        with self._lock:
            for c in self._conns:
                _close(c)
            self._conns.clear()

    def _accept(self) -> None:
        while True:
            client, _ = self._sock.accept()
            if self.is_down:
                self.refused += 1
                _close(client)
                continue
            if self.errors_left > 0:
                self.errors_left -= 1
                self.served_errors += 1
                threading.Thread(target=self._answer, args=(client, self.answer), daemon=True).start()
                continue
            try:
                upstream = socket.create_connection((self.host, self.target))
            except OSError:
                _close(client)
                continue
            with self._lock:
                self._conns += [client, upstream]
            edit = _without_conditions if self.drop_conditions else None
            for a, b, e in ((client, upstream, edit), (upstream, client, None)):
                threading.Thread(target=_pipe, args=(a, b, e), daemon=True).start()

    @staticmethod
    def _answer(client: socket.socket, answer: bytes) -> None:
        try:
            client.settimeout(2)
            head = client.recv(65536)
            client.sendall(answer.split(b"\r\n\r\n")[0] + b"\r\n\r\n" if head.startswith(b"HEAD") else answer)
        except OSError:
            pass
        _close(client)


# a request's header lines come in one read on loopback (the client writes them in one piece)
_CONDITION_HEADER = re.compile(rb"(?im)^if-(?:none-)?match:[^\r\n]*\r\n")


def _without_conditions(data: bytes) -> bytes:
    return _CONDITION_HEADER.sub(b"", data)


def _pipe(src: socket.socket, dst: socket.socket, edit=None) -> None:
    try:
        while data := src.recv(65536):
            dst.sendall(edit(data) if edit else data)
    except OSError:
        pass
    _close(src)
    _close(dst)


def _close(s: socket.socket) -> None:
    try:
        s.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    s.close()


@dataclass
class S3Server:
    """The running server: ``endpoint`` (through the fault proxy), ``proxy``, ``bucket()`` a fresh bucket."""

    endpoint: str
    proxy: FaultProxy
    process: subprocess.Popen | None  # None: the server .ci/run started (it stops it)

    def fs(self):
        import s3fs

        return s3fs.S3FileSystem(skip_instance_cache=True)

    def bucket(self) -> str:
        name = f"b{uuid.uuid4().hex[:12]}"
        self.fs().mkdir(name)
        return name


# a secret no file of a run may contain (tests/test_remote.py looks for it)
SECRET = "shardgen-test-secret-9Qx7Zt"
AWS_ENV = {"AWS_ACCESS_KEY_ID": "shardgen-test-key", "AWS_SECRET_ACCESS_KEY": SECRET, "AWS_DEFAULT_REGION": "us-east-1"}


def start_server() -> S3Server:
    """The server of SHARDGEN_TEST_S3_ENDPOINT, or moto's started here on a free port, behind a new proxy;
    pytest.skip saying why when there is none."""
    for mod in ("s3fs",) + (() if os.environ.get(ENDPOINT_VAR) else ("moto", "flask")):
        try:
            __import__(mod)
        except ImportError:
            pytest.skip(f"{mod} is not installed (pip install -e '.[test]' installs s3fs and moto[server])")
    given = os.environ.get(ENDPOINT_VAR)
    if given:
        (host, port), proc = given_server(given), None
    else:
        host, port = "127.0.0.1", free_port()
        exe = shutil.which("moto_server")
        cmd = [exe, "-p", str(port)] if exe else [sys.executable, "-m", "moto.server", "-p", str(port)]
        # its log (a line per request) to a file: a pipe nobody reads fills up and stops the server mid-run
        log = tempfile.TemporaryFile()
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log, env={**os.environ, **AWS_ENV})
        wait_for(host, port, proc, log)
    proxy = FaultProxy(target=port, host=host)
    proxy.start()
    return S3Server(endpoint=f"http://127.0.0.1:{proxy.port}", proxy=proxy, process=proc)


def given_server(endpoint: str) -> tuple[str, int]:
    """(host, port) of the server at ``endpoint``, checked to answer; pytest.skip saying why when it does not."""
    from urllib.parse import urlsplit

    url = urlsplit(endpoint)
    if url.scheme != "http" or not url.hostname or not url.port:
        pytest.skip(f"{ENDPOINT_VAR}={endpoint}: expected http://HOST:PORT")
    try:
        socket.create_connection((url.hostname, url.port), timeout=5).close()
    except OSError as e:
        pytest.skip(f"{ENDPOINT_VAR}={endpoint} does not answer ({e})")
    return url.hostname, url.port


def wait_for(host: str, port: int, proc: subprocess.Popen, log) -> None:
    """Until the server started as ``proc`` accepts connections; pytest.skip saying why when it exits or stays
    silent for 30 s."""
    deadline = time.time() + 30
    while time.time() < deadline:
        if proc.poll() is not None:
            log.seek(0)
            pytest.skip(f"moto's S3 server exited at start: {log.read().decode()[-300:]}")
        try:
            socket.create_connection((host, port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.1)
    proc.kill()
    pytest.skip("moto's S3 server did not answer within 30 s")


@pytest.fixture(scope="session")
def s3():
    """The session's S3 server, its endpoint and dummy credentials in the environment (restored afterwards)."""
    server = start_server()
    # the S3 client's own retries kept short: shardgen's retries (shardgen/dataio/rundir/remote.py) are what is tested
    env = {**AWS_ENV, "AWS_ENDPOINT_URL": server.endpoint, "AWS_RETRY_MODE": "standard", "AWS_MAX_ATTEMPTS": "2"}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    yield server
    for k, v in old.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    if server.process is not None:
        server.process.kill()
        server.process.wait()


@pytest.fixture
def bucket(s3) -> str:
    """A fresh, empty bucket; the proxy passes everything through again when the test ends."""
    name = s3.bucket()
    yield name
    s3.proxy.up()
    s3.proxy.errors_left = 0
    if s3.proxy.drop_conditions:
        s3.proxy.ignore_conditions(False)
