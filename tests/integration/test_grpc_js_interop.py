"""A gRPC client that shares no code with grpcio or kiln: grpc-js, on Node's HTTP/2
(nghttp2), against ``kiln serve``'s own HTTP/2 gRPC server. Metadata, unary inference, a
tensor several flow-control windows large each way, 200 calls at once on one connection, a
bidirectional stream of a decoupled model, errors as gRPC statuses and a cancelled stream
(``tests/interop/grpc_js/client.mjs``; ``make test`` installs its npm packages)."""

from __future__ import annotations

import json
import shutil
import subprocess
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from onnx import TensorProto

import kiln
from kiln.examples import build_example_repository
from tests.conftest import KilnProcess
from tests.integration.test_python_bls_cancel import MODELS
from tests.onnx_models import identity_model

CLIENT = Path(__file__).parents[1] / "interop" / "grpc_js"
PROTO_ROOT = Path(kiln.__file__).parents[1]  # the folder that holds kiln/...proto

pytestmark = pytest.mark.skipif(
    shutil.which("node") is None or not (CLIENT / "node_modules" / "@grpc").is_dir(),
    reason="needs Node.js and `npm ci --prefix tests/interop/grpc_js` (make test does both)",
)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KilnProcess]:
    repo = tmp_path_factory.mktemp("grpc_js") / "models"
    build_example_repository(repo, ["simple", "repeat_int32"])
    identity_model(repo / "big" / "1" / "model.onnx", [("X", TensorProto.FLOAT, ["n"])])
    (repo / "big" / "config.pbtxt").write_text(
        'name: "big"\nplatform: "onnxruntime_onnx"\nmax_batch_size: 0\n'
        'input [ { name: "X" data_type: TYPE_FP32 dims: [ -1 ] } ]\n'
        'output [ { name: "OUT0" data_type: TYPE_FP32 dims: [ -1 ] } ]\n'
    )
    source, io = MODELS["ticker"]  # a response every 10 ms until its client goes away
    (repo / "ticker" / "1").mkdir(parents=True)
    (repo / "ticker" / "1" / "model.py").write_text(source)
    config = 'name: "ticker"\nbackend: "python"\nmax_batch_size: 0\n' + textwrap.dedent(io)
    (repo / "ticker" / "config.pbtxt").write_text(config)
    proc = KilnProcess(repo).start()
    yield proc
    proc.stop()


def _run(server: KilnProcess, scenario: str, *args: object) -> Any:
    done = subprocess.run(
        ["node", str(CLIENT / "client.mjs"), server.grpc_url, str(PROTO_ROOT), scenario,
         *map(str, args)],
        capture_output=True, text=True, timeout=120, cwd=CLIENT,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_metadata(server: KilnProcess) -> None:
    got = _run(server, "metadata")
    assert got["live"] is True and got["server"] == "kiln" and got["extensions"] > 0
    assert got["inputs"] == [["INPUT0", "INT32", [-1, 16]], ["INPUT1", "INT32", [-1, 16]]]


def test_unary_inference(server: KilnProcess) -> None:
    got = _run(server, "simple")
    assert got["id"] == "js-1"
    assert got["outputs"]["OUTPUT0"] == [i + 3 for i in range(16)]
    assert got["outputs"]["OUTPUT1"] == [i - 3 for i in range(16)]


def test_a_tensor_many_flow_control_windows_large(server: KilnProcess) -> None:
    count = 1_000_000  # 4 MB each way: 61 times HTTP/2's initial 64 KiB window
    got = _run(server, "large", "big", count)
    assert got == {"bytes": 4 * count, "equal": True, "last": ((count - 1) % 1000) / 8}


def test_two_hundred_concurrent_calls_on_one_connection(server: KilnProcess) -> None:
    """grpc-js multiplexes them as concurrent HTTP/2 streams of one connection (some with
    256 KiB tensors, so they share the connection's flow-control window)."""
    assert _run(server, "parallel", 200) == {"ok": 200, "total": 200}


def test_a_bidirectional_stream_of_a_decoupled_model(server: KilnProcess) -> None:
    got = _run(server, "stream", 3, 5)
    assert got["responses"] == {"first": [100, 101, 102], "second": [200, 201, 202, 203, 204]}
    assert sorted(got["finals"]) == ["first", "second"]


def test_errors_are_grpc_statuses_and_the_channel_goes_on(server: KilnProcess) -> None:
    got = _run(server, "errors")
    assert got["unknown"]["code"] == 5  # NOT_FOUND
    assert "no_such_model" in got["unknown"]["details"]
    assert got["wrongShape"]["code"] == 3  # INVALID_ARGUMENT
    assert "INPUT0" in got["wrongShape"]["details"]
    assert got["afterOk"] is True


def test_a_cancelled_stream_reaches_the_model(server: KilnProcess) -> None:
    marker = server.repository / "ticker.log"
    marker.unlink(missing_ok=True)
    got = _run(server, "cancel")
    assert got["received"] >= 3 and got["afterOk"] is True
    deadline = time.monotonic() + 30
    while not marker.exists():
        assert time.monotonic() < deadline, "the model never saw the cancellation"
        time.sleep(0.02)
    assert int(marker.read_text().split()[-1]) < 1000
