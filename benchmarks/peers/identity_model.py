"""Identity Triton Python-backend model: OUTPUT0 = INPUT0, one response per request.

The same file is ``model.py`` of ``identity_python`` on kiln and on Triton in
``python_backend.py``, so that the two servers run identical user code and the difference is
the backend machinery (request hand-off to the worker process, shared memory, responses).
"""

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests: list) -> list:
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()
            out = pb_utils.Tensor("OUTPUT0", x)
            responses.append(pb_utils.InferenceResponse(output_tensors=[out]))
        return responses
