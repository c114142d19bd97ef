"""Compressed request bodies must end exactly where the body does (issue #25, lows).

zlib stops at the end of the first gzip member or deflate stream, so bytes after it (a
second gzip member, trailing data) were silently dropped and a truncated stream was
inflated as far as it went. Now any of these is a 400; a whole stream still works."""

from __future__ import annotations

import gzip
import json
import threading
import time
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import requests

from kiln.examples import build_example_repository
from tests.conftest import KilnProcess
from tests.security.http_wire import body_for, connect, post

INFER = "/v2/models/simple/infer"
BODY = body_for(4, 5)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KilnProcess]:
    repo = tmp_path_factory.mktemp("gzip") / "models"
    build_example_repository(repo, ["simple"])
    proc = KilnProcess(repo, ["--no-history", "--no-allow-grpc"]).start()
    yield proc
    proc.stop()


def _infer(
    server: KilnProcess, body: bytes, encoding: str, chunked: bool = False
) -> tuple[int, Any]:
    sock, reader = connect(server.http_port)
    with sock:
        if chunked:  # the ASGI path reads it
            sock.sendall(
                f"POST {INFER} HTTP/1.1\r\nHost: localhost\r\nContent-Encoding: {encoding}\r\n"
                f"Transfer-Encoding: chunked\r\n\r\n{len(body):x}\r\n".encode()
                + body
                + b"\r\n0\r\n\r\n"
            )
        else:  # the fast path in the HTTP protocol reads it
            sock.sendall(post(INFER, body, f"Content-Encoding: {encoding}\r\n"))
        status, _, out = reader.response()
    return status, json.loads(out)


@pytest.mark.parametrize("chunked", [False, True])
@pytest.mark.parametrize(
    ("encoding", "body", "message"),
    [
        ("gzip", gzip.compress(BODY) + b"garbage", "7 bytes follow the end"),
        ("gzip", gzip.compress(BODY) + gzip.compress(b"more"), "second gzip member"),
        ("gzip", gzip.compress(BODY)[:-4], "truncated"),
        ("deflate", zlib.compress(BODY) + b"\x00", "1 bytes follow the end"),
        ("deflate", zlib.compress(BODY)[:-2], "truncated"),
    ],
)
def test_anything_but_one_whole_stream_is_400(
    server: KilnProcess, encoding: str, body: bytes, message: str, chunked: bool
) -> None:
    status, out = _infer(server, body, encoding, chunked)
    assert status == 400, out
    assert message in out["error"]


@pytest.mark.parametrize("chunked", [False, True])
@pytest.mark.parametrize(
    ("encoding", "body"), [("gzip", gzip.compress(BODY)), ("deflate", zlib.compress(BODY))]
)
def test_a_whole_stream_still_works(
    server: KilnProcess, encoding: str, body: bytes, chunked: bool
) -> None:
    status, out = _infer(server, body, encoding, chunked)
    assert status == 200, out
    assert out["outputs"][0]["data"] == [9] * 16


def _probes_during(base: str, work: Callable[[], None]) -> int:
    """Health probes sent and answered in the second half of ``work``'s run."""
    done: list[float] = []

    def run() -> None:
        work()
        done.append(time.monotonic())

    probes: list[tuple[float, float]] = []
    session = requests.Session()
    session.get(f"{base}/v2/health/live", timeout=30)  # a warm connection
    worker = threading.Thread(target=run)
    start = time.monotonic()
    worker.start()
    while worker.is_alive():
        sent = time.monotonic()
        assert session.get(f"{base}/v2/health/live", timeout=60).status_code == 200
        probes.append((sent, time.monotonic()))
    worker.join()
    middle = start + (done[0] - start) / 2
    return len([p for p in probes if p[0] >= middle and p[1] < done[0]])


SIZE = 200 << 20  # inflated: about a second of zlib's work
HEADER = json.dumps(
    {"inputs": [{"name": "INPUT0", "datatype": "INT32", "shape": [1, SIZE // 4],
                 "parameters": {"binary_data_size": SIZE}}]}
).encode()  # fmt: skip


def test_a_body_inflates_while_other_clients_are_answered(
    make_server: type[KilnProcess], example_repo: Path
) -> None:
    """200 KB of gzip that inflate to 200 MiB held the event loop for their whole
    inflation (60 KB took a quarter of a second of everyone's time under the default
    limit). A binary body keeps the JSON small: only inflation costs. Only the order of
    events is checked."""
    proc = make_server(example_repo, ["--http-max-input-size", str(SIZE + (1 << 20))]).start()
    bomb = gzip.compress(HEADER + bytes(SIZE), 6)
    answers: list[Any] = []

    def send() -> None:
        sock, reader = connect(proc.http_port)
        with sock:
            extra = f"Content-Encoding: gzip\r\nInference-Header-Content-Length: {len(HEADER)}\r\n"
            sock.sendall(post(INFER, bomb, extra))
            answers.append(reader.response())

    during = _probes_during(f"http://{proc.http_url}", send)
    status, _, out = answers[0]
    assert status == 400, out  # inflated whole, then refused by core
    assert "missing required input(s) ['INPUT1']" in json.loads(out)["error"]
    assert during >= 3
