"""A Python-backend model computing with torch on CUDA, served by kiln (needs a GPU and a
CUDA build of torch): Triton's usual pattern of a Python model on a ``KIND_GPU`` instance.

Each instance's worker process initializes CUDA itself (a subprocess, not a fork of the
server), picks its GPU from ``args["model_instance_device_id"]``, takes its input through
DLPack and hands back a CUDA tensor with ``pb_utils.Tensor.from_dlpack``, which kiln copies
to host memory for the response.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.gpu

CONFIG = """
name: "torch_py"
backend: "python"
max_batch_size: 8
input [ { name: "INPUT" data_type: TYPE_FP32 dims: [ 64 ] } ]
output [ { name: "OUTPUT" data_type: TYPE_FP32 dims: [ 8 ] },
         { name: "DEVICE" data_type: TYPE_STRING dims: [ 1 ] } ]
instance_group [ { count: 2 kind: KIND_GPU } ]
dynamic_batching { }
"""

MODEL = """
import numpy as np
import torch
import triton_python_backend_utils as pb_utils


def weight(device):
    return torch.arange(64 * 8, dtype=torch.float32, device=device).reshape(64, 8) / 512


class TritonPythonModel:
    def initialize(self, args):
        if args["model_instance_kind"] != "GPU":
            raise RuntimeError(f"instance kind {args['model_instance_kind']}, not GPU")
        self.device = torch.device("cuda", int(args["model_instance_device_id"]))
        self.weight = weight(self.device)

    def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "INPUT")
            y = torch.from_dlpack(x.to_dlpack()).to(self.device) @ self.weight
            name = np.array([[str(y.device)]] * y.shape[0], dtype=object)
            responses.append(pb_utils.InferenceResponse(output_tensors=[
                pb_utils.Tensor.from_dlpack("OUTPUT", y),
                pb_utils.Tensor("DEVICE", name),
            ]))
        return responses
"""


def test_a_python_model_computes_on_cuda(tmp_path: Path, make_server: type) -> None:
    import torch
    import tritonclient.http as httpclient

    assert torch.cuda.is_available(), "a CUDA build of torch is needed for the GPU path"
    version = tmp_path / "models" / "torch_py" / "1"
    version.mkdir(parents=True)
    (version.parent / "config.pbtxt").write_text(CONFIG)
    (version / "model.py").write_text(textwrap.dedent(MODEL))
    server = make_server(tmp_path / "models").start()
    weight = np.arange(64 * 8, dtype=np.float32).reshape(64, 8) / 512
    rng = np.random.default_rng(11)

    http = httpclient.InferenceServerClient(server.http_url)
    x = rng.standard_normal((3, 64), dtype=np.float32)
    tensor = httpclient.InferInput("INPUT", [3, 64], "FP32")
    tensor.set_data_from_numpy(x)
    result = http.infer("torch_py", [tensor])
    np.testing.assert_allclose(result.as_numpy("OUTPUT"), x @ weight, rtol=1e-3, atol=1e-3)
    assert {d.decode() for d in result.as_numpy("DEVICE").reshape(-1)} == {"cuda:0"}

    # Concurrent requests spread over both GPU instances (two worker processes).
    parallel = httpclient.InferenceServerClient(server.http_url, concurrency=16)
    inputs = [rng.standard_normal((2, 64), dtype=np.float32) for _ in range(16)]
    pending = []
    for x in inputs:
        tensor = httpclient.InferInput("INPUT", [2, 64], "FP32")
        tensor.set_data_from_numpy(x)
        pending.append(parallel.async_infer("torch_py", [tensor]))
    for x, call in zip(inputs, pending, strict=True):
        got = call.get_result(timeout=60)
        np.testing.assert_allclose(got.as_numpy("OUTPUT"), x @ weight, rtol=1e-3, atol=1e-3)
    stats = http.get_inference_statistics("torch_py")["model_stats"][0]
    assert int(stats["inference_count"]) == 3 + 32
