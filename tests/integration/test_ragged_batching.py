"""Ragged batching end to end: an ONNX model that takes one flat INPUT and the batch input
INDEX (where each request's part ends), served by ``kiln serve`` and driven by tritonclient.
Three requests of different lengths form one batch without padding; each gets its own part
of the scattered output back, in its own shape."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
import tritonclient.http as httpclient
from onnx import TensorProto, helper
from tritonclient.utils import InferenceServerException

from tests.conftest import KilnProcess

CONFIG = """
name: "{name}"
platform: "onnxruntime_onnx"
max_batch_size: 8
input [ {{ name: "INPUT" data_type: TYPE_FP32 dims: [ -1 ] allow_ragged_batch: true }} ]
batch_input [ {{ kind: BATCH_ACCUMULATED_ELEMENT_COUNT target_name: "INDEX"
                data_type: TYPE_FP32 source_input: "INPUT" }} ]
output [ {{ name: "OUT" data_type: TYPE_FP32 dims: [ -1 ] }},
         {{ name: "END" data_type: TYPE_FP32 dims: [ 1 ] }} ]
batch_output [ {{ target_name: "OUT" kind: BATCH_SCATTER_WITH_INPUT_SHAPE
                 source_input: "INPUT" }} ]
{scheduling}
"""


def ragged_model(repo: Path, name: str, scheduling: str) -> None:
    """OUT = 2 * INPUT over the flat batch; END = INDEX as [requests, 1] (one per request)."""
    two = helper.make_tensor("two", TensorProto.FLOAT, [], [2.0])
    axes = helper.make_tensor("axes", TensorProto.INT64, [1], [1])
    graph = helper.make_graph(
        [
            helper.make_node("Mul", ["INPUT", "two"], ["OUT"]),
            helper.make_node("Unsqueeze", ["INDEX", "axes"], ["END"]),
        ],
        "ragged",
        [
            helper.make_tensor_value_info("INPUT", TensorProto.FLOAT, ["n"]),
            helper.make_tensor_value_info("INDEX", TensorProto.FLOAT, ["k"]),
        ],
        [
            helper.make_tensor_value_info("OUT", TensorProto.FLOAT, ["n"]),
            helper.make_tensor_value_info("END", TensorProto.FLOAT, ["k", 1]),
        ],
        initializer=[two, axes],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)
    (repo / name / "1").mkdir(parents=True)
    onnx.save(model, repo / name / "1" / "model.onnx")
    (repo / name / "config.pbtxt").write_text(CONFIG.format(name=name, scheduling=scheduling))


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> KilnProcess:
    repo = tmp_path_factory.mktemp("ragged") / "models"
    # the batch waits (up to 10 s) for three requests: the test sends three at once
    ragged_model(
        repo, "ragged",
        "dynamic_batching { preferred_batch_size: [ 3 ] max_queue_delay_microseconds: 10000000 }",
    )  # fmt: skip
    ragged_model(repo, "ragged_alone", "")  # no scheduler: a batch of one request
    proc = KilnProcess(repo).start()
    yield proc
    proc.stop()


def _request(n: int) -> list[httpclient.InferInput]:
    x = httpclient.InferInput("INPUT", [1, n], "FP32")
    x.set_data_from_numpy(np.arange(n, dtype=np.float32).reshape(1, n) + 10 * n)
    return [x]


def test_requests_of_different_lengths_share_one_batch_without_padding(
    server: KilnProcess,
) -> None:
    lengths = [3, 4, 5]
    client = httpclient.InferenceServerClient(server.http_url, concurrency=3)
    pending = [client.async_infer("ragged", _request(n)) for n in lengths]
    results = [p.get_result(timeout=60) for p in pending]
    client.close()
    ends = []
    for n, result in zip(lengths, results, strict=True):
        expected = (np.arange(n, dtype=np.float32) + 10 * n).reshape(1, n) * 2
        np.testing.assert_array_equal(result.as_numpy("OUT"), expected)  # its own shape
        ends.append(int(result.as_numpy("END")[0, 0]))
    # one batch of all three: each request's INDEX entry is where its part ends in the flat
    # INPUT, so the ends are the running totals of the lengths in batch order
    order = sorted(range(3), key=lambda i: ends[i])
    assert [ends[i] for i in order] == list(np.cumsum([lengths[i] for i in order]))
    stats = httpclient.InferenceServerClient(server.http_url).get_inference_statistics("ragged")
    (model,) = stats["model_stats"]
    assert [b["batch_size"] for b in model["batch_stats"]] == [3]


def test_a_request_alone_gets_its_batch_input_too(server: KilnProcess) -> None:
    client = httpclient.InferenceServerClient(server.http_url)
    result = client.infer("ragged_alone", _request(6))
    assert result.as_numpy("OUT").shape == (1, 6)
    assert result.as_numpy("END").tolist() == [[6.0]]


def test_the_client_cannot_send_the_batch_input(server: KilnProcess) -> None:
    client = httpclient.InferenceServerClient(server.http_url)
    metadata = client.get_model_metadata("ragged")
    assert [i["name"] for i in metadata["inputs"]] == ["INPUT"]
    index = httpclient.InferInput("INDEX", [1, 1], "FP32")
    index.set_data_from_numpy(np.ones((1, 1), np.float32))
    with pytest.raises(InferenceServerException) as info:
        client.infer("ragged_alone", [*_request(2), index])
    assert info.value.status() == "400"
    assert "unexpected inference input 'INDEX' for model 'ragged_alone'" in info.value.message()
    assert client.infer("ragged_alone", _request(2)).as_numpy("END").tolist() == [[2.0]]
