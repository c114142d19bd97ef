"""Request heads are bounded as their bytes arrive (finding 9 of issue #25).

httptools and uvicorn join a head's URL and header values chunk by chunk, so one client
sending megabytes of headers stalled every client and grew the server by hundreds of MiB,
before any authentication, on the HTTP and the metrics port. Now a head over
``--http-max-header-size`` bytes or ``--http-max-headers`` fields gets 431 and its
connection is closed, while other clients are answered."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator

import pytest
import requests

from kiln.examples import build_example_repository
from tests.conftest import KilnProcess
from tests.security.http_wire import body_for, connect, post, send_until_answered

KEY = "head-key"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KilnProcess]:
    repo = tmp_path_factory.mktemp("heads") / "models"
    build_example_repository(repo, ["simple"])
    proc = KilnProcess(repo, ["--api-key", KEY, "--no-history", "--no-allow-grpc"]).start()
    yield proc
    proc.stop()


def _headers(count: int, size: int) -> bytes:
    return b"".join(b"X-H%d: %s\r\n" % (i, b"a" * size) for i in range(count))


def _refused(port: int, head: bytes) -> tuple[int, dict[str, str], bytes, bool]:
    """Send ``head`` (never finished by a blank line) and read the answer."""
    sock, reader = connect(port)
    with sock:
        send_until_answered(sock, head)
        status, headers, body = reader.response()
        return status, headers, body, reader.closed()


def test_a_megabyte_of_headers_gets_431_while_others_are_answered(server: KilnProcess) -> None:
    answers: list[int] = []

    def other_client() -> None:
        while not done.is_set():
            reply = requests.get(
                f"http://{server.http_url}/v2/models/simple",
                headers={"x-api-key": KEY},
                timeout=20,
            )
            answers.append(reply.status_code)

    done = threading.Event()
    worker = threading.Thread(target=other_client)
    worker.start()
    try:
        head = b"GET /v2 HTTP/1.1\r\nHost: localhost\r\n" + _headers(1024, 1024)  # 1 MiB
        status, headers, body, closed = _refused(server.http_port, head)
    finally:
        done.set()
        worker.join(30)
    assert status == 431
    assert "--http-max-header-size" in json.loads(body)["error"]
    assert headers["connection"] == "close" and closed
    assert answers and set(answers) == {200}


def test_one_huge_header_value_gets_431(server: KilnProcess) -> None:
    head = b"GET /v2 HTTP/1.1\r\nHost: localhost\r\nX-Big: " + b"a" * (1 << 20)
    status, _, body, closed = _refused(server.http_port, head)
    assert status == 431 and closed
    assert "exceeds 65536 bytes" in json.loads(body)["error"]


def test_a_huge_url_gets_431(server: KilnProcess) -> None:
    head = b"GET /v2/" + b"a" * (1 << 20)
    status, _, _, closed = _refused(server.http_port, head)
    assert status == 431 and closed


def test_a_thousand_small_headers_get_431(server: KilnProcess) -> None:
    head = b"GET /v2 HTTP/1.1\r\nHost: localhost\r\n" + _headers(1000, 1) + b"\r\n"
    status, headers, body, closed = _refused(server.http_port, head)
    assert status == 431 and headers["connection"] == "close" and closed
    assert "more than 100 header fields (--http-max-headers)" in json.loads(body)["error"]


def test_unauthenticated_inference_with_huge_headers_gets_431(server: KilnProcess) -> None:
    head = post("/v2/models/simple/infer", b"", _headers(1024, 1024).decode(), length=100)
    status, _, _, closed = _refused(server.http_port, head)
    assert status == 431 and closed


def test_the_metrics_port_is_bounded_too(server: KilnProcess) -> None:
    for head in (
        b"GET /metrics HTTP/1.1\r\nHost: localhost\r\n" + _headers(1024, 1024),
        b"GET /metrics HTTP/1.1\r\nHost: localhost\r\n" + _headers(1000, 1) + b"\r\n",
    ):
        status, _, _, closed = _refused(server.metrics_port, head)
        assert status == 431 and closed
    assert requests.get(server.metrics_url, timeout=10).status_code == 200


def test_heads_within_the_limits_are_served(server: KilnProcess) -> None:
    """Near both limits, and keep-alive with pipelined bodies: the counts restart per request."""
    extra = (_headers(90, 600) + f"x-api-key: {KEY}\r\n".encode()).decode()  # ~56 KiB, 91
    sock, reader = connect(server.http_port)
    with sock:
        one = post("/v2/models/simple/infer", body_for(1, 2), extra)
        sock.sendall(one * 3)  # three heads of ~56 KiB with their bodies in one go
        for _ in range(3):
            status, _, body = reader.response()
            assert status == 200, body
            assert json.loads(body)["outputs"][0]["data"] == [3] * 16
