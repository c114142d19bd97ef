"""ONNX Runtime on the GPU: CUDA and TensorRT execution providers from the config (needs a GPU)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from kiln.examples import build_example_repository, reference_outputs

pytestmark = pytest.mark.gpu

ACCELERATORS = {
    "cuda": "",
    "tensorrt": """
optimization { execution_accelerators { gpu_execution_accelerator [ {
  name: "tensorrt"
  parameters { key: "precision_mode" value: "FP16" }
  parameters { key: "trt_engine_cache_path" value: "%s" }
} ] } }
""",
}


@pytest.mark.parametrize("accelerator", sorted(ACCELERATORS))
def test_mlp_on_gpu_matches_reference(accelerator: str, tmp_path: Path, make_server: type) -> None:
    import onnxruntime as ort
    import tritonclient.http as httpclient

    needed = "TensorrtExecutionProvider" if accelerator == "tensorrt" else "CUDAExecutionProvider"
    if needed not in ort.get_available_providers():
        pytest.fail(f"{needed} missing: install kiln-serve[gpu] (onnxruntime-gpu) on this machine")
    repo = tmp_path / "models"
    build_example_repository(repo, ["mlp"])
    config = repo / "mlp" / "config.pbtxt"
    text = config.read_text().replace("KIND_CPU", "KIND_GPU")
    if accelerator == "tensorrt":
        text += ACCELERATORS["tensorrt"] % (tmp_path / "trt_cache")
    config.write_text(text)
    server = make_server(repo).start()
    client = httpclient.InferenceServerClient(server.http_url)
    x = np.random.default_rng(5).standard_normal((4, 64), dtype=np.float32)
    tensor = httpclient.InferInput("INPUT", [4, 64], "FP32")
    tensor.set_data_from_numpy(x)
    result = client.infer("mlp", [tensor])
    tolerance = 2e-2 if accelerator == "tensorrt" else 1e-4  # FP16 engine vs float32 reference
    expected = reference_outputs("mlp", {"INPUT": x})
    np.testing.assert_allclose(
        result.as_numpy("PROBABILITIES"), expected["PROBABILITIES"], rtol=tolerance, atol=tolerance
    )
    if accelerator == "tensorrt":
        assert any((tmp_path / "trt_cache").iterdir())  # the engine cache was written
