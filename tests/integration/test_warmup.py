"""model_warmup end to end: kiln serve in explicit mode loads (or refuses) warmed models."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from onnx import TensorProto, helper
from tritonclient.utils import InferenceServerException

from kiln.examples import reference_outputs
from tests.conftest import KilnProcess

SIMPLE_WARMUP = """
model_warmup [
  {
    name: "from_file"
    batch_size: 8
    count: 2
    inputs { key: "INPUT0" value: { data_type: TYPE_INT32 dims: [ 16 ] input_data_file: "in0" } }
    inputs { key: "INPUT1" value: { data_type: TYPE_INT32 dims: [ 16 ] random_data: true } }
  }
]
instance_group [ { count: 2 kind: KIND_CPU } ]
"""


def fixed_reshape_model(repo: Path) -> None:
    """A model whose config says dims [-1] but whose graph only takes 2 elements: warm-up
    with 3 passes kiln's checks and fails inside onnxruntime."""
    shape = helper.make_tensor("shape", TensorProto.INT64, [1], [2])
    graph = helper.make_graph(
        [helper.make_node("Reshape", ["INPUT", "shape"], ["OUTPUT"])],
        "fixed",
        [helper.make_tensor_value_info("INPUT", TensorProto.FLOAT, ["n"])],
        [helper.make_tensor_value_info("OUTPUT", TensorProto.FLOAT, [2])],
        initializer=[shape],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)
    (repo / "fixed" / "1").mkdir(parents=True)
    onnx.save(model, repo / "fixed" / "1" / "model.onnx")
    (repo / "fixed" / "config.pbtxt").write_text(
        'name: "fixed"\nplatform: "onnxruntime_onnx"\nmax_batch_size: 0\n'
        'input [ { name: "INPUT" data_type: TYPE_FP32 dims: [ -1 ] } ]\n'
        'output [ { name: "OUTPUT" data_type: TYPE_FP32 dims: [ 2 ] } ]\n'
        'model_warmup [ { name: "three" batch_size: 1 inputs { key: "INPUT" value: '
        "{ data_type: TYPE_FP32 dims: [ 3 ] zero_data: true } } } ]\n"
    )


@pytest.fixture
def warm_server(example_repo: Path, tmp_path: Path, make_server: type[KilnProcess]) -> KilnProcess:
    repo = tmp_path / "repo"
    repo.mkdir()
    for model in ("simple", "mlp"):
        shutil.copytree(example_repo / model, repo / model)
    simple = repo / "simple"
    text = (simple / "config.pbtxt").read_text()
    (simple / "config.pbtxt").write_text(text.split("instance_group")[0] + SIMPLE_WARMUP)
    (simple / "warmup").mkdir()
    (simple / "warmup" / "in0").write_bytes(np.arange(16, dtype="<i4").tobytes())
    mlp = repo / "mlp" / "config.pbtxt"
    mlp.write_text(
        mlp.read_text()
        + 'model_warmup [ { name: "short_file" batch_size: 2 inputs { key: "INPUT" value: '
        '{ data_type: TYPE_FP32 dims: [ 64 ] input_data_file: "short.bin" } } } ]\n'
    )
    (repo / "mlp" / "warmup").mkdir()
    (repo / "mlp" / "warmup" / "short.bin").write_bytes(b"\0" * 100)
    fixed_reshape_model(repo)
    # a stateful model: its sample names only INPUT; kiln adds START / READY and the state
    shutil.copytree(example_repo / "simple_sequence", repo / "simple_sequence")
    seq = repo / "simple_sequence" / "config.pbtxt"
    seq.write_text(
        seq.read_text()
        + 'model_warmup [ { name: "one_step" batch_size: 2 inputs { key: "INPUT" value: '
        "{ data_type: TYPE_INT32 dims: [ 1 ] random_data: true } } } ]\n"
    )
    return make_server(repo, args=["--model-control-mode", "explicit"]).start()


def test_a_warmed_model_loads_ready_and_serves(warm_server: KilnProcess) -> None:
    client = httpclient.InferenceServerClient(warm_server.http_url)
    client.load_model("simple")
    assert client.is_model_ready("simple")
    a = np.full((1, 16), 3, np.int32)
    items = [httpclient.InferInput(n, [1, 16], "INT32") for n in ("INPUT0", "INPUT1")]
    for item in items:
        item.set_data_from_numpy(a)
    result = client.infer("simple", items)
    expected = reference_outputs("simple", {"INPUT0": a, "INPUT1": a})
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), expected["OUTPUT0"])
    stats = client.get_inference_statistics("simple")["model_stats"][0]
    assert stats["execution_count"] == 1  # warm-up runs are not counted as traffic


def test_a_malformed_warmup_fails_the_load_with_its_name_and_reason(
    warm_server: KilnProcess,
) -> None:
    client = httpclient.InferenceServerClient(warm_server.http_url)
    with pytest.raises(InferenceServerException) as err:
        client.load_model("mlp")
    message = err.value.message()
    assert "failed to load 'mlp' version 1: warm-up 'short_file' failed" in message
    assert "input 'INPUT': input_data_file has 100 bytes, but 64 FP32 elements need 256" in message
    assert not client.is_model_ready("mlp")
    index = {m["name"]: m for m in client.get_model_repository_index()}
    assert index["mlp"]["state"] == "UNAVAILABLE" and "short_file" in index["mlp"]["reason"]


def test_a_warmup_the_model_cannot_run_fails_the_load_over_grpc(
    warm_server: KilnProcess,
) -> None:
    client = grpcclient.InferenceServerClient(warm_server.grpc_url)
    with pytest.raises(InferenceServerException) as err:
        client.load_model("fixed")
    message = err.value.message()
    assert "failed to load 'fixed' version 1: warm-up 'three' failed: instance fixed_0 #0" in (
        message
    )
    assert "model 'fixed' failed to execute" in message
    assert not client.is_model_ready("fixed")
    client.load_model("simple")  # the server keeps loading and serving other models
    assert client.is_model_ready("simple")


def test_a_sequence_model_warms_up_and_its_sequences_start_clean(
    warm_server: KilnProcess,
) -> None:
    client = grpcclient.InferenceServerClient(warm_server.grpc_url)
    client.load_model("simple_sequence")
    assert client.is_model_ready("simple_sequence")

    def send(value: int, start: bool = False, end: bool = False) -> int:
        x = grpcclient.InferInput("INPUT", [1, 1], "INT32")
        x.set_data_from_numpy(np.array([[value]], np.int32))
        out = client.infer(
            "simple_sequence", [x], sequence_id=9, sequence_start=start, sequence_end=end
        )
        return int(out.as_numpy("OUTPUT")[0, 0])

    # the running sum starts from the initial state, not from what the warm-up summed
    assert [send(5, start=True), send(2), send(3, end=True)] == [5, 7, 10]
