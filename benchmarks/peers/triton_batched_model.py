"""Triton Python-backend model for the batching benchmark: one onnxruntime run per batch.

With ``dynamic_batching`` on, Triton hands ``execute`` the list of requests its batcher
merged. A python model gets them as separate requests, so this one does what a fair Triton
python model does: concatenate every request's inputs along dimension 0, run onnxruntime
once, and give each request back its own rows. Copied as ``model.py`` by ``batching.py``.
"""

import json
import os
from pathlib import Path

import numpy as np
import onnxruntime as ort
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args: dict[str, str]) -> None:
        config = json.loads(args["model_config"])
        version_dir = Path(args["model_repository"]) / args["model_version"]
        options = ort.SessionOptions()
        options.intra_op_num_threads = os.cpu_count() or 1  # what kiln uses for one instance
        # kiln's default (spinning threads steal the cores the front end needs).
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        self.session = ort.InferenceSession(
            str(version_dir / "model.onnx"), options, providers=["CPUExecutionProvider"]
        )
        self.inputs = [i["name"] for i in config["input"]]
        self.outputs = [o["name"] for o in config["output"]]

    def execute(self, requests: list) -> list:
        parts = [
            [pb_utils.get_input_tensor_by_name(r, n).as_numpy() for n in self.inputs]
            for r in requests
        ]
        feed = {
            name: parts[0][i] if len(parts) == 1 else np.concatenate([p[i] for p in parts])
            for i, name in enumerate(self.inputs)
        }
        results = self.session.run(self.outputs, feed)
        responses, offset = [], 0
        for p in parts:
            end = offset + p[0].shape[0]
            tensors = [
                pb_utils.Tensor(n, np.ascontiguousarray(r[offset:end]))
                for n, r in zip(self.outputs, results, strict=True)
            ]
            responses.append(pb_utils.InferenceResponse(output_tensors=tensors))
            offset = end
        return responses
