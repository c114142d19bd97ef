"""A tensor's declared shape never sizes an allocation before the data backs it, and a big
JSON tensor is decoded without stalling other clients (issue #25, findings 7 and 8).

Memory is read from the server process's ``/proc/PID/status`` (VmHWM, the peak resident
set): a behaviour check, not a timing."""

from __future__ import annotations

import json
import struct
import threading
import time
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import requests

from kiln.frontends.grpc import grpc_service_pb2 as pb
from kiln.frontends.grpc.services import inference_stub
from tests.conftest import KilnProcess

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


def test_a_big_json_body_is_decoded_while_other_clients_are_answered(base: str) -> None:
    """Probes of /v2/health/live run while a ~8 MiB JSON tensor decodes. Decoded on the
    event loop, none could finish in the second half of the big request's life (the
    decode): they waited for it. Only the order of events is checked, not durations."""
    count = 4_000_000
    body = b'{"inputs":[{"name":"INPUT0","datatype":"INT32","shape":[%d],"data":[%s]}]}' % (
        count,
        b",".join([b"1"] * count),
    )
    done: list[float] = []
    answer: list[requests.Response] = []

    def big() -> None:
        answer.append(requests.post(f"{base}/v2/models/simple/infer", data=body, timeout=120))
        done.append(time.monotonic())

    probes: list[tuple[float, float]] = []
    session = requests.Session()
    session.get(f"{base}/v2/health/live", timeout=30)  # a warm connection
    worker = threading.Thread(target=big)
    start = time.monotonic()
    worker.start()
    while worker.is_alive():
        sent = time.monotonic()
        assert session.get(f"{base}/v2/health/live", timeout=60).status_code == 200
        probes.append((sent, time.monotonic()))
    worker.join()
    assert answer[0].status_code == 400  # decoded, then refused by core
    assert "missing required input(s) ['INPUT1']" in answer[0].json()["error"]
    middle = start + (done[0] - start) / 2
    during_decode = [p for p in probes if p[0] >= middle and p[1] < done[0]]
    assert len(during_decode) >= 3, (len(probes), done[0] - start)


def test_a_big_generate_body_is_decoded_while_other_clients_are_answered(base: str) -> None:
    """As above, on Triton's generate extension (``/generate`` decoded its JSON on the
    event loop: 24 MB held every other client for a second)."""
    count = 4_000_000
    body = b'{"INPUT0":[%s]}' % b",".join([b"1"] * count)
    done: list[float] = []
    answer: list[requests.Response] = []

    def big() -> None:
        answer.append(requests.post(f"{base}/v2/models/simple/generate", data=body, timeout=120))
        done.append(time.monotonic())

    probes: list[tuple[float, float]] = []
    session = requests.Session()
    session.get(f"{base}/v2/health/live", timeout=30)  # a warm connection
    worker = threading.Thread(target=big)
    start = time.monotonic()
    worker.start()
    while worker.is_alive():
        sent = time.monotonic()
        assert session.get(f"{base}/v2/health/live", timeout=60).status_code == 200
        probes.append((sent, time.monotonic()))
    worker.join()
    assert answer[0].status_code == 400  # decoded, then refused by core
    assert "missing required input(s) ['INPUT1']" in answer[0].json()["error"]
    middle = start + (done[0] - start) / 2
    during_decode = [p for p in probes if p[0] >= middle and p[1] < done[0]]
    assert len(during_decode) >= 3, (len(probes), done[0] - start)


@pytest.mark.parametrize("kind", ["typed", "bytes"])
def test_a_big_grpc_message_is_decoded_while_other_clients_are_answered(
    base: str, kiln_server: KilnProcess, kind: str
) -> None:
    """As above, over gRPC: typed ``contents`` become an array value by value, and BYTES
    raw contents are walked element by element; both ran on the event loop (24 MB held
    every HTTP and gRPC client for over a second)."""
    count = 16_000_000 if kind == "typed" else 4_000_000  # about a second of decoding each
    msg = pb.ModelInferRequest(model_name="simple" if kind == "typed" else "simple_string")
    if kind == "typed":
        tensor = msg.inputs.add(name="INPUT0", datatype="INT32", shape=[1, count])
        tensor.contents.int_contents.extend([1] * count)
    else:
        msg.inputs.add(name="INPUT0", datatype="BYTES", shape=[1, count])
        msg.raw_input_contents.append(struct.pack("<I", 0) * count)
    done: list[float] = []
    answer: list[grpc.RpcError] = []

    def big() -> None:
        options = [("grpc.max_send_message_length", 256 * MiB)]
        with grpc.insecure_channel(kiln_server.grpc_url, options=options) as channel:
            try:
                inference_stub(channel).ModelInfer(msg, timeout=120)
            except grpc.RpcError as exc:
                answer.append(exc)
        done.append(time.monotonic())

    probes: list[tuple[float, float]] = []
    session = requests.Session()
    session.get(f"{base}/v2/health/live", timeout=30)  # a warm connection
    worker = threading.Thread(target=big)
    start = time.monotonic()
    worker.start()
    while worker.is_alive():
        sent = time.monotonic()
        assert session.get(f"{base}/v2/health/live", timeout=60).status_code == 200
        probes.append((sent, time.monotonic()))
    worker.join()
    assert answer and answer[0].code() == grpc.StatusCode.INVALID_ARGUMENT  # decoded, refused
    assert "missing required input(s) ['INPUT1']" in (answer[0].details() or "")
    middle = start + (done[0] - start) / 2
    during_decode = [p for p in probes if p[0] >= middle and p[1] < done[0]]
    assert len(during_decode) >= 3, (len(probes), done[0] - start)


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
