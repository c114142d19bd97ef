"""Seldon MLServer custom runtime that runs onnxruntime on the model's ``uri``.

``serving_peers.py`` points each ``model-settings.json`` at ``mlserver_runtime.OnnxRuntime``
with ``parameters.uri`` set to the same ``model.onnx`` kiln serves.
"""

import os

import onnxruntime as ort
from mlserver import MLModel
from mlserver.codecs import NumpyCodec
from mlserver.types import InferenceRequest, InferenceResponse


class OnnxRuntime(MLModel):
    async def load(self) -> bool:
        options = ort.SessionOptions()
        options.intra_op_num_threads = os.cpu_count() or 1  # what kiln uses for one instance
        params = self.settings.parameters
        uri = params.uri if params else None
        # batching.py turns spinning off as kiln does by default (parameters.extra).
        spinning = str((params.extra or {}).get("allow_spinning", "1")) if params else "1"
        options.add_session_config_entry("session.intra_op.allow_spinning", spinning)
        self.session = ort.InferenceSession(uri, options, providers=["CPUExecutionProvider"])
        self.output_names = [o.name for o in self.session.get_outputs()]
        return True

    async def predict(self, payload: InferenceRequest) -> InferenceResponse:
        feed = {i.name: NumpyCodec.decode_input(i) for i in payload.inputs}
        results = self.session.run(self.output_names, feed)
        return InferenceResponse(
            model_name=self.name,
            outputs=[
                NumpyCodec.encode_output(n, r)
                for n, r in zip(self.output_names, results, strict=True)
            ],
        )
