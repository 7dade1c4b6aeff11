"""Connections over real loopback sockets: keep-alive and Connection: close really close,
a cap on open connections answers 503 instead of using up file handles, and a 413
leaves a pooled client able to send its next request."""

from __future__ import annotations

import select
import socket
import subprocess
import sys
import time

import httpx
import pytest
from tests.serving import ServerThread, config_for

from mlxd.http.connections import default_max_connections

CAP = 8
BOUND_S = 30.0  # generous: a closed socket shows up at once; this only bounds a failure


@pytest.fixture(scope="module")
def short_keep_alive(tiny_model_dir):
    with ServerThread(
        config_for(tiny_model_dir, keep_alive_timeout_s=1.0, max_body_bytes=64 * 1024)
    ) as server:
        yield server


@pytest.fixture(scope="module")
def capped(tiny_model_dir):
    with ServerThread(
        config_for(tiny_model_dir, max_connections=CAP, keep_alive_timeout_s=60.0)
    ) as server:
        yield server


def _address(server: ServerThread) -> tuple[str, int]:
    host_port = server.base_url.removeprefix("http://").removesuffix("/v1")
    host, port = host_port.rsplit(":", 1)
    return host, int(port)


def _root(server: ServerThread) -> str:
    return server.base_url.removesuffix("/v1")


def _read_until_closed(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection (fails if it stays open)."""
    sock.settimeout(BOUND_S)
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def test_a_connection_that_never_sends_is_closed(short_keep_alive):
    with socket.create_connection(_address(short_keep_alive)) as sock:
        assert _read_until_closed(sock) == b""


def test_an_idle_keep_alive_connection_is_closed_after_its_request(short_keep_alive):
    with socket.create_connection(_address(short_keep_alive)) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        reply = _read_until_closed(sock)
    assert reply.startswith(b"HTTP/1.1 200") and b'"status": "ok"' in reply


def test_connection_close_is_honoured(short_keep_alive):
    with socket.create_connection(_address(short_keep_alive)) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        reply = _read_until_closed(sock)
    assert reply.startswith(b"HTTP/1.1 200") and reply.count(b"HTTP/1.1") == 1


def test_a_413_closes_the_connection_and_the_pooled_client_goes_on(short_keep_alive):
    url = _root(short_keep_alive)
    with httpx.Client(timeout=BOUND_S) as client:
        assert client.get(url + "/health").status_code == 200  # a pooled connection exists
        big = client.post(
            url + "/v1/completions",
            content=b'{"prompt": "' + b"a" * (1 << 20) + b'"}',
            headers={"Content-Type": "application/json"},
        )
        assert big.status_code == 413
        assert big.headers["connection"] == "close"
        assert big.json()["error"]["type"] == "invalid_request_error"
        for _ in range(3):  # the same pool: a new connection, answered
            assert client.get(url + "/health").status_code == 200
        small = client.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert small.status_code == 200


def test_a_413_on_a_raw_socket_is_answered_then_closed(short_keep_alive):
    with socket.create_connection(_address(short_keep_alive)) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 1000000\r\n\r\n" + b"a" * 1000
        )
        reply = _read_until_closed(sock)
    assert reply.startswith(b"HTTP/1.1 413") and b"exceeds" in reply


def _closed_by_server(socks: list[socket.socket], *, want: int) -> list[socket.socket]:
    """The sockets the server closed (read to EOF), waiting up to BOUND_S for `want` of them."""
    closed: list[socket.socket] = []
    deadline = time.monotonic() + BOUND_S
    while len(closed) < want and time.monotonic() < deadline:
        readable, _, _ = select.select([s for s in socks if s not in closed], [], [], 0.5)
        for s in readable:
            try:
                if not s.recv(65536):
                    closed.append(s)
            except OSError:
                closed.append(s)
    return closed


def _until(fn, what: str):
    deadline = time.monotonic() + BOUND_S
    while time.monotonic() < deadline:
        result = fn()
        if result is not None:
            return result
        time.sleep(0.05)
    raise AssertionError(f"never saw {what}")


def test_past_the_cap_a_new_connection_gets_a_503_not_silence(capped):
    url = _root(capped)
    idle = [socket.create_connection(_address(capped)) for _ in range(5 * CAP)]
    try:

        def refused():
            r = httpx.get(url + "/health", timeout=BOUND_S)  # a new connection each call
            return r if r.status_code == 503 else None

        reply = _until(refused, "a 503 past the cap")
        assert reply.headers["connection"] == "close"
        assert reply.headers["retry-after"] == "1"
        assert reply.json()["error"]["type"] == "server_overloaded"
        # The sockets past the cap were closed by the server (they hold no file handle there).
        assert len(_closed_by_server(idle, want=len(idle) - CAP)) >= len(idle) - CAP - 1
    finally:
        for s in idle:
            s.close()
    # The idle ones went away: requests are served again.
    assert _until(
        lambda: httpx.get(url + "/health", timeout=BOUND_S).status_code == 200 or None, "a 200"
    )
    stats = httpx.get(url + "/stats", timeout=BOUND_S).json()
    assert stats["http_connections_max"] == CAP
    assert stats["http_connections_refused"] >= 4 * CAP - 1
    assert stats["http_connections_open"] <= CAP


def test_the_default_cap_stays_well_below_the_file_handle_limit():
    assert default_max_connections(2048) == 1024
    assert default_max_connections(1024) == 512
    assert default_max_connections(1 << 20) == 4096
    assert default_max_connections(64) == 32 and default_max_connections(8) == 16


def test_a_port_in_use_stops_serve_with_exit_2_and_one_line_not_a_traceback(tiny_model_dir):
    """The default port is often taken: `mlxd serve` says which address it could not bind, as for a
    locked SSD directory, instead of three nested exception groups."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        out = subprocess.run(
            [sys.executable, "-m", "mlxd.cli", "serve", "--model", str(tiny_model_dir), "--port", str(port),
             "--device-probe", "off", "--log-format", "json"],
            capture_output=True, text=True, timeout=300)
    assert out.returncode == 2, out.stderr[-3000:]
    assert f"mlxd serve: cannot listen on 127.0.0.1:{port}: Address already in use" in out.stderr
    assert "Traceback" not in out.stderr, out.stderr[-3000:]
