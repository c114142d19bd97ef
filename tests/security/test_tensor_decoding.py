"""A tensor's declared shape never sizes an allocation before the data backs it, and a big
JSON tensor is decoded without stalling other clients (issue #25, findings 7 and 8).

Memory is read from the server process's ``/proc/PID/status`` (VmHWM, the peak resident
set); that a decode leaves the event loop free is checked by which thread ran it, with
a gate holding it while another client is answered: behaviour checks, not timings."""

from __future__ import annotations

import asyncio
import json
import struct
import threading
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import grpc
import httpx
import numpy as np
import pytest
import requests

from kiln.frontends.grpc import grpc_service_pb2 as pb
from kiln.frontends.grpc import servicer as servicer_module
from kiln.frontends.grpc.listener import start_grpc
from kiln.frontends.grpc.services import inference_stub
from kiln.frontends.http import app as app_module
from kiln.frontends.http import generate as generate_module
from kiln.frontends.http.app import HttpFrontend
from kiln.frontends.tensors import OFF_LOOP_DECODE_BYTES
from kiln.server.server import ControlMode, Server, ServerOptions
from tests.conftest import KilnProcess, free_port

MiB = 1 << 20
# np.empty(2**27, dtype=object) is 1 GiB of pointers: the cost of one 230-byte request
HUGE = 2**27


def _peak_rss(server: KilnProcess) -> int:
    assert server.proc is not None
    status = Path(f"/proc/{server.proc.pid}/status").read_text()
    line = next(x for x in status.splitlines() if x.startswith("VmHWM:"))
    return int(line.split()[1]) * 1024


def _one_bytes_element() -> bytes:
    return struct.pack("<I", 3) + b"abc"


def _binary_bytes_request(base: str, shape: list[int]) -> requests.Response:
    raw = _one_bytes_element()
    header = {
        "inputs": [
            {"name": name, "datatype": "BYTES", "shape": shape,
             "parameters": {"binary_data_size": len(raw)}}
            for name in ("INPUT0", "INPUT1")
        ]
    }  # fmt: skip
    head = json.dumps(header).encode()
    return requests.post(
        f"{base}/v2/models/simple_string/infer",
        data=head + raw + raw,
        headers={"Inference-Header-Content-Length": str(len(head))},
        timeout=60,
    )


def _grpc_bytes_request(server: KilnProcess, shape: list[int]) -> grpc.RpcError:
    msg = pb.ModelInferRequest(model_name="simple_string")
    for name in ("INPUT0", "INPUT1"):
        msg.inputs.add(name=name, datatype="BYTES", shape=shape)
        msg.raw_input_contents.append(_one_bytes_element())
    with grpc.insecure_channel(server.grpc_url) as channel, pytest.raises(grpc.RpcError) as err:
        inference_stub(channel).ModelInfer(msg, timeout=60)
    return err.value


@pytest.fixture
def base(kiln_server: KilnProcess) -> str:
    return f"http://{kiln_server.http_url}"


@pytest.mark.parametrize("shape", [[HUGE], [2**31]])
def test_a_bytes_shape_the_buffer_cannot_hold_is_refused_before_allocating(
    kiln_server: KilnProcess, base: str, shape: list[int]
) -> None:
    before = _peak_rss(kiln_server)
    response = _binary_bytes_request(base, shape)
    assert response.status_code == 400, response.text
    message = response.json()["error"]
    assert "input 'INPUT0'" in message and f"ends after 1 of {shape[0]} elements" in message
    err = _grpc_bytes_request(kiln_server, shape)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"ends after 1 of {shape[0]} elements" in (err.details() or "")
    assert _peak_rss(kiln_server) - before < 200 * MiB
    assert _binary_bytes_request(base, [1, 1]).status_code == 400  # (shape [1,16] wanted)


def _strings_for_an_int_tensor(shape: list[int], held: int) -> dict[str, Any]:
    # NumPy guessing a type for this data sizes every element as the longest string
    data = ["x" * MiB] + ["y"] * (held - 1)
    tensor = {"datatype": "INT32", "shape": shape, "data": data}
    return {"inputs": [dict(tensor, name="INPUT0"), dict(tensor, name="INPUT1")]}


@pytest.mark.parametrize(
    ("shape", "held", "words"),
    [
        ([1], 300, "shape [1] expects 1 elements, but 'data' holds 300"),  # longer
        ([400], 200, "shape [400] expects 400 elements, but 'data' holds 200"),  # shorter
    ],
)
def test_json_data_is_checked_against_the_shape_before_any_array_is_built(
    kiln_server: KilnProcess, base: str, shape: list[int], held: int, words: str
) -> None:
    before = _peak_rss(kiln_server)
    body = json.dumps(_strings_for_an_int_tensor(shape, held)).encode()
    response = requests.post(f"{base}/v2/models/simple/infer", data=body, timeout=60)
    assert response.status_code == 400, response.text
    assert "input 'INPUT0'" in response.json()["error"]
    assert words in response.json()["error"]
    # 1 MiB of JSON: a guessed <U1048576 array of 200 elements would be 800 MiB
    assert _peak_rss(kiln_server) - before < 200 * MiB


class _DecodeGate:
    """Wraps a decode function: records which thread ran it, and holds the decode until the
    test has had another client answered. Called on the event loop it fails at once (the
    gate would hold the loop itself): the request is then a 500, not the expected 400."""

    def __init__(self, real: Callable[..., Any]) -> None:
        self.real = real
        self.loop_thread = threading.get_ident()  # made on the test's event loop
        self.threads: list[int] = []
        self.entered = threading.Event()
        self.release = threading.Event()

    def __call__(self, *args: Any) -> Any:
        self.threads.append(threading.get_ident())
        self.entered.set()
        if threading.get_ident() == self.loop_thread:
            raise AssertionError("a big request was decoded on the event loop")
        assert self.release.wait(60), "the test never released the decode"
        return self.real(*args)

    async def held(self) -> None:
        """Returns once the decode is being held at the gate."""
        assert await asyncio.to_thread(self.entered.wait, 60), "the decode never started"


@pytest.fixture
async def in_process(example_repo: Path) -> AsyncIterator[Server]:
    server = Server(
        ServerOptions([example_repo], ControlMode.EXPLICIT, ["simple", "simple_string"])
    )
    await server.start()
    yield server
    await server.stop()


@pytest.mark.parametrize("route", ["infer", "generate"])
async def test_a_big_json_body_is_decoded_on_a_worker_while_other_clients_are_answered(
    in_process: Server, monkeypatch: pytest.MonkeyPatch, route: str
) -> None:
    """A 2 MB JSON tensor (KServe infer, or Triton's generate extension) was decoded on the
    event loop: 24 MB held every other client for a second. Over 1 MiB it decodes on a
    worker thread: the test holds that decode at a gate and has a health probe answered
    meanwhile, then checks the body was decoded (and refused by core). Which thread decoded
    is checked, never how long anything took."""
    module: Any = app_module if route == "infer" else generate_module
    name = "decode_request" if route == "infer" else "_decode"
    gate = _DecodeGate(getattr(module, name))
    monkeypatch.setattr(module, name, gate)
    count = 1_000_000
    data = b",".join([b"1"] * count)
    if route == "infer":
        body = b'{"inputs":[{"name":"INPUT0","datatype":"INT32","shape":[%d],"data":[%s]}]}' % (
            count,
            data,
        )
    else:
        body = b'{"INPUT0":[%s]}' % data
    assert len(body) > OFF_LOOP_DECODE_BYTES
    app = HttpFrontend(in_process).app()
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://kiln") as client:
        big = asyncio.create_task(client.post(f"/v2/models/simple/{route}", content=body))
        await gate.held()
        assert (await client.get("/v2/health/live")).status_code == 200
        gate.release.set()
        answer = await big
    assert answer.status_code == 400, answer.text  # decoded, then refused by core
    assert "missing required input(s) ['INPUT1']" in answer.json()["error"]
    assert len(gate.threads) == 1 and gate.threads[0] != gate.loop_thread


@pytest.mark.parametrize("kind", ["typed", "bytes"])
async def test_a_big_grpc_message_is_decoded_on_a_worker_while_other_clients_are_answered(
    in_process: Server, monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    """As above, over gRPC (kiln's own transport): typed ``contents`` become an array value
    by value, and BYTES raw contents are walked element by element; both ran on the event
    loop (24 MB held every HTTP and gRPC client for over a second)."""
    gate = _DecodeGate(servicer_module.decode_request)
    monkeypatch.setattr(servicer_module, "decode_request", gate)
    count = 1_200_000 if kind == "typed" else 300_000
    msg = pb.ModelInferRequest(model_name="simple" if kind == "typed" else "simple_string")
    if kind == "typed":
        tensor = msg.inputs.add(name="INPUT0", datatype="INT32", shape=[1, count])
        tensor.contents.int_contents.extend([1] * count)
    else:
        msg.inputs.add(name="INPUT0", datatype="BYTES", shape=[1, count])
        msg.raw_input_contents.append(struct.pack("<I", 0) * count)
    assert msg.ByteSize() > OFF_LOOP_DECODE_BYTES
    port = free_port()
    listener = await start_grpc(in_process, "127.0.0.1", port)
    target = f"127.0.0.1:{port}"

    def infer() -> grpc.RpcError:
        with grpc.insecure_channel(target) as channel, pytest.raises(grpc.RpcError) as err:
            inference_stub(channel).ModelInfer(msg, timeout=60)
        return err.value

    def live() -> bool:
        with grpc.insecure_channel(target) as channel:
            return bool(inference_stub(channel).ServerLive(pb.ServerLiveRequest(), timeout=60).live)

    try:
        big = asyncio.create_task(asyncio.to_thread(infer))
        await gate.held()
        assert await asyncio.to_thread(live)  # another gRPC client, answered meanwhile
        gate.release.set()
        err = await big
    finally:
        gate.release.set()
        await listener.stop(0)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err.details()  # decoded, refused
    assert "missing required input(s) ['INPUT1']" in (err.details() or "")
    assert len(gate.threads) == 1 and gate.threads[0] != gate.loop_thread


def test_max_tensor_elements_is_applied_before_decoding_and_to_streams(
    make_server: type[KilnProcess], example_repo: Path
) -> None:
    server = make_server(example_repo, args=["--max-tensor-elements", "1000"]).start()
    tensor = {"datatype": "INT32", "shape": [1, 2000], "data": ["not a number"] * 2000}
    body = {"inputs": [dict(tensor, name="INPUT0"), dict(tensor, name="INPUT1")]}
    response = requests.post(
        f"http://{server.http_url}/v2/models/simple/infer", json=body, timeout=30
    )
    assert response.status_code == 400, response.text
    message = response.json()["error"]
    assert "input 'INPUT0' for model 'simple' has 2000 elements" in message
    assert "(--max-tensor-elements)" in message
    # Triton's generate extension too: before its data is decoded
    response = requests.post(
        f"http://{server.http_url}/v2/models/simple/generate",
        json={"INPUT0": ["not a number"] * 2000, "INPUT1": 1},
        timeout=30,
    )
    assert response.status_code == 400, response.text
    message = response.json()["error"]
    assert "input 'INPUT0' for model 'simple' has 2000 elements" in message
    assert "(--max-tensor-elements)" in message
    # a decoupled model answers on a stream: the limit holds there too
    msg = pb.ModelInferRequest(model_name="repeat_int32", id="big")
    msg.inputs.add(name="IN", datatype="INT32", shape=[2000])
    msg.raw_input_contents.append(np.arange(2000, dtype=np.int32).tobytes())
    with grpc.insecure_channel(server.grpc_url) as channel:
        replies = list(inference_stub(channel).ModelStreamInfer(iter([msg]), timeout=60))
    assert len(replies) == 1
    assert "(--max-tensor-elements)" in replies[0].error_message
    assert "input 'IN' for model 'repeat_int32'" in replies[0].error_message
