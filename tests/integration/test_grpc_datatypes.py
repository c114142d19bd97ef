"""FP16 / BOOL / BYTES / BF16 round-trips through tiny ONNX Identity models over gRPC
(and BF16 over HTTP binary too)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import onnx
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from onnx import TensorProto, helper
from tritonclient.utils import InferenceServerException

from tests.conftest import KilnProcess

# model name -> (ONNX element type, config data_type, protocol datatype)
IDENTITIES = {
    "identity_fp16": (TensorProto.FLOAT16, "TYPE_FP16", "FP16"),
    "identity_bool": (TensorProto.BOOL, "TYPE_BOOL", "BOOL"),
    "identity_bytes": (TensorProto.STRING, "TYPE_STRING", "BYTES"),
    "identity_bf16": (TensorProto.BFLOAT16, "TYPE_BF16", "BF16"),
}


def write_identity(repo: Path, name: str, elem: int, data_type: str) -> None:
    graph = helper.make_graph(
        [helper.make_node("Identity", ["INPUT"], ["OUTPUT"])],
        name,
        [helper.make_tensor_value_info("INPUT", elem, [None, 4])],
        [helper.make_tensor_value_info("OUTPUT", elem, [None, 4])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 9
    (repo / name / "1").mkdir(parents=True)
    onnx.save(model, repo / name / "1" / "model.onnx")
    (repo / name / "config.pbtxt").write_text(
        f'name: "{name}"\nplatform: "onnxruntime_onnx"\nmax_batch_size: 4\n'
        f'input [{{ name: "INPUT" data_type: {data_type} dims: [ 4 ] }}]\n'
        f'output [{{ name: "OUTPUT" data_type: {data_type} dims: [ 4 ] }}]\n'
    )


@pytest.fixture(scope="module")
def identity_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KilnProcess]:
    repo = tmp_path_factory.mktemp("identities") / "model_repository"
    for name, (elem, data_type, _) in IDENTITIES.items():
        write_identity(repo, name, elem, data_type)
    server = KilnProcess(repo).start()
    yield server
    server.stop()


def roundtrip(server: KilnProcess, model: str, array: np.ndarray) -> np.ndarray:
    client = grpcclient.InferenceServerClient(server.grpc_url)
    item = grpcclient.InferInput("INPUT", list(array.shape), IDENTITIES[model][2])
    item.set_data_from_numpy(array)
    result = client.infer(model, [item])
    output = result.get_response().outputs[0]
    assert output.datatype == IDENTITIES[model][2]
    assert list(output.shape) == list(array.shape)
    return result.as_numpy("OUTPUT")


def test_fp16_round_trip(identity_server: KilnProcess) -> None:
    array = np.array([[0.5, -2.0, 65504.0, 6e-8], [1, 2, 3, 4]], dtype=np.float16)
    got = roundtrip(identity_server, "identity_fp16", array)
    assert got.dtype == np.float16
    np.testing.assert_array_equal(got, array)


def test_bool_round_trip(identity_server: KilnProcess) -> None:
    array = np.array([[True, False, False, True]])
    got = roundtrip(identity_server, "identity_bool", array)
    assert got.dtype == np.bool_
    np.testing.assert_array_equal(got, array)


def test_bytes_round_trip_keeps_arbitrary_utf8(identity_server: KilnProcess) -> None:
    array = np.array([["", "héllo", "a b c", "x" * 300]], dtype=object)
    got = roundtrip(identity_server, "identity_bytes", array)
    assert [v.decode() for v in got.ravel()] == list(array.ravel())


BF16_EXACT = np.array([[1.5, -2.0, 3.25, 0.0], [-0.0, 1e30, -7.5e-20, 256.0]], np.float32)


def exactly_bf16(array: np.ndarray) -> np.ndarray:
    # Keep only the high 16 bits so every value is exactly representable in BF16.
    return (array.view(np.uint32) & np.uint32(0xFFFF0000)).view(np.float32)


def test_bf16_round_trip(identity_server: KilnProcess) -> None:
    array = exactly_bf16(BF16_EXACT)
    got = roundtrip(identity_server, "identity_bf16", array)
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got.view(np.uint32), array.view(np.uint32))


def test_bf16_round_trip_http_binary(identity_server: KilnProcess) -> None:
    array = exactly_bf16(np.random.default_rng(7).normal(size=(3, 4)).astype(np.float32))
    client = httpclient.InferenceServerClient(identity_server.http_url)
    item = httpclient.InferInput("INPUT", list(array.shape), "BF16")
    item.set_data_from_numpy(array, binary_data=True)
    wanted = httpclient.InferRequestedOutput("OUTPUT", binary_data=True)
    result = client.infer("identity_bf16", [item], outputs=[wanted])
    output = result.get_output("OUTPUT")
    assert output is not None
    assert output["datatype"] == "BF16" and output["shape"] == [3, 4]
    got = result.as_numpy("OUTPUT")
    assert got is not None
    np.testing.assert_array_equal(got.view(np.uint32), array.view(np.uint32))


def test_bf16_shape_checked_before_the_model_runs(identity_server: KilnProcess) -> None:
    client = grpcclient.InferenceServerClient(identity_server.grpc_url)
    item = grpcclient.InferInput("INPUT", [1, 3], "BF16")
    item.set_data_from_numpy(np.ones((1, 3), np.float32))
    with pytest.raises(InferenceServerException) as err:
        client.infer("identity_bf16", [item])
    assert err.value.status() == "StatusCode.INVALID_ARGUMENT"
    assert "unexpected shape for input 'INPUT'" in err.value.message()
    wrong = grpcclient.InferInput("INPUT", [1, 4], "FP16")
    wrong.set_data_from_numpy(np.ones((1, 4), np.float16))
    with pytest.raises(InferenceServerException) as err:
        client.infer("identity_bf16", [wrong])
    assert "unexpected datatype TYPE_FP16 for inference input 'INPUT'" in err.value.message()
    np.testing.assert_array_equal(
        roundtrip(identity_server, "identity_fp16", np.ones((1, 4), np.float16)), 1
    )
