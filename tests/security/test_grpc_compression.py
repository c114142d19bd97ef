"""A compressed gRPC message must be exactly one stream, as an HTTP body must
(``tests/security/test_http_compression.py``): zlib stops at the end of the first gzip
member, so trailing bytes or a second member would otherwise be dropped unseen."""

from __future__ import annotations

import gzip
import threading
import time
import zlib
from pathlib import Path

import pytest
import requests

from kiln.frontends.grpc import grpc_service_pb2 as pb
from kiln.frontends.grpc.h2 import rpc
from tests.conftest import KilnProcess
from tests.h2_client import RawH2, Response, message, request_headers

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


def test_a_message_inflates_while_other_clients_are_answered(
    make_server: type[KilnProcess], example_repo: Path
) -> None:
    """A compressed message under 256 KiB was inflated on the event loop, whatever it
    inflated to: 200 KB of gzip held every client for the time 200 MiB took. Sent raw, as
    an attacker compresses (grpcio's own gzip is larger). Only the order of events is
    checked."""
    size = 200 << 20
    server = make_server(example_repo, ["--grpc-max-message-bytes", str(size + (1 << 20))])
    server.start()
    msg = pb.ModelInferRequest(model_name="simple")
    msg.inputs.add(name="INPUT0", datatype="INT32", shape=[1, size // 4])
    msg.raw_input_contents.append(bytes(size))
    bomb = gzip.compress(msg.SerializeToString(), 9)
    assert len(bomb) < 2**18
    answer: list[Response] = []
    done: list[float] = []

    def send() -> None:
        with RawH2(server.grpc_port) as raw:
            path = "/inference.GRPCInferenceService/ModelInfer"
            raw.headers(1, request_headers(path, (b"grpc-encoding", b"gzip")))
            for i in range(0, len(bomb) + 5, 2**14):
                raw.data(1, message(bomb, compressed=True)[i : i + 2**14])
            raw.data(1, b"", end_stream=True)
            answer.append(raw.response(1, timeout=120))
        done.append(time.monotonic())

    base = f"http://{server.http_url}"
    session = requests.Session()
    session.get(f"{base}/v2/health/live", timeout=30)  # a warm connection
    probes: list[tuple[float, float]] = []
    worker = threading.Thread(target=send)
    start = time.monotonic()
    worker.start()
    while worker.is_alive():
        sent = time.monotonic()
        assert session.get(f"{base}/v2/health/live", timeout=60).status_code == 200
        probes.append((sent, time.monotonic()))
    worker.join()
    assert answer and answer[0].status == rpc.INVALID_ARGUMENT, answer
    assert "missing required input(s) ['INPUT1']" in answer[0].message
    middle = start + (done[0] - start) / 2
    assert len([p for p in probes if p[0] >= middle and p[1] < done[0]]) >= 3
