"""A TensorRT engine built at test time from the example mlp, served by kiln (needs a GPU).

The engine is built here with the TensorRT builder (strongly typed network, one dynamic
batch profile) because plans are specific to the GPU and TensorRT version that built them.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.gpu

CONFIG = """\
name: "trt_mlp"
platform: "tensorrt_plan"
max_batch_size: 16
instance_group [ { count: 2 kind: KIND_GPU } ]
"""


def _build_engine(onnx_path: Path, plan_path: Path) -> None:
    import tensorrt as trt  # a GPU run without it fails loudly: install kiln-serve[tensorrt]

    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    flags = 1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED)
    network = builder.create_network(flags)
    parser = trt.OnnxParser(network, logger)
    assert parser.parse(onnx_path.read_bytes()), [
        parser.get_error(i) for i in range(parser.num_errors)
    ]
    config = builder.create_builder_config()
    profile = builder.create_optimization_profile()
    profile.set_shape("INPUT", (1, 64), (8, 64), (16, 64))
    config.add_optimization_profile(profile)
    plan = builder.build_serialized_network(network, config)
    assert plan is not None
    plan_path.write_bytes(bytes(plan))


@pytest.fixture(scope="module")
def trt_repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import onnx

    from kiln.examples.models import build_mlp

    repo = tmp_path_factory.mktemp("trt") / "models"
    (repo / "trt_mlp" / "1").mkdir(parents=True)
    onnx_path = repo.parent / "mlp.onnx"
    onnx.save_model(build_mlp(), onnx_path)
    _build_engine(onnx_path, repo / "trt_mlp" / "1" / "model.plan")
    (repo / "trt_mlp" / "config.pbtxt").write_text(CONFIG)  # I/O auto-completed from the engine
    return repo


def test_engine_served_matches_onnxruntime(trt_repo: Path, make_server: type) -> None:
    import onnxruntime as ort
    import tritonclient.grpc as grpcclient
    import tritonclient.http as httpclient

    server = make_server(trt_repo).start()
    client = httpclient.InferenceServerClient(server.http_url)
    config = client.get_model_config("trt_mlp")
    assert config["max_batch_size"] == 16
    assert {i["name"] for i in config["input"]} == {"INPUT"}
    x = np.random.default_rng(3).standard_normal((5, 64), dtype=np.float32)
    session = ort.InferenceSession(
        str(trt_repo.parent / "mlp.onnx"), providers=["CPUExecutionProvider"]
    )
    expected = dict(
        zip(
            ["LOGITS", "PROBABILITIES"],
            session.run(["LOGITS", "PROBABILITIES"], {"INPUT": x}),
            strict=True,
        )
    )
    tensor = httpclient.InferInput("INPUT", [5, 64], "FP32")
    tensor.set_data_from_numpy(x)
    result = client.infer("trt_mlp", [tensor])
    for name, value in expected.items():
        np.testing.assert_allclose(result.as_numpy(name), value, rtol=1e-3, atol=1e-4)
    grpc = grpcclient.InferenceServerClient(server.grpc_url)
    gtensor = grpcclient.InferInput("INPUT", [5, 64], "FP32")
    gtensor.set_data_from_numpy(x)
    np.testing.assert_allclose(
        grpc.infer("trt_mlp", [gtensor]).as_numpy("LOGITS"),
        expected["LOGITS"],
        rtol=1e-3,
        atol=1e-4,
    )


def test_batch_outside_the_profile_is_invalid_arg(trt_repo: Path, make_server: type) -> None:
    import tritonclient.http as httpclient
    from tritonclient.utils import InferenceServerException

    server = make_server(trt_repo, args=["--no-strict-readiness"]).start()
    client = httpclient.InferenceServerClient(server.http_url)
    tensor = httpclient.InferInput("INPUT", [17, 64], "FP32")
    tensor.set_data_from_numpy(np.zeros((17, 64), np.float32))
    with pytest.raises(InferenceServerException, match="trt_mlp"):
        client.infer("trt_mlp", [tensor])  # above max_batch_size 16 / profile max 16
    assert client.is_model_ready("trt_mlp")
