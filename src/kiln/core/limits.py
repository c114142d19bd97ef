"""What one request may carry, whatever frontend it came through.

Shapes are checked while decoding, before any tensor is allocated from them (a client's
shape must never size an allocation on its own); parameters are checked once, in
``Server.infer``, before anything walks or serializes them. Both name the model and the
tensor or parameter, so HTTP, gRPC and the Python API refuse the same things alike.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from kiln.core.errors import invalid_arg
from kiln.core.types import InferenceRequest

MAX_RANK = 64  # far beyond any real model; refuses shapes built to cost time
INT64_MAX = 2**63 - 1  # an element count must fit the int64 of every wire format
MAX_PARAMETERS = 64  # per request, per input and per output
MAX_PARAMETER_NAME = 256  # characters
MAX_PARAMETER_STRING = 64 * 1024  # characters (bytes, from the Python API)
# KServe v2 parameters are bool, int64 or string (Triton adds double and uint64 on gRPC).
_INT_MIN, _UINT_MAX = -(2**63), 2**64 - 1


def _fmt(shape: Iterable[Any]) -> str:
    return "[" + ",".join(str(d) for d in shape) + "]"


def tensor_elements(
    model: str, tensor: str, shape: tuple[int, ...] | list[Any], max_elements: int = 0
) -> int:
    """The element count of an input's ``shape``: a list of at most ``MAX_RANK``
    non-negative integers whose product fits int64 and, when ``max_elements`` is set
    (``--max-tensor-elements``), is at most that. Cost is bounded by ``MAX_RANK``."""
    where = f"input '{tensor}' for model '{model}'"
    if len(shape) > MAX_RANK:
        raise invalid_arg(f"{where} has a shape of rank {len(shape)}, more than {MAX_RANK}")
    count = 1
    for d in shape:
        # bool is no dimension; NumPy integers are (a shape built in Python)
        if isinstance(d, bool) or not isinstance(d, int | np.integer) or d < 0:
            raise invalid_arg(
                f"{where}: 'shape' must hold non-negative integers, got {list(shape)}"
            )
        count *= int(d)
        if count > INT64_MAX:  # early: a huge product is never built up
            raise invalid_arg(f"{where}: the element count of shape {list(shape)} overflows int64")
    if max_elements and count > max_elements:
        raise invalid_arg(
            f"{where} has {count} elements (shape {_fmt(shape)}), more than the server's "
            f"limit of {max_elements} (--max-tensor-elements)"
        )
    return count


def check_parameters(request: InferenceRequest) -> None:
    """Request, input and output parameters are flat maps of scalars (KServe v2): a
    nested value would reach backends that serialize it (a Python model's worker)."""
    model = request.model_name
    _check_map(request.parameters, f"the request for model '{model}'")
    for tensor in request.inputs:
        _check_map(tensor.parameters, f"input '{tensor.name}' for model '{model}'")
    for out in request.outputs:
        _check_map(out.parameters, f"output '{out.name}' for model '{model}'")


def _check_map(params: Mapping[str, Any] | Any, where: str) -> None:
    if not params:
        return
    if not isinstance(params, Mapping):
        raise invalid_arg(f"the parameters of {where} must be an object")
    if len(params) > MAX_PARAMETERS:
        raise invalid_arg(
            f"{where} has {len(params)} parameters, more than the limit of {MAX_PARAMETERS}"
        )
    for key, value in params.items():
        if not isinstance(key, str) or not key or len(key) > MAX_PARAMETER_NAME:
            raise invalid_arg(
                f"a parameter name of {where} must be a string of 1 to {MAX_PARAMETER_NAME} "
                "characters"
            )
        problem = _scalar_problem(value)
        if problem:
            raise invalid_arg(f"parameter '{key}' of {where} {problem}")


def _scalar_problem(value: Any) -> str:
    """Why ``value`` is no parameter value ("" when it is one)."""
    if isinstance(value, bool | np.bool_ | float | np.floating):
        return ""
    if isinstance(value, int | np.integer):
        if _INT_MIN <= int(value) <= _UINT_MAX:
            return ""
        return "is an integer out of the int64/uint64 range"
    if isinstance(value, str | bytes):
        if len(value) <= MAX_PARAMETER_STRING:
            return ""
        return f"is a string of {len(value)} characters, more than {MAX_PARAMETER_STRING}"
    kind = {dict: "an object", list: "an array", type(None): "null"}.get(
        type(value), type(value).__name__
    )
    return f"must be a bool, an integer, a double or a string, got {kind}"
