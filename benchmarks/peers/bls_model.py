"""Triton Python-backend model that answers each request with a BLS call to
``identity_python``: OUTPUT0 = the callee's OUTPUT0 for INPUT0.

The same file is ``model.py`` of ``bls_python`` on kiln and on Triton in
``python_backend.py --bls``, so that the two servers run identical user code and the
difference from ``identity_python`` is each server's BLS machinery (the call from the
worker to the server, the callee's request, the answer back).
"""

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests: list) -> list:
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "INPUT0")
            reply = pb_utils.InferenceRequest(
                model_name="identity_python", requested_output_names=["OUTPUT0"], inputs=[x]
            ).exec()
            if reply.has_error():
                raise pb_utils.TritonModelException(reply.error().message())
            out = pb_utils.get_output_tensor_by_name(reply, "OUTPUT0")
            responses.append(pb_utils.InferenceResponse(output_tensors=[out]))
        return responses
