"""kiln's own gRPC transport with real clients (tritonclient, grpcio stubs): deadlines,
cancellation, 64 MiB messages, many streams on one connection, compressed requests, a
decoupled stream ended by the client's half-close, graceful shutdown with a call in
flight, and the grpc.aio fallback (``--grpc-implementation grpcio``)."""

from __future__ import annotations

import asyncio
import queue
import re
import shutil
import signal
import socket
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as aioclient
from onnx import TensorProto
from tritonclient.utils import InferenceServerException

from kiln.frontends.grpc import grpc_service_pb2 as pb
from kiln.frontends.grpc.services import health_stub, inference_stub
from tests.conftest import KilnProcess
from tests.onnx_models import identity_model, write_slow_model

DATA = np.arange(16, dtype=np.int32).reshape(1, 16)
SLOW_SIZE = 200_000
IDENTITY_CONFIG = """\
name: "identity"
platform: "onnxruntime_onnx"
max_batch_size: 0
input [ { name: "INPUT" data_type: TYPE_FP32 dims: [ -1 ] } ]
output [ { name: "OUT0" data_type: TYPE_FP32 dims: [ -1 ] } ]
"""


def build_repo(example_repo: Path, root: Path) -> Path:
    repo = root / "repo"
    for model in ("simple", "repeat_int32"):
        shutil.copytree(example_repo / model, repo / model)
    write_slow_model(repo)
    identity_model(repo / "identity" / "1" / "model.onnx", [("INPUT", TensorProto.FLOAT, ["n"])])
    (repo / "identity" / "config.pbtxt").write_text(IDENTITY_CONFIG)
    return repo


@pytest.fixture(scope="module")
def server(example_repo: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[KilnProcess]:
    repo = build_repo(example_repo, tmp_path_factory.mktemp("transport"))
    # a 64 MiB tensor makes a message a little over the 64 MiB default: raised, as a
    # deployment sending such tensors would
    process = KilnProcess(repo, args=["--grpc-max-message-bytes", str(80 * 2**20)]).start()
    yield process
    process.stop()


def simple_inputs(module: Any = grpcclient) -> list[Any]:
    inputs = [module.InferInput(n, [1, 16], "INT32") for n in ("INPUT0", "INPUT1")]
    for item in inputs:
        item.set_data_from_numpy(DATA)
    return inputs


def assert_serving(url: str) -> None:
    client = grpcclient.InferenceServerClient(url)
    np.testing.assert_array_equal(
        client.infer("simple", simple_inputs()).as_numpy("OUTPUT0"), DATA * 2
    )


def slow_inputs(iters: int) -> list[grpcclient.InferInput]:
    data = grpcclient.InferInput("INPUT", [SLOW_SIZE], "FP32")
    data.set_data_from_numpy(np.zeros(SLOW_SIZE, dtype=np.float32))
    count = grpcclient.InferInput("ITERS", [1], "INT64")
    count.set_data_from_numpy(np.array([iters], dtype=np.int64))
    return [data, count]


def test_deadline_exceeded(server: KilnProcess) -> None:
    client = grpcclient.InferenceServerClient(server.grpc_url)
    with pytest.raises(InferenceServerException) as err:
        client.infer("slow", slow_inputs(10**6), client_timeout=0.5)
    assert err.value.status() == "StatusCode.DEADLINE_EXCEEDED"
    assert_serving(server.grpc_url)


def test_cancelled_call_leaves_the_server_serving(server: KilnProcess) -> None:
    client = grpcclient.InferenceServerClient(server.grpc_url)
    done: queue.Queue[Any] = queue.Queue()
    ctx = client.async_infer(
        "slow", slow_inputs(3000), callback=lambda result, error: done.put((result, error))
    )
    time.sleep(0.2)
    ctx.cancel()
    _, error = done.get(timeout=30)
    assert error is not None and "CANCELLED" in str(error)
    assert_serving(server.grpc_url)


def test_64_mib_request_and_response(server: KilnProcess) -> None:
    values = np.random.default_rng(0).standard_normal(16 * 2**20, dtype=np.float32)
    client = grpcclient.InferenceServerClient(server.grpc_url)
    tensor = grpcclient.InferInput("INPUT", [values.size], "FP32")
    tensor.set_data_from_numpy(values)
    out = client.infer("identity", [tensor], client_timeout=120).as_numpy("OUT0")
    np.testing.assert_array_equal(out, values)


def test_many_concurrent_streams_on_one_connection(server: KilnProcess) -> None:
    async def run() -> list[np.ndarray]:
        client = aioclient.InferenceServerClient(server.grpc_url)
        try:
            results = await asyncio.gather(
                *(client.infer("simple", simple_inputs(aioclient)) for _ in range(200))
            )
        finally:
            await client.close()
        return [r.as_numpy("OUTPUT0") for r in results]

    for out in asyncio.run(run()):
        np.testing.assert_array_equal(out, DATA * 2)


@pytest.mark.parametrize("algorithm", ["gzip", "deflate"])
def test_compressed_requests(server: KilnProcess, algorithm: str) -> None:
    client = grpcclient.InferenceServerClient(server.grpc_url)
    result = client.infer("simple", simple_inputs(), compression_algorithm=algorithm)
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), DATA * 2)
    values = np.arange(2**20, dtype=np.float32)  # large enough to be decompressed off-loop
    tensor = grpcclient.InferInput("INPUT", [values.size], "FP32")
    tensor.set_data_from_numpy(values)
    out = client.infer("identity", [tensor], compression_algorithm=algorithm)
    np.testing.assert_array_equal(out.as_numpy("OUT0"), values)


def test_decoupled_stream_ends_after_the_clients_half_close(server: KilnProcess) -> None:
    requests = []
    for i, values in enumerate(([1, 2, 3], [4], [5, 6])):
        msg = pb.ModelInferRequest(model_name="repeat_int32", id=f"r{i}")
        msg.inputs.add(name="IN", datatype="INT32", shape=[len(values)])
        msg.raw_input_contents.append(np.array(values, np.int32).tobytes())
        requests.append(msg)
    with grpc.insecure_channel(server.grpc_url) as channel:
        # the iterator ends after three requests: grpcio half-closes the stream, and the
        # server must still send every response before ending the call with OK
        responses = list(inference_stub(channel).ModelStreamInfer(iter(requests), timeout=60))
    got: dict[str, list[int]] = {}
    for r in responses:
        assert not r.error_message
        value = np.frombuffer(r.infer_response.raw_output_contents[0], np.int32)
        got.setdefault(r.infer_response.id, []).append(int(value[0]))
    assert got == {"r0": [1, 2, 3], "r1": [4], "r2": [5, 6]}


def test_tritonclient_stream_with_errors_and_successes(server: KilnProcess) -> None:
    client = grpcclient.InferenceServerClient(server.grpc_url)
    results: queue.Queue[Any] = queue.Queue()
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    client.async_stream_infer("simple", simple_inputs(), request_id="ok")
    client.async_stream_infer("no_such_model", simple_inputs(), request_id="bad")
    outcomes = [results.get(timeout=30) for _ in range(2)]
    client.stop_stream()
    assert sum(error is None for _, error in outcomes) == 1
    assert any(error is not None and "no_such_model" in str(error) for _, error in outcomes)


def _refuses_connections(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1):
            return False
    except ConnectionRefusedError:
        return True


def _pending(process: KilnProcess, model: str) -> float:
    with urllib.request.urlopen(process.metrics_url, timeout=5) as resp:
        text = resp.read().decode()
    pattern = rf'^nv_inference_pending_request_count\{{model="{model}",version="1"\}} (\S+)$'
    match = re.search(pattern, text, re.MULTILINE)
    return float(match.group(1)) if match else 0.0


def test_graceful_shutdown_finishes_in_flight_calls(
    make_server: type[KilnProcess], example_repo: Path, tmp_path: Path
) -> None:
    repo = build_repo(example_repo, tmp_path)
    shutil.rmtree(repo / "repeat_int32")
    process = make_server(repo).start()
    results: dict[int, np.ndarray] = {}
    errors: list[str] = []

    def call(i: int) -> None:
        try:
            client = grpcclient.InferenceServerClient(process.grpc_url)
            results[i] = client.infer("slow", slow_inputs(3000)).as_numpy("OUTPUT")
        except Exception as exc:
            errors.append(repr(exc))

    threads = [threading.Thread(target=call, args=(i,)) for i in (0, 1)]
    for t in threads:
        t.start()
    # one instance: a request is pending only while the other computes, so pending == 1
    # means both calls are in flight
    for _ in range(600):
        if _pending(process, "slow") >= 1:
            break
        time.sleep(0.05)
    else:
        pytest.fail(f"the slow calls never overlapped:\n{process.log()}")
    assert process.proc is not None
    process.proc.send_signal(signal.SIGTERM)
    for _ in range(600):
        if _refuses_connections(process.grpc_port):
            break
        time.sleep(0.05)
    else:
        pytest.fail("kiln kept accepting gRPC connections after SIGTERM")
    for t in threads:
        t.join(120)
    assert errors == []
    for i in (0, 1):
        np.testing.assert_array_equal(results[i], np.full(SLOW_SIZE, 3000, np.float32))
    assert process.proc.wait(60) == 0
    assert "kiln stopped" in process.log()


def test_grpcio_fallback(make_server: type[KilnProcess], example_repo: Path) -> None:
    process = make_server(
        example_repo,
        args=["--grpc-implementation", "grpcio", "--model-control-mode", "explicit",
              "--load-model", "simple"],
    ).start()  # fmt: skip
    client = grpcclient.InferenceServerClient(process.grpc_url)
    assert client.is_server_live() and client.is_server_ready()
    assert client.get_model_metadata("simple").name == "simple"
    assert_serving(process.grpc_url)
    with grpc.insecure_channel(process.grpc_url) as channel:
        status = health_stub(channel).Check(pb_health_request())
        assert status.status == 1  # SERVING
    results: queue.Queue[Any] = queue.Queue()
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    client.async_stream_infer("simple", simple_inputs())
    result, error = results.get(timeout=30)
    client.stop_stream()
    assert error is None
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), DATA * 2)


def pb_health_request() -> Any:
    from kiln.frontends.grpc import health_pb2

    return health_pb2.HealthCheckRequest()


@pytest.mark.parametrize("implementation", ["kiln", "grpcio"])
def test_grpc_port_in_use_fails_the_start(
    make_server: type[KilnProcess], example_repo: Path, implementation: str
) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        args = ["--grpc-implementation", implementation, "--model-control-mode", "explicit"]
        process = make_server(example_repo, args=args, grpc_port=port).start(wait_ready=False)
        assert process.proc is not None
        assert process.proc.wait(60) == 1
    assert f"gRPC cannot listen on 127.0.0.1:{port}" in process.log()
