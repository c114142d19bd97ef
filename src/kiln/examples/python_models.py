"""The example repository's Python-backend models: their model.py and config.pbtxt text.

Written as text because they are the user's files, not kiln's modules: they import
``triton_python_backend_utils``, which exists only inside a Python-backend worker (or after
``kiln.backends.python.pb_utils.install()``).
"""

from __future__ import annotations

# What image_preprocess does in ONNX, in NumPy: each request of the dynamic batcher's list
# is answered on its own, as a Triton Python model does.
PYTHON_PREPROCESS_MODEL = """\
import json

import numpy as np
import triton_python_backend_utils as pb_utils

PIXEL_MAX = np.float32(255.0)


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        output = pb_utils.get_output_config_by_name(config, "NORMALIZED")
        self.dtype = pb_utils.triton_string_to_numpy(output["data_type"])

    def execute(self, requests):
        responses = []
        for request in requests:
            image = pb_utils.get_input_tensor_by_name(request, "IMAGE").as_numpy()
            # [batch, H, W, C] uint8 -> [batch, C, H, W] in [0, 1]
            scaled = image.astype(np.float32) / PIXEL_MAX
            normalized = np.ascontiguousarray(scaled.transpose(0, 3, 1, 2), dtype=self.dtype)
            out = pb_utils.Tensor("NORMALIZED", normalized)
            responses.append(pb_utils.InferenceResponse(output_tensors=[out]))
        return responses
"""

PYTHON_PREPROCESS_CONFIG = """\
name: "python_preprocess"
backend: "python"
max_batch_size: 32
input [
  {
    name: "IMAGE"
    data_type: TYPE_UINT8
    format: FORMAT_NHWC
    dims: [ 28, 28, 1 ]
  }
]
output [
  {
    name: "NORMALIZED"
    data_type: TYPE_FP32
    dims: [ 1, 28, 28 ]
  }
]
dynamic_batching { }
instance_group [
  {
    count: 1
    kind: KIND_CPU
  }
]
"""

# Triton's "repeat" example reduced to its core: IN holds n values; the model answers with
# n responses, the i-th carrying OUT = [IN[i]] and IDX = [i], then closes the stream.
REPEAT_INT32_MODEL = """\
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            values = pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()
            sender = request.get_response_sender()
            for index, value in enumerate(values.reshape(-1)):
                outputs = [
                    pb_utils.Tensor("OUT", np.array([value], dtype=np.int32)),
                    pb_utils.Tensor("IDX", np.array([index], dtype=np.uint32)),
                ]
                sender.send(pb_utils.InferenceResponse(output_tensors=outputs))
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
"""

REPEAT_INT32_CONFIG = """\
name: "repeat_int32"
backend: "python"
max_batch_size: 0
model_transaction_policy {
  decoupled: true
}
input [
  {
    name: "IN"
    data_type: TYPE_INT32
    dims: [ -1 ]
  }
]
output [
  {
    name: "OUT"
    data_type: TYPE_INT32
    dims: [ 1 ]
  },
  {
    name: "IDX"
    data_type: TYPE_UINT32
    dims: [ 1 ]
  }
]
instance_group [
  {
    count: 1
    kind: KIND_CPU
  }
]
"""
