"""A string correlation id (``sequence_id``) is at most 256 characters.

The sequence batcher remembers the last 4,096 ended ids of each model (so a late request
hears why its sequence is gone): ids of 64 KiB, the longest string parameter, pinned 256
MiB per sequence model for as long as the server ran."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import grpc
import numpy as np
import pytest
import requests

from kiln.frontends.grpc import grpc_service_pb2 as pb
from kiln.frontends.grpc.services import inference_stub
from tests.conftest import KilnProcess

MODEL = "simple_sequence"


@pytest.fixture
def base(kiln_server: KilnProcess) -> str:
    return f"http://{kiln_server.http_url}"


@pytest.fixture
def stub(kiln_server: KilnProcess) -> Iterator[Any]:
    with grpc.insecure_channel(kiln_server.grpc_url) as channel:
        yield inference_stub(channel)


def _infer(base: str, sequence_id: str) -> requests.Response:
    body = {
        "parameters": {"sequence_id": sequence_id, "sequence_start": True, "sequence_end": True},
        "inputs": [{"name": "INPUT", "datatype": "INT32", "shape": [1, 1], "data": [1]}],
    }
    return requests.post(f"{base}/v2/models/{MODEL}/infer", json=body, timeout=30)


def test_a_string_id_over_256_characters_is_refused(base: str, stub: Any) -> None:
    response = _infer(base, "s" * 257)
    assert response.status_code == 400, response.text
    assert response.json()["error"] == (
        f"request parameter 'sequence_id' for model '{MODEL}' is a string of 257 characters, "
        "more than 256"
    )
    msg = pb.ModelInferRequest(model_name=MODEL)
    msg.parameters["sequence_id"].string_param = "s" * 65536
    msg.parameters["sequence_start"].bool_param = True
    msg.inputs.add(name="INPUT", datatype="INT32", shape=[1, 1])
    msg.raw_input_contents.append(np.ones(1, dtype=np.int32).tobytes())
    with pytest.raises(grpc.RpcError) as err:
        stub.ModelInfer(msg, timeout=30)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "is a string of 65536 characters, more than 256" in (err.value.details() or "")


def test_a_string_id_of_256_characters_runs(base: str) -> None:
    response = _infer(base, "s" * 256)
    assert response.status_code == 200, response.text
