"""Client mistakes are 400s (gRPC INVALID_ARGUMENT) with a message naming what is wrong,
never a 500 with a traceback, and Triton's exact text where its client examples check it
(issue #25, lows)."""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import numpy as np
import pytest
import requests

from kiln.frontends.grpc import grpc_service_pb2 as pb
from kiln.frontends.grpc.services import inference_stub
from tests.conftest import KilnProcess

DATA = np.arange(16, dtype=np.int32)


@pytest.fixture
def base(kiln_server: KilnProcess) -> str:
    return f"http://{kiln_server.http_url}"


@pytest.fixture
def stub(kiln_server: KilnProcess) -> Iterator[object]:
    with grpc.insecure_channel(kiln_server.grpc_url) as channel:
        yield inference_stub(channel)


def _refused(stub: object, msg: pb.ModelInferRequest) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as err:
        stub.ModelInfer(msg, timeout=30)  # type: ignore[attr-defined]
    return err.value


def _json_infer(base: str, shape: list[int], data: list[int]) -> requests.Response:
    tensor = {"datatype": "INT32", "shape": shape, "data": data}
    body = {"inputs": [dict(tensor, name="INPUT0"), dict(tensor, name="INPUT1")]}
    return requests.post(f"{base}/v2/models/simple/infer", json=body, timeout=30)


def test_rank_65_is_refused_over_http_and_grpc(base: str, stub: object) -> None:
    response = _json_infer(base, [1] * 65, [1])
    assert response.status_code == 400, response.text
    message = response.json()["error"]
    assert "input 'INPUT0' for model 'simple' has a shape of rank 65, more than 64" in message

    msg = pb.ModelInferRequest(model_name="simple")
    for name in ("INPUT0", "INPUT1"):
        msg.inputs.add(name=name, datatype="INT32", shape=[1] * 65)
        msg.raw_input_contents.append(DATA[:1].tobytes())
    err = _refused(stub, msg)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "input 'INPUT0' for model 'simple' has a shape of rank 65" in (err.details() or "")


@pytest.mark.parametrize("shape", [[2**62, 4], [2**40, 2**40, 0]])
def test_dims_whose_product_overflows_int64_are_refused(
    base: str, stub: object, shape: list[int]
) -> None:
    response = _json_infer(base, shape, [])
    assert response.status_code == 400, response.text
    assert "input 'INPUT0' for model 'simple'" in response.json()["error"]
    assert "overflows int64" in response.json()["error"]
    msg = pb.ModelInferRequest(model_name="simple")
    for name in ("INPUT0", "INPUT1"):
        msg.inputs.add(name=name, datatype="INT32", shape=shape)
        msg.raw_input_contents.append(b"")
    err = _refused(stub, msg)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "overflows int64" in (err.details() or "")


def test_negative_dims_name_the_tensor_and_model(base: str, stub: object) -> None:
    response = _json_infer(base, [1, -16], [])
    assert response.status_code == 400
    assert "input 'INPUT0' for model 'simple'" in response.json()["error"]
    msg = pb.ModelInferRequest(model_name="simple")
    for name in ("INPUT0", "INPUT1"):
        msg.inputs.add(name=name, datatype="INT32", shape=[1, -16])
        msg.raw_input_contents.append(b"")
    err = _refused(stub, msg)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "input 'INPUT0' for model 'simple'" in (err.details() or "")
    assert "non-negative integers" in (err.details() or "")


def test_raw_input_contents_with_contents_gets_tritons_text(stub: object) -> None:
    """As Triton's grpc_explicit_int_content_client.py sends it: typed contents for both
    inputs, then one raw entry added."""
    msg = pb.ModelInferRequest(model_name="simple")
    for name in ("INPUT0", "INPUT1"):
        tensor = msg.inputs.add(name=name, datatype="INT32", shape=[1, 16])
        tensor.contents.int_contents.extend(DATA.tolist())
    msg.raw_input_contents.append(DATA[:8].tobytes())
    err = _refused(stub, msg)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert (
        "contents field must not be specified when using raw_input_contents for 'INPUT0' "
        "for model 'simple'"
    ) in (err.details() or "")


@pytest.mark.parametrize(
    ("query", "words"),
    [
        ("start=-1e300", "'start' must be a time between 1970 and 9999"),
        ("start=0&end=1e300", "'end' must be a time between 1970 and 9999"),
        ("start=now-1h&step=1e300", "'step' must be a positive number of seconds up to"),
        ("start=now-1000000000000h", "'start' must be a time between 1970 and 9999"),
    ],
)
def test_history_times_out_of_range_are_400(base: str, query: str, words: str) -> None:
    response = requests.get(f"{base}/api/history?metric=throughput&{query}", timeout=30)
    assert response.status_code == 400, response.text
    assert words in response.json()["error"]
    ok = requests.get(f"{base}/api/history?metric=throughput&start=now-5m", timeout=30)
    assert ok.status_code == 200, ok.text


@pytest.mark.parametrize("length", ["-1", "+5", "1_0", "0x10", ""])
def test_inference_header_content_length_is_plain_digits(base: str, length: str) -> None:
    """Python's int() took '+5' and '1_0' (cutting the JSON at 10 bytes), and a negative
    length was told it "is larger than the request body"."""
    body = b'{"inputs": []}'
    response = requests.post(
        f"{base}/v2/models/simple/infer",
        data=body,
        headers={"Inference-Header-Content-Length": length},
        timeout=30,
    )
    assert response.status_code == 400, response.text
    assert response.json()["error"] == (
        f"Inference-Header-Content-Length must be an integer >= 0, got '{length}'"
    )
