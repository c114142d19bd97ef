"""The PyTorch backend on CUDA (needs a GPU and a CUDA build of torch)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from kiln.examples import build_example_repository, reference_outputs

pytestmark = pytest.mark.gpu


def test_torch_mlp_on_cuda(tmp_path: Path, make_server: type) -> None:
    import torch
    import tritonclient.http as httpclient

    assert torch.cuda.is_available(), "a CUDA build of torch is needed for the GPU path"
    repo = tmp_path / "models"
    build_example_repository(repo, ["torch_mlp"])
    config = repo / "torch_mlp" / "config.pbtxt"
    config.write_text(config.read_text().replace("KIND_CPU", "KIND_GPU"))
    server = make_server(repo).start()
    client = httpclient.InferenceServerClient(server.http_url)
    x = np.random.default_rng(9).standard_normal((4, 64), dtype=np.float32)
    tensor = httpclient.InferInput("INPUT__0", [4, 64], "FP32")
    tensor.set_data_from_numpy(x)
    result = client.infer("torch_mlp", [tensor])
    expected = reference_outputs("torch_mlp", {"INPUT__0": x})
    np.testing.assert_allclose(
        result.as_numpy("LOGITS__0"), expected["LOGITS__0"], rtol=1e-3, atol=1e-4
    )
