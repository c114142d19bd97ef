"""HTTP/1.1 semantics of inference requests on the wire, where kiln answers them inside the
HTTP protocol (``kiln.frontends.http.fast_protocol``) or hands them to the ASGI app:
pipelining order across both paths, HTTP/1.0 and ``Connection: close``, chunked and
compressed bodies, ``Expect: 100-continue``, percent-encoded paths, size limits.
Raw sockets, so nothing a client library smooths over is hidden.
"""

from __future__ import annotations

import gzip
import json
import socket
from collections.abc import Iterator

import pytest

from kiln.examples import build_example_repository
from tests.conftest import KilnProcess

LIMIT = 4096


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KilnProcess]:
    repo = tmp_path_factory.mktemp("fastproto") / "models"
    build_example_repository(repo, ["simple"])
    proc = KilnProcess(repo, ["--http-max-input-size", str(LIMIT), "--no-history"]).start()
    yield proc
    proc.stop()


def body_for(a: int, b: int) -> bytes:
    return json.dumps(
        {
            "inputs": [
                {"name": "INPUT0", "shape": [1, 16], "datatype": "INT32", "data": [a] * 16},
                {"name": "INPUT1", "shape": [1, 16], "datatype": "INT32", "data": [b] * 16},
            ],
            "outputs": [{"name": "OUTPUT0"}],
        }
    ).encode()


def post(path: str, body: bytes, extra: str = "", version: str = "1.1") -> bytes:
    head = (
        f"POST {path} HTTP/{version}\r\nHost: localhost\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n{extra}\r\n"
    )
    return head.encode() + body


class Reader:
    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buf = b""

    def _fill(self) -> bool:
        chunk = self.sock.recv(65536)
        self.buf += chunk
        return bool(chunk)

    def response(self) -> tuple[int, dict[str, str], bytes]:
        while b"\r\n\r\n" not in self.buf:
            assert self._fill(), f"connection closed mid-response: {self.buf!r}"
        head, self.buf = self.buf.split(b"\r\n\r\n", 1)
        lines = head.decode("latin-1").split("\r\n")
        status = int(lines[0].split()[1])
        headers = {k.lower(): v.strip() for k, v in (x.split(":", 1) for x in lines[1:])}
        if status == 100:
            return status, headers, b""
        length = int(headers["content-length"])
        while len(self.buf) < length:
            assert self._fill(), "connection closed mid-body"
        body, self.buf = self.buf[:length], self.buf[length:]
        return status, headers, body

    def closed(self) -> bool:
        return not self.buf and not self._fill()


def connect(server: KilnProcess) -> tuple[socket.socket, Reader]:
    sock = socket.create_connection(("127.0.0.1", server.http_port), timeout=20)
    return sock, Reader(sock)


def output0(body: bytes) -> list[int]:
    return json.loads(body)["outputs"][0]["data"]


def test_pipelined_requests_answer_in_order_across_both_paths(server: KilnProcess) -> None:
    sock, reader = connect(server)
    with sock:
        sock.sendall(
            post("/v2/models/simple/infer", body_for(1, 1))
            + b"GET /v2/models/simple HTTP/1.1\r\nHost: localhost\r\n\r\n"  # an ASGI route
            + post("/v2/models/simple/infer", body_for(5, 2))
            + post("/v2/models/simple/versions/1/infer", body_for(7, 3))
        )
        answers = [reader.response() for _ in range(4)]
    assert [status for status, _, _ in answers] == [200] * 4
    assert output0(answers[0][2]) == [2] * 16
    assert json.loads(answers[1][2])["name"] == "simple"
    assert output0(answers[2][2]) == [7] * 16
    assert output0(answers[3][2]) == [10] * 16


def test_keep_alive_serves_many_requests_on_one_connection(server: KilnProcess) -> None:
    sock, reader = connect(server)
    with sock:
        for i in range(20):
            sock.sendall(post("/v2/models/simple/infer", body_for(i, 1)))
            status, headers, body = reader.response()
            assert status == 200 and headers["content-type"] == "application/json"
            assert output0(body) == [i + 1] * 16


@pytest.mark.parametrize(("version", "extra"), [("1.0", ""), ("1.1", "Connection: close\r\n")])
def test_connection_close_semantics(server: KilnProcess, version: str, extra: str) -> None:
    sock, reader = connect(server)
    with sock:
        sock.sendall(post("/v2/models/simple/infer", body_for(2, 2), extra, version))
        status, headers, body = reader.response()
        assert status == 200 and output0(body) == [4] * 16
        assert headers.get("connection") == "close"
        assert reader.closed()


def test_chunked_body_is_read_by_the_asgi_path(server: KilnProcess) -> None:
    body = body_for(3, 4)
    half = len(body) // 2
    chunked = b"".join(
        f"{len(part):x}\r\n".encode() + part + b"\r\n" for part in (body[:half], body[half:])
    )
    sock, reader = connect(server)
    with sock:
        sock.sendall(
            b"POST /v2/models/simple/infer HTTP/1.1\r\nHost: localhost\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n" + chunked + b"0\r\n\r\n"
        )
        status, _, out = reader.response()
    assert status == 200 and output0(out) == [7] * 16


def test_gzip_body_and_unknown_encoding(server: KilnProcess) -> None:
    sock, reader = connect(server)
    with sock:
        packed = gzip.compress(body_for(6, 1))
        sock.sendall(post("/v2/models/simple/infer", packed, "Content-Encoding: gzip\r\n"))
        status, _, out = reader.response()
        assert status == 200 and output0(out) == [7] * 16
        sock.sendall(post("/v2/models/simple/infer", body_for(1, 1), "Content-Encoding: br\r\n"))
        status, _, out = reader.response()
        assert status == 501 and "unsupported Content-Encoding 'br'" in json.loads(out)["error"]
        # a bad body costs that request only: the connection still serves
        sock.sendall(post("/v2/models/simple/infer", b'{"inputs": ['))
        status, _, out = reader.response()
        assert status == 400 and "error" in json.loads(out)
        sock.sendall(post("/v2/models/simple/infer", body_for(1, 1)))
        assert reader.response()[0] == 200


def test_expect_100_continue(server: KilnProcess) -> None:
    sock, reader = connect(server)
    with sock:
        body = body_for(8, 1)
        sock.sendall(post("/v2/models/simple/infer", b"", "Expect: 100-continue\r\n").replace(
            b"Content-Length: 0", f"Content-Length: {len(body)}".encode()
        ))  # fmt: skip
        assert reader.response()[0] == 100
        sock.sendall(body)
        status, _, out = reader.response()
    assert status == 200 and output0(out) == [9] * 16


def test_percent_encoded_path_and_unknown_model(server: KilnProcess) -> None:
    sock, reader = connect(server)
    with sock:
        sock.sendall(post("/v2/models/simp%6Ce/infer", body_for(1, 2)))
        status, _, out = reader.response()
        assert status == 200 and output0(out) == [3] * 16
        sock.sendall(post("/v2/models/nope/infer", body_for(1, 2)))
        status, _, out = reader.response()
        assert status == 404 and "'nope'" in json.loads(out)["error"]


def test_declared_body_over_the_limit_is_413(server: KilnProcess) -> None:
    sock, reader = connect(server)
    with sock:
        big = b" " * (LIMIT + 1)
        sock.sendall(post("/v2/models/simple/infer", big))
        status, _, out = reader.response()
    assert status == 413 and f"limit of {LIMIT} bytes" in json.loads(out)["error"]


def _raw_exchange(port: int, request: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=20) as sock:
        sock.sendall(request)
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    return data


def test_kiln_http_fast_path_0_leaves_inference_to_the_asgi_app(
    server: KilnProcess, tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The A/B switch of benchmarks/README.md: the same answer, from the other path (the
    protocol writes the frontend's header names as they are, the ASGI path lower-cased)."""
    request = post("/v2/models/simple/infer", body_for(2, 3), "Connection: close\r\n")
    fast = _raw_exchange(server.http_port, request)
    repo = tmp_path_factory.mktemp("fastproto-off") / "models"
    build_example_repository(repo, ["simple"])
    monkeypatch.setenv("KILN_HTTP_FAST_PATH", "0")
    off = KilnProcess(repo, ["--no-history"]).start()
    try:
        slow = _raw_exchange(off.http_port, request)
    finally:
        off.stop()
    fast_head, fast_body = fast.split(b"\r\n\r\n", 1)
    slow_head, slow_body = slow.split(b"\r\n\r\n", 1)
    assert fast_head.startswith(b"HTTP/1.1 200") and slow_head.startswith(b"HTTP/1.1 200")
    assert fast_body == slow_body and output0(fast_body) == [5] * 16
    assert b"\r\nContent-Type: application/json" in fast_head
    assert b"\r\ncontent-type: application/json" in slow_head
