"""Compressed request bodies must end exactly where the body does (issue #25, lows).

zlib stops at the end of the first gzip member or deflate stream, so bytes after it (a
second gzip member, trailing data) were silently dropped and a truncated stream was
inflated as far as it went. Now any of these is a 400; a whole stream still works."""

from __future__ import annotations

import gzip
import json
import zlib
from collections.abc import Iterator
from typing import Any

import pytest

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
