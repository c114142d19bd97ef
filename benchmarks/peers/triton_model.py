"""Triton Python-backend model that runs onnxruntime on ``<version>/model.onnx``.

Copied as ``model.py`` into each version directory of the Triton repository that
``serving_peers.py`` generates, so that the ``tritonserver`` shipped in the nvidia-pytriton
wheel (python backend only, no onnxruntime backend) serves the same ONNX graph as kiln.
Requests are run one by one, like kiln's direct scheduler (no dynamic batching).
"""

import json
import os
from pathlib import Path

import onnxruntime as ort
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args: dict[str, str]) -> None:
        config = json.loads(args["model_config"])
        version_dir = Path(args["model_repository"]) / args["model_version"]
        options = ort.SessionOptions()
        options.intra_op_num_threads = os.cpu_count() or 1  # what kiln uses for one instance
        self.session = ort.InferenceSession(
            str(version_dir / "model.onnx"), options, providers=["CPUExecutionProvider"]
        )
        self.inputs = [i["name"] for i in config["input"]]
        self.outputs = [o["name"] for o in config["output"]]

    def execute(self, requests: list) -> list:
        responses = []
        for request in requests:
            feed = {
                n: pb_utils.get_input_tensor_by_name(request, n).as_numpy() for n in self.inputs
            }
            results = self.session.run(self.outputs, feed)
            tensors = [pb_utils.Tensor(n, r) for n, r in zip(self.outputs, results, strict=True)]
            responses.append(pb_utils.InferenceResponse(output_tensors=tensors))
        return responses
