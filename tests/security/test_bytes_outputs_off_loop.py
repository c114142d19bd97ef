"""A BYTES output of many elements is serialized off the event loop: in gRPC's
``raw_output_contents`` and in HTTP's binary tensor extension.

Each BYTES element costs Python work (its length and its bytes): 16 M of them held every
client for 3.9 s while the response was built on the loop. The checks are which thread
ran the serialization, and that the loop answers another call while a worker holds it;
never how long anything took.
"""

from __future__ import annotations

import asyncio
import struct
import threading
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import orjson
import pytest

from kiln.frontends import tensors
from kiln.frontends.grpc import codec as grpc_codec
from kiln.frontends.grpc import grpc_service_pb2 as pb
from kiln.frontends.grpc.servicer import InferenceServicer
from kiln.frontends.http.app import HttpFrontend
from kiln.frontends.tensors import OFF_LOOP_ENCODE_ELEMENTS
from kiln.server.server import ControlMode, Server, ServerOptions

MODEL = """
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        return [
            pb_utils.InferenceResponse(
                [pb_utils.Tensor("T", pb_utils.get_input_tensor_by_name(r, "S").as_numpy())]
            )
            for r in requests
        ]
"""
CONFIG = """
name: "strings"
backend: "python"
max_batch_size: 0
input [ { name: "S" data_type: TYPE_STRING dims: [ -1 ] } ]
output [ { name: "T" data_type: TYPE_STRING dims: [ -1 ] } ]
"""
COUNT = 3 * OFF_LOOP_ENCODE_ELEMENTS
VALUES = [b"k%d" % i for i in range(COUNT)]


def _raw(values: list[bytes]) -> bytes:
    return b"".join(struct.pack("<I", len(v)) + v for v in values)


class _Recorder:
    """Wraps a ``serialize_bytes``: the thread and element count of each call, and a gate
    that holds a call made off the loop until the test releases it."""

    def __init__(self) -> None:
        self.loop_thread = threading.get_ident()
        self.calls: list[tuple[int, int]] = []
        self.entered = threading.Event()
        self.release = threading.Event()
        self.release.set()

    def wrap(self, real: Callable[[np.ndarray], bytes]) -> Callable[[np.ndarray], bytes]:
        def recording(data: np.ndarray) -> bytes:
            self.calls.append((threading.get_ident(), int(data.size)))
            if threading.get_ident() != self.loop_thread:
                self.entered.set()
                assert self.release.wait(60), "the test never released the worker"
            return real(data)

        return recording

    def on_loop(self) -> list[int]:
        return [n for t, n in self.calls if t == self.loop_thread]


@pytest.fixture
async def server(tmp_path: Path) -> AsyncIterator[Server]:
    (tmp_path / "strings" / "1").mkdir(parents=True)
    (tmp_path / "strings" / "1" / "model.py").write_text(MODEL)
    (tmp_path / "strings" / "config.pbtxt").write_text(CONFIG)
    server = Server(ServerOptions([tmp_path], ControlMode.EXPLICIT, ["strings"]))
    await server.start()
    yield server
    await server.stop()


class _Context:
    """What a gRPC handler uses of its context here: metadata and abort."""

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return ()

    async def abort(self, code: Any, details: str = "") -> None:
        raise AssertionError(f"the call failed: {code} {details}")


def _message(values: list[bytes]) -> pb.ModelInferRequest:
    message = pb.ModelInferRequest(model_name="strings")
    message.inputs.add(name="S", datatype="BYTES", shape=[len(values)])
    message.raw_input_contents.append(_raw(values))
    return message


async def test_a_grpc_response_of_many_bytes_elements_is_built_off_the_loop(
    server: Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    recorder = _Recorder()
    monkeypatch.setattr(grpc_codec, "serialize_bytes", recorder.wrap(tensors.serialize_bytes))
    servicer = InferenceServicer(server)
    recorder.release.clear()
    call = asyncio.create_task(servicer.ModelInfer(_message(VALUES), _Context()))
    assert await asyncio.to_thread(recorder.entered.wait, 60)
    # a worker holds the response's serialization: the loop answers another call
    live = await servicer.ServerLive(pb.ServerLiveRequest(), _Context())
    assert live.live
    recorder.release.set()
    answer = await call
    assert answer.outputs[0].name == "T" and list(answer.outputs[0].shape) == [COUNT]
    assert answer.raw_output_contents[0] == _raw(VALUES)
    assert recorder.on_loop() == [] and [n for _, n in recorder.calls] == [COUNT]


async def test_a_small_grpc_response_is_built_in_place(
    server: Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    recorder = _Recorder()
    monkeypatch.setattr(grpc_codec, "serialize_bytes", recorder.wrap(tensors.serialize_bytes))
    few = VALUES[:8]
    answer = await InferenceServicer(server).ModelInfer(_message(few), _Context())
    assert answer.raw_output_contents[0] == _raw(few)
    assert recorder.on_loop() == [len(few)]  # no thread hop for a small one


async def test_an_http_binary_output_of_many_bytes_elements_is_built_off_the_loop(
    server: Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    recorder = _Recorder()
    monkeypatch.setattr(tensors, "serialize_bytes", recorder.wrap(tensors.serialize_bytes))
    raw = _raw(VALUES)
    header = orjson.dumps(
        {
            "inputs": [
                {
                    "name": "S",
                    "datatype": "BYTES",
                    "shape": [COUNT],
                    "parameters": {"binary_data_size": len(raw)},
                }
            ],
            "outputs": [{"name": "T", "parameters": {"binary_data": True}}],
        }
    )
    app = HttpFrontend(server).app()
    transport = httpx.ASGITransport(app=app)  # type: ignore[arg-type]
    async with httpx.AsyncClient(transport=transport, base_url="http://kiln") as client:
        recorder.release.clear()
        call = asyncio.create_task(
            client.post(
                "/v2/models/strings/infer",
                content=header + raw,
                headers={"Inference-Header-Content-Length": str(len(header))},
            )
        )
        assert await asyncio.to_thread(recorder.entered.wait, 60)
        ready = await client.get("/v2/health/ready")  # answered while a worker holds it
        assert ready.status_code == 200
        recorder.release.set()
        answer = await call
    assert answer.status_code == 200, answer.text
    json_length = int(answer.headers["Inference-Header-Content-Length"])
    out = orjson.loads(answer.content[:json_length])["outputs"][0]
    assert out["parameters"]["binary_data_size"] == len(raw)
    assert answer.content[json_length:] == raw
    assert recorder.on_loop() == [] and [n for _, n in recorder.calls] == [COUNT]
