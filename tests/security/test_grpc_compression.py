"""A compressed gRPC message must be exactly one stream, as an HTTP body must
(``tests/security/test_http_compression.py``): zlib stops at the end of the first gzip
member, so trailing bytes or a second member would otherwise be dropped unseen."""

from __future__ import annotations

import gzip
import random
import threading
import zlib

import pytest

from kiln.frontends.grpc.h2 import rpc
from tests.h2_client import RawH2, in_process_server, message, request_headers

DATA = b"kiln" * 64


@pytest.mark.parametrize(
    ("payload", "encoding"),
    [
        (gzip.compress(DATA) + b"garbage", b"gzip"),
        (gzip.compress(DATA) + gzip.compress(b"second member"), b"gzip"),
        (zlib.compress(DATA) + b"\0", b"deflate"),
    ],
    ids=["gzip trailing bytes", "gzip second member", "deflate trailing bytes"],
)
def test_anything_after_the_stream_is_refused(payload: bytes, encoding: bytes) -> None:
    with pytest.raises(ValueError, match="follow the end"):
        rpc.inflate(payload, encoding, 2**20)


def test_one_whole_stream_still_inflates() -> None:
    assert rpc.inflate(gzip.compress(DATA), b"gzip", 2**20) == DATA
    assert rpc.inflate(zlib.compress(DATA), b"deflate", 2**20) == DATA


def test_a_message_over_1_kib_inflates_on_a_worker_thread(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A compressed message under 256 KiB was inflated on the event loop, whatever it
    inflated to: 200 KB of gzip held every client for the time 200 MiB took. Above 1 KiB it
    inflates on a worker thread (zlib gives up the GIL there); a tiny one stays in place.
    Which thread inflates is checked, not how long anything took."""
    threads: list[str] = []
    real = rpc.inflate

    def recording(payload: bytes, encoding: bytes, limit: int) -> bytes:
        threads.append(threading.current_thread().name)
        return real(payload, encoding, limit)

    monkeypatch.setattr(rpc, "inflate", recording)
    big = random.Random(0).randbytes(16384)  # gzip cannot shrink it under 1 KiB
    with in_process_server() as server, RawH2(server.port) as raw:
        for sid, body in ((1, b"tiny"), (3, big)):
            raw.headers(sid, request_headers("/t/Echo", (b"grpc-encoding", b"gzip")))
            raw.data(sid, message(gzip.compress(body), compressed=True), end_stream=True)
            assert raw.response(sid).data == message(body)
    loop_thread, worker = threads  # 24 bytes of gzip inflated in place, on the loop's
    assert loop_thread.endswith("(run_until_complete)")  # the in-process server's loop
    assert worker != loop_thread
