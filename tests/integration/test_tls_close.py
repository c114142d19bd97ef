"""HTTPS connections kiln closes do not wait on the client's close_notify: an idle
keep-alive client cannot hold up shutdown, and a slow reader still gets all of a response
that ends with ``Connection: close``."""

from __future__ import annotations

import contextlib
import signal
import socket
import ssl
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import onnx
import orjson
import pytest

from tests.conftest import KilnProcess
from tests.integration.test_security_tls import Pki, make_pki, wait_https
from tests.onnx_models import identity_model

# With the old behaviour an idle TLS client held shutdown for the loop's SSL shutdown
# timeout (30 s); the exit timeout is far above both, so only that difference is seen.
EXIT_TIMEOUT_S = 120
SSL_SHUTDOWN_TIMEOUT_S = 30


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture
def https(tmp_path: Path, pki: Pki) -> Iterator[KilnProcess]:
    repo = tmp_path / "models"
    identity_model(repo / "echo" / "1" / "model.onnx", [("IN", onnx.TensorProto.FLOAT, ["N"])])
    (repo / "echo" / "config.pbtxt").write_text(
        'name: "echo"\nbackend: "onnxruntime"\n'
        'input [{ name: "IN" data_type: TYPE_FP32 dims: [-1] }]\n'
        'output [{ name: "OUT0" data_type: TYPE_FP32 dims: [-1] }]\n'
    )
    args = ["--no-history", "--no-allow-grpc", "--exit-timeout-secs", str(EXIT_TIMEOUT_S),
            "--ssl-certfile", str(pki.server_cert),
            "--ssl-keyfile", str(pki.server_key)]  # fmt: skip
    server = KilnProcess(repo, args).start(wait_ready=False)
    wait_https(server, pki)
    yield server
    server.stop(timeout=10)


def _connect(server: KilnProcess, pki: Pki) -> ssl.SSLSocket:
    ctx = ssl.create_default_context(cafile=str(pki.ca))
    ctx.check_hostname = False
    raw = socket.create_connection(("127.0.0.1", server.http_port), timeout=60)
    return ctx.wrap_socket(raw, server_hostname="localhost")


def _read_response(sock: ssl.SSLSocket) -> tuple[bytes, bytes]:
    """(head, body) of one Content-Length response."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"closed mid-headers: {data!r}"
        data += chunk
    head, body = data.split(b"\r\n\r\n", 1)
    length = next(
        int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
        if line.lower().startswith(b"content-length:")
    )  # fmt: skip
    while len(body) < length:
        chunk = sock.recv(65536)
        assert chunk, f"closed after {len(body)} of {length} body bytes"
        body += chunk
    return head, body


def test_an_idle_keep_alive_client_does_not_hold_up_shutdown(https: KilnProcess, pki: Pki) -> None:
    sock = _connect(https, pki)
    sock.sendall(b"GET /v2/health/ready HTTP/1.1\r\nHost: localhost\r\n\r\n")
    head, _ = _read_response(sock)
    assert head.startswith(b"HTTP/1.1 200")
    # The client now sits on its open connection and reads nothing (as a pool does).
    assert https.proc is not None
    started = time.monotonic()
    https.proc.send_signal(signal.SIGTERM)
    assert https.proc.wait(EXIT_TIMEOUT_S) == 0
    assert time.monotonic() - started < SSL_SHUTDOWN_TIMEOUT_S, https.log()
    # The server's end of the connection is gone: the client reads its end, not a hang.
    sock.settimeout(10)
    # an abort after close_notify may also reach the client as a reset
    with contextlib.suppress(ssl.SSLError, ConnectionResetError):
        assert sock.recv(1) == b""
    sock.close()


def test_a_slow_reader_gets_the_whole_response_before_the_close(
    https: KilnProcess, pki: Pki
) -> None:
    values = np.arange(2_000_000, dtype=np.float32)  # ~30 MB of JSON back: it must queue
    body = orjson.dumps(
        {
            "inputs": [
                {"name": "IN", "datatype": "FP32", "shape": [values.size], "data": values.tolist()}
            ]
        }
    )
    sock = _connect(https, pki)
    sock.sendall(
        b"POST /v2/models/echo/infer HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n"
        b"Content-Type: application/json\r\nContent-Length: " + str(len(body)).encode()
        + b"\r\n\r\n" + body
    )  # fmt: skip
    time.sleep(3)  # past the close grace while most of the response is still queued
    head, payload = _read_response(sock)
    assert head.startswith(b"HTTP/1.1 200"), (head, payload[:300])
    out = orjson.loads(payload)["outputs"][0]
    assert out["shape"] == [values.size] and out["data"][-1] == float(values[-1])
    sock.close()
