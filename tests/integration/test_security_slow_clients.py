"""Slow-client protection: headers that never finish close the connection; a body that
trickles in past the read timeout gets 408; the server keeps answering others."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest
import requests

from kiln.examples import build_example_repository
from tests.conftest import KilnProcess


@pytest.fixture(scope="module")
def strict(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KilnProcess]:
    repo = tmp_path_factory.mktemp("slow") / "models"
    build_example_repository(repo, ["simple"])
    server = KilnProcess(
        repo,
        ["--http-header-timeout-secs", "0.5", "--http-read-timeout-secs", "0.5", "--no-history"],
    ).start()
    yield server
    server.stop()


def _connect(server: KilnProcess) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", server.http_port), timeout=20)
    return sock


def test_unfinished_headers_close_the_connection(strict: KilnProcess) -> None:
    with _connect(strict) as sock:
        sock.sendall(b"GET /v2 HTTP/1.1\r\nHost: localhost\r\nX-Slow: ")
        assert sock.recv(1024) == b""  # closed by the server, not by our timeout
    assert requests.get(f"http://{strict.http_url}/v2", timeout=10).status_code == 200


def test_idle_connection_is_closed(strict: KilnProcess) -> None:
    with _connect(strict) as sock:
        assert sock.recv(1024) == b""


def test_slow_body_gets_408(strict: KilnProcess) -> None:
    with _connect(strict) as sock:
        sock.sendall(
            b"POST /v2/models/simple/infer HTTP/1.1\r\nHost: localhost\r\n"
            b'Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{"inputs"'
        )
        reply = b""
        while b"\r\n\r\n" not in reply:
            chunk = sock.recv(4096)
            if not chunk:
                break
            reply += chunk
    assert reply.startswith(b"HTTP/1.1 408"), reply
    assert requests.get(f"http://{strict.http_url}/v2", timeout=10).status_code == 200
