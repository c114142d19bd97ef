"""A client that reads a decoupled model's stream slowly, or not at all, holds the model
back instead of filling the server's memory (``core/stream.CLIENT_STREAM_WINDOW``).

A decoupled Python model streams 64 KiB responses as fast as it can and notes after each
``send`` how many it has sent. A client opens the stream and reads nothing for a while:
the model must stop far short of the end (paused in ``send``: the server took only what
the window and the connection's buffers hold). Then the client reads everything: every
response arrives, in order, and the model finishes. Assertions are about counts and order,
none about durations. Over gRPC (``ModelStreamInfer``, tritonclient) and HTTP
(``generate_stream``, a raw socket that does not read)."""

from __future__ import annotations

import json
import queue
import socket
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from tests.conftest import KilnProcess

COUNT = 400  # responses of 16,384 float32 (64 KiB): 26 MB if nothing held the model back
WIDTH = 16384

MODEL = """
import os
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.progress = os.path.join(args["model_repository"], "..", "progress")

    def execute(self, requests):
        for request in requests:
            count = int(pb_utils.get_input_tensor_by_name(request, "COUNT").as_numpy()[0])
            sender = request.get_response_sender()
            for i in range(count):
                block = np.full((WIDTH,), i, np.float32)
                sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", block)]))
                with open(self.progress + ".tmp", "w") as f:
                    f.write(str(i + 1))
                os.replace(self.progress + ".tmp", self.progress)
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
""".replace("WIDTH", str(WIDTH))

CONFIG = """
name: "flood"
backend: "python"
max_batch_size: 0
model_transaction_policy { decoupled: true }
input [ { name: "COUNT" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "OUT" data_type: TYPE_FP32 dims: [ WIDTH ] } ]
instance_group [ { count: 1 kind: KIND_CPU } ]
""".replace("WIDTH", str(WIDTH))


@pytest.fixture
def flood(tmp_path: Path, make_server: type[KilnProcess]) -> tuple[KilnProcess, Path]:
    repo = tmp_path / "models"
    (repo / "flood" / "1").mkdir(parents=True)
    (repo / "flood" / "config.pbtxt").write_text(CONFIG)
    (repo / "flood" / "1" / "model.py").write_text(textwrap.dedent(MODEL))
    return make_server(repo).start(), repo / "progress"


def _sent(progress: Path) -> int:
    try:
        return int(progress.read_text())
    except (FileNotFoundError, ValueError):
        return 0


def _settled(progress: Path, quiet: float = 1.0, limit: float = 30.0) -> int:
    """How far the model got once its count stopped moving for ``quiet`` seconds."""
    end = time.monotonic() + limit
    last, since = -1, time.monotonic()
    while time.monotonic() < end:
        now = _sent(progress)
        if now != last:
            last, since = now, time.monotonic()
        elif time.monotonic() - since >= quiet:
            return now
        time.sleep(0.05)
    return _sent(progress)


def test_a_grpc_client_that_does_not_read_pauses_the_model(
    flood: tuple[KilnProcess, Path],
) -> None:
    server, progress = flood
    got: queue.Queue[Any] = queue.Queue()
    reading = threading.Event()

    def callback(result: Any, error: Any) -> None:
        reading.wait()  # a client busy elsewhere: tritonclient's reader stalls here
        got.put(error if error is not None else result)

    client = grpcclient.InferenceServerClient(server.grpc_url)
    client.start_stream(callback=callback)
    try:
        count = grpcclient.InferInput("COUNT", [1], "INT32")
        count.set_data_from_numpy(np.array([COUNT], np.int32))
        client.async_stream_infer("flood", [count], request_id="flood-1")
        held = _settled(progress)
        assert 0 < held < COUNT // 2, held  # paused, far short of the end
        reading.set()
        values = []
        while len(values) < COUNT:
            item = got.get(timeout=60)
            assert not isinstance(item, Exception), item
            out = item.as_numpy("OUT")
            if out is not None:
                assert out.shape == (WIDTH,) and np.all(out == out[0])
                values.append(int(out[0]))
        assert values == list(range(COUNT))  # nothing lost, in order
        assert _settled(progress, quiet=0.2) == COUNT
    finally:
        reading.set()
        client.stop_stream()
        client.close()


def test_an_http_client_that_does_not_read_pauses_the_model(
    flood: tuple[KilnProcess, Path],
) -> None:
    server, progress = flood
    host, port = server.http_url.split(":")
    body = json.dumps({"COUNT": [COUNT]}).encode()
    request = (
        f"POST /v2/models/flood/generate_stream HTTP/1.1\r\nHost: {host}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
        "Connection: close\r\n\r\n"
    ).encode() + body
    with socket.create_connection((host, int(port))) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 16)  # a small reader
        sock.sendall(request)
        held = _settled(progress)
        assert 0 < held < COUNT // 2, held
        data = bytearray()
        while chunk := sock.recv(1 << 20):
            data += chunk
    head, _, stream = bytes(data).partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200")
    events = [
        json.loads(line[len(b"data: ") :])
        for line in _unchunked(head, stream).split(b"\n\n")
        if line.startswith(b"data: ")
    ]
    values = [int(e["OUT"][0]) for e in events if "OUT" in e]
    assert values == list(range(COUNT))
    assert all(len(e["OUT"]) == WIDTH for e in events if "OUT" in e)
    assert _settled(progress, quiet=0.2) == COUNT


def _unchunked(head: bytes, body: bytes) -> bytes:
    """The body of an HTTP/1.1 response, without chunked transfer encoding if it has it."""
    if b"chunked" not in head.lower():
        return body
    out, rest = bytearray(), body
    while rest:
        size_line, _, rest = rest.partition(b"\r\n")
        size = int(size_line.split(b";")[0], 16)
        if size == 0:
            break
        out += rest[:size]
        rest = rest[size + 2 :]
    return bytes(out)
