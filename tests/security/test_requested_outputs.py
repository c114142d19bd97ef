"""A request names each output at most once (Triton: "output '...' already exists in
request"). A list of one output repeated used to be answered once per entry, and the HTTP
encoder looked each answered output up in the whole list: 100,000 copies of ``OUTPUT0``
in a 2 MB body held the event loop for minutes while no other client was answered."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import requests

from kiln.core.errors import KilnError, Status
from kiln.core.types import DataType, InferenceRequest, InferInput, RequestedOutput
from kiln.frontends.grpc import grpc_service_pb2 as pb
from kiln.frontends.grpc.services import inference_stub
from kiln.server.server import ControlMode, Server, ServerOptions
from tests.conftest import KilnProcess

DATA = list(range(16))
MESSAGE = "output 'OUTPUT0' requested more than once for model 'simple'"


@pytest.fixture
def base(kiln_server: KilnProcess) -> str:
    return f"http://{kiln_server.http_url}"


@pytest.fixture
def stub(kiln_server: KilnProcess) -> Iterator[Any]:
    with grpc.insecure_channel(kiln_server.grpc_url) as channel:
        yield inference_stub(channel)


def _body(outputs: list[dict[str, Any]]) -> dict[str, Any]:
    tensor = {"datatype": "INT32", "shape": [1, 16], "data": DATA}
    return {
        "inputs": [dict(tensor, name="INPUT0"), dict(tensor, name="INPUT1")],
        "outputs": outputs,
    }


@pytest.mark.parametrize("copies", [2, 20_000])
def test_an_output_named_twice_is_refused_over_http(base: str, copies: int) -> None:
    outputs = [{"name": "OUTPUT0"}] * copies
    response = requests.post(f"{base}/v2/models/simple/infer", json=_body(outputs), timeout=60)
    assert response.status_code == 400, response.text[:200]
    assert response.json()["error"] == MESSAGE
    # each once, in any order, is still fine
    both = [{"name": "OUTPUT1"}, {"name": "OUTPUT0", "parameters": {"binary_data": False}}]
    response = requests.post(f"{base}/v2/models/simple/infer", json=_body(both), timeout=60)
    assert response.status_code == 200, response.text
    assert [o["name"] for o in response.json()["outputs"]] == ["OUTPUT1", "OUTPUT0"]


def test_an_output_named_twice_is_refused_over_grpc(stub: Any) -> None:
    msg = pb.ModelInferRequest(model_name="simple")
    for name in ("INPUT0", "INPUT1"):
        msg.inputs.add(name=name, datatype="INT32", shape=[1, 16])
        msg.raw_input_contents.append(np.arange(16, dtype=np.int32).tobytes())
    msg.outputs.add(name="OUTPUT0")
    msg.outputs.add(name="OUTPUT0")
    with pytest.raises(grpc.RpcError) as err:
        stub.ModelInfer(msg, timeout=30)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details() == MESSAGE


def test_the_python_api_refuses_an_output_named_twice(example_repo: Path) -> None:
    async def run() -> KilnError:
        server = Server(ServerOptions([example_repo], ControlMode.EXPLICIT, ["simple"]))
        await server.start()
        try:
            row = np.arange(16, dtype=np.int32).reshape(1, 16)
            request = InferenceRequest("simple")
            for name in ("INPUT0", "INPUT1"):
                request.inputs.append(InferInput(name, DataType.INT32, (1, 16), row))
            request.outputs = [RequestedOutput("OUTPUT0"), RequestedOutput("OUTPUT0")]
            with pytest.raises(KilnError) as err:
                await server.infer(request)
            return err.value
        finally:
            await server.stop()

    error = asyncio.run(run())
    assert error.status is Status.INVALID_ARG
    assert error.message == MESSAGE
