"""PyTorch models served by ``kiln serve``, checked with tritonclient over HTTP and gRPC."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from kiln.examples import build_example_repository, reference_outputs
from kiln.examples.torch_models import DigitMlp, write_exported_mlp
from tests.conftest import KilnProcess

RNG = np.random.default_rng(7)

# The same module as torch_mlp, exported with torch.export and bound by forward() names.
EXPORTED_CONFIG = """\
name: "exported_mlp"
backend: "pytorch"
max_batch_size: 16
input [ { name: "image" data_type: TYPE_FP32 dims: [ 64 ] } ]
output [
  { name: "LOGITS" data_type: TYPE_FP32 dims: [ 10 ] },
  { name: "PROBABILITIES" data_type: TYPE_FP32 dims: [ 10 ] }
]
instance_group [ { count: 1 kind: KIND_CPU } ]
"""


@pytest.fixture(scope="module")
def torch_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KilnProcess]:
    repo = tmp_path_factory.mktemp("torch") / "models"
    build_example_repository(repo, ["torch_mlp", "mlp", "simple"])
    (repo / "exported_mlp" / "1").mkdir(parents=True)
    (repo / "exported_mlp" / "config.pbtxt").write_text(EXPORTED_CONFIG)
    write_exported_mlp(repo / "exported_mlp" / "1")
    server = KilnProcess(repo).start()
    yield server
    server.stop()


def _http(server: KilnProcess, model: str, name: str, x: np.ndarray) -> httpclient.InferResult:
    client = httpclient.InferenceServerClient(server.http_url)
    tensor = httpclient.InferInput(name, list(x.shape), "FP32")
    tensor.set_data_from_numpy(x, binary_data=True)
    return client.infer(model, [tensor])


def _grpc(server: KilnProcess, model: str, name: str, x: np.ndarray) -> grpcclient.InferResult:
    client = grpcclient.InferenceServerClient(server.grpc_url)
    tensor = grpcclient.InferInput(name, list(x.shape), "FP32")
    tensor.set_data_from_numpy(x)
    return client.infer(model, [tensor])


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_torchscript_mlp_equals_onnx_mlp(torch_server: KilnProcess, protocol: str) -> None:
    x = RNG.standard_normal((5, 64), dtype=np.float32)
    call = _http if protocol == "http" else _grpc
    got = call(torch_server, "torch_mlp", "INPUT__0", x)
    onnx = call(torch_server, "mlp", "INPUT", x)
    reference = reference_outputs("torch_mlp", {"INPUT__0": x})
    for torch_name, onnx_name in (("LOGITS__0", "LOGITS"), ("PROBABILITIES__1", "PROBABILITIES")):
        value = got.as_numpy(torch_name)
        assert value.shape == (5, 10) and value.dtype == np.float32
        np.testing.assert_allclose(value, onnx.as_numpy(onnx_name), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(value, reference[torch_name], rtol=1e-4, atol=1e-5)


def test_exported_program_equals_in_process_torch(torch_server: KilnProcess) -> None:
    x = RNG.standard_normal((3, 64), dtype=np.float32)
    got = _http(torch_server, "exported_mlp", "image", x)
    with torch.inference_mode():
        logits, probabilities = DigitMlp().eval()(torch.from_numpy(x))
    np.testing.assert_allclose(got.as_numpy("LOGITS"), logits.numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(
        got.as_numpy("PROBABILITIES"), probabilities.numpy(), rtol=1e-5, atol=1e-6
    )


def test_config_reports_backend_and_file(torch_server: KilnProcess) -> None:
    client = httpclient.InferenceServerClient(torch_server.http_url)
    config = client.get_model_config("exported_mlp")
    assert (config["backend"], config["default_model_filename"]) == ("pytorch", "model.pt2")
    config = client.get_model_config("torch_mlp")
    assert (config["platform"], config["default_model_filename"]) == (
        "pytorch_libtorch",
        "model.pt",
    )


def test_classification_labels_apply_to_torch_outputs(torch_server: KilnProcess) -> None:
    client = httpclient.InferenceServerClient(torch_server.http_url)
    x = RNG.standard_normal((1, 64), dtype=np.float32)
    tensor = httpclient.InferInput("INPUT__0", [1, 64], "FP32")
    tensor.set_data_from_numpy(x)
    out = httpclient.InferRequestedOutput("PROBABILITIES__1", class_count=1)
    result = client.infer("torch_mlp", [tensor], outputs=[out])
    reference = reference_outputs("torch_mlp", {"INPUT__0": x})["PROBABILITIES__1"]
    label = result.as_numpy("PROBABILITIES__1").reshape(-1)[0].decode()
    assert label.endswith(f"digit_{int(np.argmax(reference))}")


@pytest.mark.parametrize(
    ("name", "datatype", "shape", "message"),
    [
        ("INPUT__0", "FP64", [2, 64], "expecting TYPE_FP32"),
        ("INPUT__0", "FP32", [2, 63], "[-1,64]"),
        ("IMAGE", "FP32", [2, 64], "unexpected inference input 'IMAGE'"),
    ],
)
def test_bad_inputs_are_refused_by_core(
    torch_server: KilnProcess, name: str, datatype: str, shape: list[int], message: str
) -> None:
    client = httpclient.InferenceServerClient(torch_server.http_url)
    tensor = httpclient.InferInput(name, shape, datatype)
    dtype = np.float64 if datatype == "FP64" else np.float32
    tensor.set_data_from_numpy(np.zeros(shape, dtype))
    with pytest.raises(InferenceServerException) as info:
        client.infer("torch_mlp", [tensor])
    assert message in str(info.value) and "torch_mlp" in str(info.value)
    assert client.is_model_ready("torch_mlp")  # the model keeps serving
    x = RNG.standard_normal((1, 64), dtype=np.float32)
    assert _http(torch_server, "torch_mlp", "INPUT__0", x).as_numpy("LOGITS__0").shape == (1, 10)


def test_broken_torch_model_does_not_stop_the_others(
    make_server: type[KilnProcess], tmp_path: Path
) -> None:
    repo = tmp_path / "models"
    build_example_repository(repo, ["simple"])
    broken = repo / "broken_torch"
    (broken / "1").mkdir(parents=True)
    (broken / "1" / "model.pt").write_bytes(b"garbage")
    (broken / "config.pbtxt").write_text(
        'platform: "pytorch_libtorch"\ninput [ { name: "INPUT__0" data_type: TYPE_FP32 '
        'dims: [ 4 ] } ]\noutput [ { name: "OUTPUT__0" data_type: TYPE_FP32 dims: [ 4 ] } ]\n'
    )
    server = make_server(repo, args=["--no-strict-readiness"]).start()
    client = httpclient.InferenceServerClient(server.http_url)
    index = {m["name"]: m for m in client.get_model_repository_index()}
    assert index["broken_torch"]["state"] == "UNAVAILABLE"
    assert "unable to load model 'broken_torch' from model.pt" in index["broken_torch"]["reason"]
    assert client.is_model_ready("simple")
