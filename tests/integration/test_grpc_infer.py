"""Inference over gRPC with the real tritonclient (sync, async callbacks, stream, aio) and
with kiln's own stubs (typed contents), checked against onnxruntime run in-process."""

from __future__ import annotations

import queue
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import onnxruntime as ort
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as aioclient
from tritonclient.utils import InferenceServerException, deserialize_bytes_tensor

from kiln.frontends.grpc import grpc_service_pb2 as pb
from kiln.frontends.grpc.services import inference_stub
from tests.conftest import KilnProcess

RNG = np.random.default_rng(3)

# model -> {input: (datatype, shape)} for a batch of 2
INPUTS: dict[str, dict[str, tuple[str, list[int]]]] = {
    "simple": {"INPUT0": ("INT32", [2, 16]), "INPUT1": ("INT32", [2, 16])},
    "simple_string": {"INPUT0": ("BYTES", [2, 16]), "INPUT1": ("BYTES", [2, 16])},
    "mlp": {"INPUT": ("FP32", [2, 64])},
    "cnn": {"IMAGE": ("FP32", [2, 1, 28, 28])},
}


def sample(model: str) -> dict[str, np.ndarray]:
    arrays = {}
    for name, (datatype, shape) in INPUTS[model].items():
        if datatype == "INT32":
            arrays[name] = RNG.integers(-1000, 1000, shape, dtype=np.int32)
        elif datatype == "BYTES":
            ints = RNG.integers(-1000, 1000, shape)
            arrays[name] = np.vectorize(lambda n: str(n).encode(), otypes=[object])(ints)
        else:
            arrays[name] = RNG.standard_normal(shape).astype(np.float32)
    return arrays


def run_ort(repo: Path, model: str, arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    session = ort.InferenceSession(str(repo / model / "1" / "model.onnx"))
    feed = {
        k: np.vectorize(bytes.decode, otypes=[object])(v) if v.dtype == object else v
        for k, v in arrays.items()
    }
    names = [o.name for o in session.get_outputs()]
    out = dict(zip(names, session.run(names, feed), strict=True))
    return {
        k: np.vectorize(str.encode, otypes=[object])(v) if v.dtype == object else v
        for k, v in out.items()
    }


def infer_inputs(module: Any, model: str, arrays: dict[str, np.ndarray]) -> list[Any]:
    items = []
    for name, array in arrays.items():
        item = module.InferInput(name, list(array.shape), INPUTS[model][name][0])
        item.set_data_from_numpy(array)
        items.append(item)
    return items


def check(result: Any, expected: dict[str, np.ndarray]) -> None:
    for name, want in expected.items():
        got = result.as_numpy(name)
        assert got is not None, f"output {name} missing"
        if want.dtype == object:
            np.testing.assert_array_equal(got, want)
        else:
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("model", sorted(INPUTS))
def test_sync_infer_matches_onnxruntime(
    kiln_server: KilnProcess, example_repo: Path, model: str
) -> None:
    arrays = sample(model)
    client = grpcclient.InferenceServerClient(kiln_server.grpc_url)
    result = client.infer(model, infer_inputs(grpcclient, model, arrays), request_id="r1")
    assert result.get_response().id == "r1"
    assert result.get_response().model_name == model
    check(result, run_ort(example_repo, model, arrays))


def test_requested_outputs_come_back_in_request_order(kiln_server: KilnProcess) -> None:
    arrays = sample("simple")
    client = grpcclient.InferenceServerClient(kiln_server.grpc_url)
    outputs = [grpcclient.InferRequestedOutput("OUTPUT1")]
    result = client.infer("simple", infer_inputs(grpcclient, "simple", arrays), outputs=outputs)
    response = result.get_response()
    assert [o.name for o in response.outputs] == ["OUTPUT1"]
    assert len(response.raw_output_contents) == 1
    np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), arrays["INPUT0"] - arrays["INPUT1"])


def test_async_infer_callbacks(kiln_server: KilnProcess, example_repo: Path) -> None:
    client = grpcclient.InferenceServerClient(kiln_server.grpc_url)
    done: queue.Queue[tuple[Any, Any]] = queue.Queue()
    sent = {}
    for i, model in enumerate(["mlp", "cnn", "simple", "simple_string"] * 2):
        arrays = sample(model)
        sent[str(i)] = (model, arrays)
        client.async_infer(
            model,
            infer_inputs(grpcclient, model, arrays),
            callback=lambda result, error: done.put((result, error)),
            request_id=str(i),
        )
    for _ in range(len(sent)):
        result, error = done.get(timeout=30)
        assert error is None
        model, arrays = sent.pop(result.get_response().id)
        check(result, run_ort(example_repo, model, arrays))
    assert not sent


def test_stream_many_in_flight_with_an_error_mid_stream(
    kiln_server: KilnProcess, example_repo: Path
) -> None:
    client = grpcclient.InferenceServerClient(kiln_server.grpc_url)
    done: queue.Queue[tuple[Any, Any]] = queue.Queue()
    client.start_stream(callback=lambda result, error: done.put((result, error)))
    try:
        expected = {}
        for i in range(6):
            model = "mlp" if i % 2 else "simple"
            arrays = sample(model)
            if i == 3:  # a bad request in the middle: wrong datatype for INPUT
                bad = grpcclient.InferInput("INPUT", [2, 64], "FP64")
                bad.set_data_from_numpy(arrays["INPUT"].astype(np.float64))
                client.async_stream_infer(model, [bad], request_id="bad")
                continue
            expected[str(i)] = run_ort(example_repo, model, arrays)
            client.async_stream_infer(
                model, infer_inputs(grpcclient, model, arrays), request_id=str(i)
            )
        errors = []
        for _ in range(6):
            result, error = done.get(timeout=30)
            if error is not None:
                errors.append(error)
                continue
            check(result, expected.pop(result.get_response().id))
        assert not expected
        assert len(errors) == 1
        assert "unexpected datatype TYPE_FP64 for inference input 'INPUT'" in errors[0].message()
        # the stream is still open after the error
        arrays = sample("simple")
        client.async_stream_infer(
            "simple", infer_inputs(grpcclient, "simple", arrays), request_id="after"
        )
        result, error = done.get(timeout=30)
        assert error is None and result.get_response().id == "after"
    finally:
        client.stop_stream()


async def test_aio_client(kiln_server: KilnProcess, example_repo: Path) -> None:
    async with aioclient.InferenceServerClient(kiln_server.grpc_url) as client:
        assert await client.is_server_live()
        assert await client.is_model_ready("cnn")
        arrays = sample("cnn")
        result = await client.infer("cnn", infer_inputs(aioclient, "cnn", arrays))
        check(result, run_ort(example_repo, "cnn", arrays))

        async def requests() -> Any:
            for i in range(3):
                arrays = sample("simple")
                yield {
                    "model_name": "simple",
                    "inputs": infer_inputs(aioclient, "simple", arrays),
                    "request_id": str(i),
                }
            yield {"model_name": "no_such_model", "inputs": [], "request_id": "x"}

        ids, errors = set(), []
        async for result, error in client.stream_infer(requests()):
            if error is not None:
                errors.append(error)
            else:
                ids.add(result.get_response().id)
        assert ids == {"0", "1", "2"}
        assert len(errors) == 1 and "no_such_model" in errors[0].message()
        with pytest.raises(InferenceServerException) as err:
            await client.infer("no_such_model", [])
        assert err.value.status() == "StatusCode.NOT_FOUND"


def test_typed_contents_with_kiln_stubs(kiln_server: KilnProcess) -> None:
    a = RNG.integers(-50, 50, (1, 16), dtype=np.int32)
    b = RNG.integers(-50, 50, (1, 16), dtype=np.int32)
    msg = pb.ModelInferRequest(model_name="simple", id="typed")
    for name, array in (("INPUT0", a), ("INPUT1", b)):
        msg.inputs.add(name=name, datatype="INT32", shape=[1, 16]).contents.int_contents.extend(
            array.ravel().tolist()
        )
    strings = pb.ModelInferRequest(model_name="simple_string")
    for name, array in (("INPUT0", a), ("INPUT1", b)):
        tensor = strings.inputs.add(name=name, datatype="BYTES", shape=[1, 16])
        tensor.contents.bytes_contents.extend(str(v).encode() for v in array.ravel())
    with grpc.insecure_channel(kiln_server.grpc_url) as channel:
        stub = inference_stub(channel)
        response = stub.ModelInfer(msg)
        assert response.id == "typed"
        assert [o.name for o in response.outputs] == ["OUTPUT0", "OUTPUT1"]
        out0 = np.frombuffer(response.raw_output_contents[0], "<i4").reshape(1, 16)
        np.testing.assert_array_equal(out0, a + b)
        response = stub.ModelInfer(strings)
        got = deserialize_bytes_tensor(response.raw_output_contents[1])
        assert [int(v) for v in got] == (a - b).ravel().tolist()
