"""Request parameters are KServe v2 parameters: a flat map of scalars, bounded in count
and size, checked once in core for every frontend; and a batch that cannot be sent to a
Python model's worker fails alone instead of wedging the model (issue #25, finding 6)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import requests
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from kiln.backends.base import InstanceSpec
from kiln.backends.python.backend import PythonBackend
from kiln.config.loader import parse_config_text
from kiln.core.errors import KilnError, Status
from kiln.core.stats import RequestTimes
from kiln.core.types import DataType, InferenceRequest, InferInput
from kiln.scheduling.base import Instance, Job
from kiln.server.server import ControlMode, Server, ServerOptions
from tests.conftest import KilnProcess

IMAGE = np.zeros((1, 28, 28, 1), dtype=np.uint8)
MODEL = "python_preprocess"  # a Python-backend model of the example repository
MAX_PARAMETERS = 64  # per request, input and output (docs/security.md)
MAX_PARAMETER_STRING = 64 * 1024


def _nested(depth: int) -> dict[str, Any]:
    value: dict[str, Any] = {}
    for _ in range(depth):
        value = {"k": value}
    return value


def _image_body(**parameters: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "inputs": [
            {"name": "IMAGE", "datatype": "UINT8", "shape": [1, 28, 28, 1],
             "data": IMAGE.ravel().tolist()}
        ]
    }  # fmt: skip
    if parameters:
        body["parameters"] = parameters
    return body


@pytest.fixture
def base(kiln_server: KilnProcess) -> str:
    return f"http://{kiln_server.http_url}"


def _infer(base: str, body: Any, model: str = MODEL) -> requests.Response:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    return requests.post(f"{base}/v2/models/{model}/infer", data=data, timeout=30)


def _still_serves(base: str) -> None:
    # A wedged model never answers: the timeout turns that into a failure, not a hang.
    response = _infer(base, _image_body())
    assert response.status_code == 200, response.text
    assert response.json()["outputs"][0]["shape"] == [1, 1, 28, 28]


def test_deeply_nested_parameters_are_refused_and_the_python_model_keeps_serving(
    base: str,
) -> None:
    # ~1,020 levels: orjson parses it (up to 1,024), json.dumps in the backend's wiring
    # did not; written by hand, as Python's own encoders stop earlier
    deep = '{"k":' * 1020 + "{}" + "}" * 1020
    body = json.dumps(_image_body(deep="DEEP")).replace('"DEEP"', deep)
    response = _infer(base, body.encode())
    assert response.status_code == 400, response.text
    message = response.json()["error"]
    assert f"model '{MODEL}'" in message and "parameter 'deep'" in message
    _still_serves(base)
    _still_serves(base)


def test_nested_parameters_over_the_binary_extension_are_refused(base: str) -> None:
    header = {
        "parameters": {"deep": _nested(50)},
        "inputs": [{"name": "IMAGE", "datatype": "UINT8", "shape": [1, 28, 28, 1],
                    "parameters": {"binary_data_size": IMAGE.nbytes}}],
    }  # fmt: skip
    head = json.dumps(header).encode()
    response = requests.post(
        f"{base}/v2/models/{MODEL}/infer",
        data=head + IMAGE.tobytes(),
        headers={"Inference-Header-Content-Length": str(len(head))},
        timeout=30,
    )
    assert response.status_code == 400, response.text
    assert "parameter 'deep'" in response.json()["error"]
    _still_serves(base)


@pytest.mark.parametrize(
    ("where", "value", "words"),
    [
        ("request", [1, 2], "must be a bool, an integer, a double or a string, got an array"),
        ("request", None, "got null"),
        ("input", {"a": 1}, "got an object"),
        ("output", [], "got an array"),
        ("request", "x" * (MAX_PARAMETER_STRING + 1), "more than"),
    ],
)
def test_non_scalar_parameters_are_refused_naming_model_and_parameter(
    base: str, where: str, value: Any, words: str
) -> None:
    body = _image_body()
    if where == "request":
        body["parameters"] = {"bad": value}
    elif where == "input":
        body["inputs"][0]["parameters"] = {"bad": value}
    else:
        body["outputs"] = [{"name": "NORMALIZED", "parameters": {"bad": value}}]
    response = _infer(base, body)
    assert response.status_code == 400, response.text
    message = response.json()["error"]
    assert "parameter 'bad'" in message and f"model '{MODEL}'" in message
    assert words in message
    if where == "input":
        assert "input 'IMAGE'" in message
    _still_serves(base)


def test_too_many_parameters_are_refused_over_http_and_grpc(
    base: str, kiln_server: KilnProcess
) -> None:
    many = {f"p{i}": i for i in range(MAX_PARAMETERS + 1)}
    response = _infer(base, _image_body(**many))
    assert response.status_code == 400, response.text
    assert f"more than the limit of {MAX_PARAMETERS}" in response.json()["error"]
    assert f"model '{MODEL}'" in response.json()["error"]
    assert _infer(base, _image_body(**dict(list(many.items())[:8]))).status_code == 200

    client = grpcclient.InferenceServerClient(kiln_server.grpc_url)
    image = grpcclient.InferInput("IMAGE", [1, 28, 28, 1], "UINT8")
    image.set_data_from_numpy(IMAGE)
    with pytest.raises(InferenceServerException) as err:
        client.infer(MODEL, [image], parameters=many)
    assert err.value.status() == "StatusCode.INVALID_ARGUMENT"
    assert f"more than the limit of {MAX_PARAMETERS}" in err.value.message()
    result = client.infer(MODEL, [image], parameters={"p": "fine", "n": 3, "b": True})
    assert result.as_numpy("NORMALIZED").shape == (1, 1, 28, 28)


def test_the_python_api_refuses_the_same_parameters(example_repo: Path) -> None:
    async def run() -> KilnError:
        server = Server(ServerOptions([example_repo], ControlMode.EXPLICIT, ["simple"]))
        await server.start()
        try:
            row = np.arange(16, dtype=np.int32).reshape(1, 16)
            request = InferenceRequest("simple", parameters={"deep": _nested(3)})
            for name in ("INPUT0", "INPUT1"):
                request.inputs.append(InferInput(name, DataType.INT32, (1, 16), row))
            with pytest.raises(KilnError) as err:
                await server.infer(request)
            request.parameters = {"big": 2**64}  # JSON cannot send it; Python can
            with pytest.raises(KilnError, match=r"'big' .* out of the int64/uint64 range"):
                await server.infer(request)
            request.parameters = {"fine": 1}
            assert (await server.infer(request)).outputs  # scalars pass
            return err.value
        finally:
            await server.stop()

    error = asyncio.run(run())
    assert error.status is Status.INVALID_ARG
    assert "parameter 'deep'" in error.message and "model 'simple'" in error.message


# ---- a batch the worker never got ---------------------------------------------------------

DOUBLE = """
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        return [pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor(
            "OUT", pb_utils.get_input_tensor_by_name(r, "IN").as_numpy() * 2)])
            for r in requests]
"""

CONFIG = """
name: "double"
backend: "python"
max_batch_size: 4
input [ { name: "IN" data_type: TYPE_FP32 dims: [ -1 ] } ]
output [ { name: "OUT" data_type: TYPE_FP32 dims: [ -1 ] } ]
"""


@pytest.fixture
def instance(tmp_path: Path) -> Iterator[Instance]:
    version = tmp_path / "double" / "1"
    version.mkdir(parents=True)
    (version / "model.py").write_text(DOUBLE)
    spec = InstanceSpec(name="double_0", kind="cpu", device_id=0, index=0, total_instances=1)
    inst = Instance(PythonBackend(parse_config_text(CONFIG), version, spec), "double")
    yield inst
    inst.close()


def _job(value: float, parameters: dict[str, Any] | None = None) -> Job:
    return Job(
        {"IN": np.full((1, 2), value, np.float32)}, ["OUT"], 1, RequestTimes(), parameters or {}
    )


async def test_a_batch_that_cannot_be_wired_fails_alone_and_the_model_keeps_serving(
    instance: Instance,
) -> None:
    """Core refuses what the wiring cannot serialize, but should anything else fail
    between queueing a batch and sending it, the pipe must forget that batch: before, every
    later answer went to it and the model hung until a reload."""
    backend = instance.backend
    assert isinstance(backend, PythonBackend)
    circular: dict[str, Any] = {}
    circular["self"] = circular  # json.dumps raises on it, as it did 1,020 levels deep
    flags_end = []
    for _ in range(4):
        with pytest.raises(KilnError) as err:
            await asyncio.wait_for(instance.submit_requests([_job(1, circular)]), 30)
        assert err.value.status is Status.INTERNAL
        assert "model 'double'" in err.value.message and "ValueError" in err.value.message
        outcomes = (await asyncio.wait_for(instance.submit_requests([_job(2), _job(3)]), 30))[0]
        assert [o["OUT"].tolist() for o in outcomes] == [[[4, 4]], [[6, 6]]]
        flags_end.append(backend.session.flag_pool.arena.cursor)
    # the failed batches' cancellation bytes went back to the pool: no byte per failure
    assert flags_end[1:] == flags_end[:-1]
