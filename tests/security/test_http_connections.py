"""Connections do not outlive early answers (findings 12 and 13 of issue #25).

Before, the fast inference path buffered a whole body (up to 64 MiB) before asking for
the API key, and a connection that got an answer before its body was read (401, 403, 404,
413...) stayed open for as long as the client trickled body bytes: three such clients
held every ``--http-limit-concurrency`` slot. Now the key is checked when the head is
complete, and an answer given before the body was read says ``Connection: close`` and
closes the connection."""

from __future__ import annotations

import contextlib
import json
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from kiln.examples import build_example_repository
from tests.conftest import KilnProcess
from tests.security.http_wire import Reader, body_for, connect, post

KEY = "conn-key"
TENANT = "tenant: blue\r\n"  # --http-restricted-api inference:tenant=blue
KEYED = f"x-api-key: {KEY}\r\n{TENANT}"
INFER = "/v2/models/simple/infer"
TEN_MB = 10 * 1000 * 1000


def _start(repo: Path, *extra: str) -> KilnProcess:
    args = ["--api-key", KEY, "--http-restricted-api", "inference:tenant=blue"]
    return KilnProcess(repo, [*args, "--no-history", "--no-allow-grpc", *extra]).start()


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("conns") / "models"
    build_example_repository(root, ["simple"])
    return root


@pytest.fixture(scope="module")
def server(repo: Path) -> Iterator[KilnProcess]:
    proc = _start(repo)
    yield proc
    proc.stop()


def _early_answer(port: int, head: bytes) -> tuple[socket.socket, Reader, int, dict[str, str]]:
    """Send only ``head`` (and a few body bytes) of a request whose body is far longer."""
    sock, reader = connect(port)
    sock.settimeout(10)  # an answer that waits for the body never comes
    sock.sendall(head + b"{")
    status, headers, _ = reader.response()
    return sock, reader, status, headers


@pytest.mark.parametrize(
    ("extra", "status"),
    [("", 401), (f"x-api-key: {KEY}\r\n", 403), ("x-api-key: wrong\r\n", 401)],
)
def test_fast_inference_is_refused_before_its_body(
    server: KilnProcess, extra: str, status: int
) -> None:
    head = post(INFER, b"", extra, length=TEN_MB)
    sock, reader, got, headers = _early_answer(server.http_port, head)
    with sock:
        assert got == status
        assert headers["connection"] == "close"
        assert reader.closed()


@pytest.mark.parametrize(
    ("head", "status"),
    [
        # an unknown route, with the key: Starlette's 404 never reads the body
        (post("/nope", b"", KEYED, length=TEN_MB), 404),
        # the access middleware refuses before the app reads anything
        (post("/v2/repository/index", b"", "", length=TEN_MB), 401),
        # declared over --http-max-input-size (64 MiB): refused unread
        (post(INFER, b"", KEYED, length=100 * TEN_MB), 413),
        # chunked, so it takes the ASGI path to the access middleware
        (
            b"POST " + INFER.encode() + b" HTTP/1.1\r\nHost: localhost\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n1000\r\n",
            401,
        ),
    ],
)
def test_an_answer_before_the_body_closes_the_connection(
    server: KilnProcess, head: bytes, status: int
) -> None:
    sock, reader, got, headers = _early_answer(server.http_port, head)
    with sock:
        assert got == status
        assert headers["connection"] == "close"
        sock.sendall(b"x" * 1000)  # more body: it no longer keeps the connection alive
        assert reader.closed()


def test_keep_alive_still_serves_requests_whose_body_was_read(server: KilnProcess) -> None:
    sock, reader = connect(server.http_port)
    with sock:
        for status in (200, 400, 200):  # a bad body that was read keeps the connection too
            body = body_for(1, 1) if status == 200 else b'{"inputs": ['
            sock.sendall(post(INFER, body, KEYED))
            got, headers, _ = reader.response()
            assert got == status and "connection" not in headers


def test_early_answers_do_not_hold_concurrency_slots(repo: Path) -> None:
    proc = _start(repo, "--http-limit-concurrency", "3")
    attackers = []
    try:
        for head in (  # three early answers from the ASGI app, before the body
            post("/nope", b"", KEYED, length=TEN_MB),
            post("/v2/repository/index", b"", "", length=TEN_MB),
            post(INFER, b"", KEYED, length=100 * TEN_MB),
        ):
            sock, reader, status, _ = _early_answer(proc.http_port, head)
            attackers.append((sock, reader))
            assert status in (401, 404, 413)
        for sock, reader in attackers:
            with contextlib.suppress(OSError):
                sock.sendall(b"x")  # the attack trickles its body on
            assert reader.closed()
        sock, reader = connect(proc.http_port)
        with sock:
            sock.sendall(post(INFER, body_for(2, 3), KEYED))
            status, _, body = reader.response()
        assert status == 200, body
        assert json.loads(body)["outputs"][0]["data"] == [5] * 16
    finally:
        for sock, _ in attackers:
            sock.close()
        proc.stop()
