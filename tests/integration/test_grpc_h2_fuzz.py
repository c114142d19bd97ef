"""Random and mutated HTTP/2 input never takes kiln's gRPC server down: after each
sequence a connection opened before it still answers, and at the end a real tritonclient
call on a new connection succeeds."""

from __future__ import annotations

import shutil
import socket
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kiln.frontends.grpc import grpc_service_pb2 as pb
from kiln.frontends.grpc.h2 import frames as f
from kiln.frontends.grpc.h2 import huffman
from kiln.frontends.grpc.h2.hpack import encode
from tests.conftest import KilnProcess
from tests.h2_client import SERVER_LIVE, RawH2, message, request_headers

INFER = "/inference.GRPCInferenceService/ModelInfer"


def _infer_body() -> bytes:
    msg = pb.ModelInferRequest(model_name="simple")
    for name in ("INPUT0", "INPUT1"):
        msg.inputs.add(name=name, datatype="INT32", shape=[1, 16])
        msg.raw_input_contents.append(np.arange(16, dtype=np.int32).tobytes())
    return msg.SerializeToString()


VALID = [
    f.PREFACE
    + f.settings_frame({})
    + f.frame(f.HEADERS, f.END_HEADERS, 1, encode(request_headers(SERVER_LIVE)))
    + f.frame(f.DATA, f.END_STREAM, 1, message(b"")),
    f.PREFACE
    + f.settings_frame({f.INITIAL_WINDOW_SIZE: 100})
    + f.frame(f.HEADERS, f.END_HEADERS, 1, encode(request_headers(INFER)))
    + f.frame(f.DATA, 0, 1, message(_infer_body())[:40])
    + f.frame(f.DATA, f.END_STREAM, 1, message(_infer_body())[40:])
    + f.frame(f.WINDOW_UPDATE, 0, 1, (1000).to_bytes(4, "big")),
]

# header blocks that decode, raw and Huffman-coded, with table insertions
BLOCKS = [
    encode(request_headers(SERVER_LIVE)),
    encode(request_headers(INFER, (b"grpc-timeout", b"1m"), (b"grpc-encoding", b"gzip"))),
    b"\x40\x88" + huffman.encode(b"custom-k") + b"\x83" + huffman.encode(b"val"),
    b"\x3f\xe1\x1f\x82",  # a table size update
]

payloads = st.one_of(
    st.binary(max_size=64),
    st.sampled_from(BLOCKS),
    st.builds(lambda n: n.to_bytes(4, "big"), st.integers(0, 2**32 - 1)),
    st.builds(
        lambda pairs: f.settings_frame(dict(pairs))[9:],
        st.lists(st.tuples(st.integers(0, 8), st.integers(0, 2**32 - 1)), max_size=3),
    ),
    st.builds(lambda body: message(body), st.binary(max_size=32)),
)
frames = st.builds(
    f.frame,
    st.one_of(st.integers(0, 10), st.integers(0, 255)),
    st.integers(0, 255),
    st.sampled_from([0, 1, 2, 3, 5, 7, 9, 2**31 - 1]),
    payloads,
)


@st.composite
def mutated(draw: st.DrawFn) -> bytes:
    data = bytearray(draw(st.sampled_from(VALID)))
    for _ in range(draw(st.integers(1, 6))):
        op = draw(st.sampled_from(["flip", "delete", "insert", "truncate", "repeat"]))
        pos = draw(st.integers(0, max(len(data) - 1, 0)))
        if op == "flip" and data:
            data[pos] ^= draw(st.integers(1, 255))
        elif op == "delete":
            del data[pos : pos + draw(st.integers(1, 16))]
        elif op == "insert":
            data[pos:pos] = draw(st.binary(min_size=1, max_size=16))
        elif op == "truncate":
            del data[pos:]
        else:
            data[pos:pos] = data[pos : pos + draw(st.integers(1, 40))]
    return bytes(data)


inputs = st.one_of(
    st.builds(lambda fs: f.PREFACE + f.settings_frame({}) + b"".join(fs), st.lists(frames)),
    mutated(),
    st.binary(max_size=200),
)


@pytest.fixture(scope="module")
def fuzz_server(example_repo: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    repo = tmp_path_factory.mktemp("fuzz") / "models"
    shutil.copytree(example_repo / "simple", repo / "simple")
    server = KilnProcess(repo).start()
    yield server.grpc_port
    code = server.stop()
    log = server.log()
    assert code == 0, log
    # a bad input is the client's problem: none may reach the catch-all for server bugs
    assert "unexpected error" not in log and "Traceback" not in log, log


def _send(port: int, data: bytes) -> None:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        try:
            sock.sendall(data)
            sock.shutdown(socket.SHUT_WR)
            while sock.recv(65536):
                pass
        except (ConnectionResetError, BrokenPipeError, TimeoutError):
            pass


@settings(
    max_examples=300,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(data=inputs)
def test_random_input_never_breaks_the_server(fuzz_server: int, data: bytes) -> None:
    with RawH2(fuzz_server) as bystander:
        _send(fuzz_server, data)
        bystander.unary(1, SERVER_LIVE)
        assert bystander.response(1).status == 0


def test_real_client_after_fuzzing(fuzz_server: int) -> None:
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{fuzz_server}")
    data = np.arange(16, dtype=np.int32).reshape(1, 16)
    inputs = [grpcclient.InferInput(n, [1, 16], "INT32") for n in ("INPUT0", "INPUT1")]
    for item in inputs:
        item.set_data_from_numpy(data)
    np.testing.assert_array_equal(client.infer("simple", inputs).as_numpy("OUTPUT0"), data * 2)
