"""Compressed request bodies must end exactly where the body does (issue #25, lows).

zlib stops at the end of the first gzip member or deflate stream, so bytes after it (a
second gzip member, trailing data) were silently dropped and a truncated stream was
inflated as far as it went. Now any of these is a 400; a whole stream still works."""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import json
import random
import threading
import zlib
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from kiln.examples import build_example_repository
from kiln.examples.reference import reference_outputs
from kiln.frontends.http.app import INLINE_COMPRESS_BYTES, HttpFrontend, response_encoding
from kiln.server.server import Server, ServerOptions
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


def _one_message(message: dict[str, Any]) -> Callable[[], Awaitable[dict[str, Any]]]:
    async def receive() -> dict[str, Any]:
        return message

    return receive


async def test_a_body_over_1_kib_inflates_on_a_worker_thread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """200 KB of gzip that inflate to 200 MiB held the event loop for their whole
    inflation (60 KB took a quarter of a second of everyone's time under the default
    limit). Above 1 KiB a body inflates on a worker thread (zlib gives up the GIL there);
    a tiny one stays in place. Which thread inflates is checked, not how long it took."""
    threads: list[int] = []
    real = HttpFrontend.decode_body

    def recording(self: HttpFrontend, body: bytes, encoding: str) -> bytes:
        threads.append(threading.get_ident())
        return real(self, body, encoding)

    monkeypatch.setattr(HttpFrontend, "decode_body", recording)
    frontend = HttpFrontend(Server(ServerOptions([tmp_path])))
    big = random.Random(0).randbytes(16384)  # gzip cannot shrink it under 1 KiB
    for body in (b"tiny", big):
        packed = gzip.compress(body)
        receive = _one_message({"type": "http.request", "body": packed, "more_body": False})
        assert await frontend.read_asgi_body(str(len(packed)), "gzip", receive) == body
    assert threads[0] == threading.get_ident()  # 24 bytes of gzip: inflated in place
    assert threads[1] != threading.get_ident()


class _CompressGate:
    """Wraps ``HttpFrontend.encode_body``: which thread compressed each response, and a
    gate that holds a response's compression until the test releases it."""

    def __init__(self) -> None:
        self.loop_thread = threading.get_ident()  # made on the test's event loop
        self.threads: list[int] = []
        self.seen: list[int] = []  # each body's size
        self.entered = threading.Event()
        self.release = threading.Event()
        self.real = HttpFrontend.encode_body

    def __call__(self, accept: str, body: bytes) -> tuple[bytes, str]:
        self.threads.append(threading.get_ident())
        self.seen.append(len(body))
        if len(body) > INLINE_COMPRESS_BYTES:
            self.entered.set()
            if threading.get_ident() == self.loop_thread:  # the gate would hold the loop
                raise AssertionError("a big response was compressed on the event loop")
            assert self.release.wait(60), "the test never released the compression"
        return self.real(accept, body)


@contextlib.asynccontextmanager
async def _image_client(folder: Path) -> AsyncIterator[httpx.AsyncClient]:
    """An in-process server with the example ``image_preprocess`` model, and a client of
    its HTTP frontend."""
    build_example_repository(folder, ["image_preprocess"])
    server = Server(ServerOptions([folder]))
    await server.start()
    try:
        transport = httpx.ASGITransport(app=HttpFrontend(server).app())
        async with httpx.AsyncClient(transport=transport, base_url="http://kiln") as client:
            yield client
    finally:
        await server.stop()


def _images(batch: int, blank: bool = False) -> dict[str, Any]:
    data = [0 if blank else (i * 7) % 256 for i in range(batch * 28 * 28)]
    tensor = {"name": "IMAGE", "shape": [batch, 28, 28, 1], "datatype": "UINT8", "data": data}
    return {"inputs": [tensor]}


@pytest.mark.parametrize("encoding", ["gzip", "deflate"])
async def test_a_big_response_compresses_on_a_worker_thread_while_others_are_answered(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, encoding: str
) -> None:
    """32 MB of tensor output took most of a second to gzip on the event loop, where no
    other client was answered. Above 16 KiB a response compresses on a worker thread: the
    test holds that compression at a gate and gets a health probe answered meanwhile. A
    small response stays in place (the thread hop would cost more than its compression).
    Which thread compressed is checked, never how long anything took."""
    gate = _CompressGate()
    monkeypatch.setattr(HttpFrontend, "encode_body", staticmethod(gate))
    async with _image_client(tmp_path) as client:
        try:  # the gate is open again before the server stops, whatever fails
            url = "/v2/models/image_preprocess/infer"
            headers = {"Accept-Encoding": encoding}
            small = await client.post(url, json=_images(1, blank=True), headers=headers)
            assert small.status_code == 200 and small.headers["content-encoding"] == encoding
            assert len(gate.seen) == 1 and gate.seen[0] <= INLINE_COMPRESS_BYTES
            assert gate.threads == [threading.get_ident()]  # compressed in place
            big = asyncio.create_task(client.post(url, json=_images(32), headers=headers))
            assert await asyncio.to_thread(gate.entered.wait, 60)
            # the big response is being compressed: another client is answered meanwhile
            assert (await client.get("/v2/health/live")).status_code == 200
            gate.release.set()
            answer = await big
        finally:
            gate.release.set()
    assert answer.status_code == 200 and answer.headers["content-encoding"] == encoding
    assert len(gate.threads) == 2 and gate.threads[1] != threading.get_ident()
    out = answer.json()["outputs"][0]  # httpx inflated it: the same tensor came through
    images = np.array(_images(32)["inputs"][0]["data"], dtype=np.uint8)
    want = reference_outputs("image_preprocess", {"IMAGE": images.reshape(32, 28, 28, 1)})
    np.testing.assert_allclose(out["data"], want["NORMALIZED"].ravel(), rtol=1e-6)


@pytest.mark.parametrize(
    ("accept", "chosen"),
    [
        ("gzip", "gzip"),
        ("deflate", "deflate"),
        ("gzip, deflate", "gzip"),
        ("deflate, gzip", "deflate"),  # a tie: the first, as Triton
        ("gzip;q=0.5, deflate;q=0.8", "deflate"),
        ("gzip;q=0", ""),  # q=0: not acceptable (it was gzipped before)
        ("gzip;q=0, deflate", "deflate"),
        ("identity, gzip;q=0.5", ""),
        ("GZIP ; Q=0.9", "gzip"),
        ("br, zstd", ""),
        ("*", ""),
        ("gzip;q=abc, deflate;q=0.1", "deflate"),
        ("gzip;q=2", ""),  # out of range: skipped
        ("x-gzip-but-not", ""),
        ("", ""),
        (", ,;,", ""),
    ],
)
def test_accept_encoding_is_read_with_its_weights(accept: str, chosen: str) -> None:
    assert response_encoding(accept) == chosen


async def test_q_zero_gets_an_uncompressed_answer(tmp_path: Path) -> None:
    async with _image_client(tmp_path) as client:
        url = "/v2/models/image_preprocess/infer"
        for accept, encoding in (("gzip;q=0", None), ("gzip;q=0.1, deflate", "deflate")):
            answer = await client.post(url, json=_images(2), headers={"Accept-Encoding": accept})
            assert answer.status_code == 200
            assert answer.headers.get("content-encoding") == encoding
