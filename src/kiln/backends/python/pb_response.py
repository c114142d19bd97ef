"""pb_utils' ``InferenceResponse``: a model's answer to one request, or a BLS call's answer
to the model (re-exported by ``pb_utils``)."""

from __future__ import annotations

import json
from typing import Any

from kiln.backends.python.pb_errors import TritonError, TritonModelException
from kiln.backends.python.pb_tensor import Tensor

__all__ = ["InferenceResponse", "get_output_tensor_by_name"]

_PARAMETER_TYPES = (bool, int, float, str)


def _response_parameters(parameters: dict[str, Any] | str | None) -> str:
    """A response's parameters as JSON, checked as Triton checks them: an object whose
    values are bool, int, float or str (they reach the client as the response's
    ``parameters``)."""
    if isinstance(parameters, str):
        try:
            parameters = json.loads(parameters or "{}")
        except json.JSONDecodeError as exc:
            raise TritonModelException(
                f"InferenceResponse parameters: not valid JSON ({exc})"
            ) from None
    if parameters is None:
        return "{}"
    if not isinstance(parameters, dict):
        raise TritonModelException(
            f"InferenceResponse parameters must be a dict, got {type(parameters).__name__}"
        )
    for key, value in parameters.items():
        if not isinstance(key, str):
            raise TritonModelException(f"InferenceResponse parameters: key {key!r} must be a str")
        if not isinstance(value, _PARAMETER_TYPES):
            raise TritonModelException(
                f"InferenceResponse parameter '{key}' must be a bool, int, float or str, "
                f"got {type(value).__name__}"
            )
    return json.dumps(parameters)


class InferenceResponse:
    __module__ = "kiln.backends.python.pb_utils"  # pb_utils' API, where it was defined

    def __init__(
        self,
        output_tensors: list[Tensor] | None = None,
        error: TritonError | None = None,
        parameters: dict[str, Any] | str | None = None,
    ) -> None:
        self._outputs = list(output_tensors or [])
        self._error = error
        self._parameters = _response_parameters(parameters)

    def output_tensors(self) -> list[Tensor]:
        return self._outputs

    def has_error(self) -> bool:
        return self._error is not None

    def error(self) -> TritonError | None:
        return self._error

    def parameters(self) -> str:
        return self._parameters


def get_output_tensor_by_name(response: InferenceResponse, name: str) -> Tensor | None:
    return next((t for t in response.output_tensors() if t.name() == name), None)
