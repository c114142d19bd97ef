"""KServe v2 REST bodies <-> InferenceRequest / InferenceResponse.

Handles JSON tensors and Triton's binary tensor data extension (a JSON header followed by
raw tensors; ``Inference-Header-Content-Length`` says where the JSON ends). Every error
names the tensor it is about. Shape/model checks happen later, once, in core.
"""

from __future__ import annotations

import asyncio
from itertools import chain
from typing import Any

import numpy as np
import orjson

from kiln.config.signature import ModelSignature
from kiln.core.errors import invalid_arg
from kiln.core.limits import tensor_elements
from kiln.core.types import (
    DataType,
    InferenceRequest,
    InferenceResponse,
    InferInput,
    RequestedOutput,
    element_count,
)
from kiln.frontends import json_pieces
from kiln.frontends.json_pieces import ENCODE_SLICE, OFF_LOOP_PARSE_BYTES
from kiln.frontends.tensors import from_binary, python_elements, to_binary

_JSON_OPTS = orjson.OPT_SERIALIZE_NUMPY

# Triton's binary tensor extension: the JSON header's length when binary data follows it.
HEADER_LENGTH = "inference-header-content-length"
# JSON integer tensors up to this many values are range-checked with Python's min/max.
_SMALL = 1024


def _shape(model: str, tensor: str, value: Any, max_elements: int) -> tuple[int, ...]:
    if not isinstance(value, list):
        raise invalid_arg(f"input '{tensor}': 'shape' must be an array of integers")
    tensor_elements(model, tensor, value, max_elements)  # rank, dims, count: before any data
    return tuple(value)


def _parameters(where: str, value: Any) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise invalid_arg(f"{where}: 'parameters' must be an object")
    return value


def parse_json(buffer: bytes | memoryview) -> dict[str, Any]:
    """A body that must be a JSON object; one over ``OFF_LOOP_PARSE_BYTES`` is parsed a
    piece at a time (``json_pieces``: the caller runs it on a worker thread)."""
    try:
        if len(buffer) > OFF_LOOP_PARSE_BYTES:
            obj = json_pieces.loads(buffer)
        else:
            obj = orjson.loads(buffer)
    except ValueError as exc:  # orjson.JSONDecodeError is one
        raise invalid_arg(f"failed to parse the request JSON buffer: {exc}") from None
    if not isinstance(obj, dict):
        kind = "array" if isinstance(obj, list) else type(obj).__name__
        raise invalid_arg(f"the request JSON must be an object, got {kind}")
    return obj


async def parse_body(body: bytes) -> dict[str, Any]:
    """:func:`parse_json` on a worker thread for a body over ``OFF_LOOP_PARSE_BYTES``
    (small ones stay on the loop, where a thread hop would cost more than the parse)."""
    if len(body) > OFF_LOOP_PARSE_BYTES:
        return await asyncio.to_thread(parse_json, body)
    return parse_json(body)


def decode_request(
    body: bytes,
    header_length: int | None,
    model_name: str,
    model_version: str,
    max_elements: int = 0,
) -> InferenceRequest:
    """``max_elements``: ``--max-tensor-elements`` (0: none), applied before decoding data."""
    header: bytes | memoryview = body  # whole: json_pieces would copy a memoryview
    binary = memoryview(b"")
    if header_length is not None:
        if header_length < 0 or header_length > len(body):
            raise invalid_arg(
                f"Inference-Header-Content-Length {header_length} is larger than the request "
                f"body ({len(body)} bytes)"
            )
        view = memoryview(body)
        header, binary = view[:header_length], view[header_length:]
    obj = parse_json(header)
    request = InferenceRequest(model_name=model_name, model_version=model_version)
    rid = obj.get("id", "")
    if not isinstance(rid, str):
        raise invalid_arg("request 'id' must be a string")
    request.id = rid
    request.parameters = _parameters("request", obj.get("parameters"))
    inputs = obj.get("inputs")
    if not isinstance(inputs, list):
        raise invalid_arg("the request JSON needs an 'inputs' array")
    offset = 0
    for index, item in enumerate(inputs):
        if not isinstance(item, dict):
            raise invalid_arg(f"inputs[{index}] must be an object")
        name = item.get("name")
        if not isinstance(name, str) or not name:
            raise invalid_arg(f"inputs[{index}] needs a 'name' string")
        raw_dt = item.get("datatype")
        if not isinstance(raw_dt, str):
            raise invalid_arg(f"input '{name}' needs a 'datatype' string")
        try:
            datatype = DataType.from_wire(raw_dt)
        except ValueError as exc:
            raise invalid_arg(f"input '{name}': {exc}") from None
        shape = _shape(model_name, name, item.get("shape"), max_elements)
        params = _parameters(f"input '{name}'", item.get("parameters"))
        size = params.get("binary_data_size")
        if size is not None:
            if not isinstance(size, int) or isinstance(size, bool) or size < 0:
                raise invalid_arg(f"input '{name}': 'binary_data_size' must be an integer >= 0")
            if offset + size > len(binary):
                raise invalid_arg(
                    f"input '{name}': binary_data_size {size} runs past the end of the "
                    f"request body ({len(binary) - offset} bytes left)"
                )
            data = from_binary(name, datatype, shape, binary[offset : offset + size])
            offset += size
        elif "data" in item:
            data = from_json(name, datatype, shape, item["data"])
        elif "shared_memory_region" in params:
            data = np.empty(0)  # filled in by the shared-memory layer
        else:
            raise invalid_arg(f"input '{name}' has neither 'data' nor 'binary_data_size'")
        request.inputs.append(InferInput(name, datatype, shape, data, params))
    if offset != len(binary):
        raise invalid_arg(
            f"the binary_data_size of the inputs add up to {offset} bytes, but the request "
            f"body holds {len(binary)} bytes after the JSON header"
        )
    outputs = obj.get("outputs")
    if outputs is not None:
        if not isinstance(outputs, list):
            raise invalid_arg("'outputs' must be an array")
        for index, item in enumerate(outputs):
            if not isinstance(item, dict) or not isinstance(item.get("name"), str):
                raise invalid_arg(f"outputs[{index}] must be an object with a 'name'")
            request.outputs.append(
                RequestedOutput(
                    item["name"], _parameters(f"output '{item['name']}'", item.get("parameters"))
                )
            )
    return request


def decode_raw_request(
    body: bytes, signature: ModelSignature, model_name: str, model_version: str
) -> InferenceRequest:
    """``Inference-Header-Content-Length: 0``: the body is the one input's bytes, batch 1."""
    if len(signature.inputs) != 1:
        raise invalid_arg(
            f"raw binary request (Inference-Header-Content-Length: 0) needs a model with "
            f"exactly one input; '{model_name}' has {len(signature.inputs)}"
        )
    spec = next(iter(signature.inputs.values()))
    dims = list(spec.dims)
    if dims.count(-1) > 1 or (spec.datatype is DataType.BYTES and dims != [1]):
        raise invalid_arg(
            f"raw binary request: input '{spec.name}' of '{model_name}' must have at most one "
            "variable dimension (BYTES: shape [1])"
        )
    if spec.datatype is DataType.BYTES:
        shape = [1]
    else:
        known = element_count([d for d in dims if d != -1]) * spec.datatype.itemsize
        if -1 in dims:
            if known == 0 or len(body) % known:
                raise invalid_arg(
                    f"raw binary request: {len(body)} bytes do not fit input '{spec.name}'"
                )
            dims[dims.index(-1)] = len(body) // known
        shape = dims
    full = tuple(([1] if signature.max_batch_size > 0 else []) + shape)
    if spec.datatype is DataType.BYTES:
        data = np.array([bytes(body)], dtype=object).reshape(full)
    else:
        data = from_binary(spec.name, spec.datatype, full, memoryview(body))
    request = InferenceRequest(model_name=model_name, model_version=model_version)
    request.inputs.append(InferInput(spec.name, spec.datatype, full, data))
    request.parameters["binary_data_output"] = True
    return request


def from_json(name: str, datatype: DataType, shape: tuple[int, ...], data: Any) -> np.ndarray:
    """``data``, flat or nested, as a ``shape`` tensor. Its layout and element count are
    checked against the shape before any array is built from it, and NumPy never guesses
    a type from it: a guess of strings sizes every element as the longest one."""
    if datatype in (DataType.FP16, DataType.BF16):
        raise invalid_arg(
            f"receiving {datatype.value} data via JSON is not supported. Please use the binary "
            f"data format for input '{name}'"
        )
    count = element_count(shape)
    try:
        groups, types = _leaves(data)
        held = _count(groups)
        if held != count:  # before anything is built from the data
            raise invalid_arg(
                f"input '{name}': shape {list(shape)} expects {count} elements, but 'data' "
                f"holds {held}"
            )
        flat = groups[0] if len(groups) == 1 else _flatten(groups)
        if datatype is DataType.BYTES:
            arr = _bytes(flat, types)
        elif datatype is DataType.BOOL:
            if types - {bool}:
                raise TypeError("BOOL data must be JSON booleans")
            arr = _array(flat, np.dtype(np.bool_))
        else:
            arr = _numbers(flat, types, datatype.numpy_dtype)
    except (TypeError, ValueError, OverflowError) as exc:
        raise invalid_arg(
            f"input '{name}': unable to parse 'data' as {datatype.value}: {exc}"
        ) from None
    return arr.reshape(shape)


def _leaves(data: Any) -> tuple[list[list[Any]], set[type]]:
    """The innermost arrays of ``data`` (their scalars in order) and the scalars' types.
    Walks one nesting level at a time: Python work per array, C work (``map``) per scalar,
    and nothing sized by a guess. No C call takes more than ``ENCODE_SLICE`` elements: one
    holds the GIL throughout, so over a 32 M-element ``data`` it held the event loop for
    half a second even from the worker thread a large body decodes on."""
    groups: list[list[Any]] = [data if isinstance(data, list) else [data]]
    while True:
        types: set[type] = set()
        for group in groups:
            if len(group) <= ENCODE_SLICE:
                types.update(map(type, group))
            else:
                for start in range(0, len(group), ENCODE_SLICE):
                    types.update(map(type, group[start : start + ENCODE_SLICE]))
        if list not in types:
            return groups, types
        if len(types) > 1:
            raise TypeError("'data' mixes arrays and values at one depth")
        groups = _flatten(groups)
        if len({len(g) for g in groups}) > 1:
            raise ValueError("'data' is a ragged nested array")


def _count(groups: list[list[Any]]) -> int:
    """``sum(map(len, groups))``, ``ENCODE_SLICE`` groups a C call."""
    if len(groups) <= ENCODE_SLICE:
        return sum(map(len, groups))
    return sum(
        sum(map(len, groups[start : start + ENCODE_SLICE]))
        for start in range(0, len(groups), ENCODE_SLICE)
    )


def _flatten(groups: list[list[Any]]) -> list[Any]:
    """``list(chain.from_iterable(groups))``, ``ENCODE_SLICE`` elements a C call."""
    out: list[Any] = []
    for start in range(0, len(groups), ENCODE_SLICE):
        batch = groups[start : start + ENCODE_SLICE]
        if sum(map(len, batch)) <= ENCODE_SLICE:
            out.extend(chain.from_iterable(batch))
            continue
        for group in batch:
            for at in range(0, len(group), ENCODE_SLICE):
                out.extend(group[at : at + ENCODE_SLICE])
    return out


def _array(flat: list[Any], dtype: np.dtype[Any]) -> np.ndarray:
    """``np.array(flat, dtype=dtype)``, ``ENCODE_SLICE`` elements a call (each raises what
    the whole would: OverflowError, TypeError), so the GIL changes hands between them."""
    if len(flat) <= ENCODE_SLICE:
        return np.array(flat, dtype=dtype)
    out = np.empty(len(flat), dtype=dtype)
    for start in range(0, len(flat), ENCODE_SLICE):
        out[start : start + ENCODE_SLICE] = np.array(flat[start : start + ENCODE_SLICE], dtype)
    return out


def _bytes(flat: list[Any], types: set[type]) -> np.ndarray:
    if types - {str, int, float}:
        raise TypeError(f"expected strings, got {_what(types - {str, int, float})}")
    arr = np.empty(len(flat), dtype=object)
    for i, v in enumerate(flat):
        arr[i] = v.encode() if isinstance(v, str) else str(v).encode()
    return arr


def _numbers(flat: list[Any], types: set[type], dtype: np.dtype[Any]) -> np.ndarray:
    """JSON numbers -> ``dtype``, refusing what a cast would silently change: 2.5 or true
    for an integer tensor, strings, and integers outside the type's range."""
    if not flat:
        return np.empty(0, dtype=dtype)
    if dtype.kind in "iu":
        if types != {int}:
            raise TypeError(f"expected integers, got {_what(types - {int})}")
        info = np.iinfo(dtype)
        if len(flat) <= _SMALL:  # builtins beat NumPy's per-call cost on a few values
            low, high = min(flat), max(flat)
            if low < info.min or high > info.max:
                raise OverflowError(f"{low if low < info.min else high} is out of range")
            return np.array(flat, dtype=dtype)
        try:
            wide = _array(flat, np.dtype(np.int64))
        except OverflowError:
            if dtype != np.uint64:
                raise OverflowError("a value is out of range") from None
            # UINT64 values >= 2**63; a negative one makes this raise too
            wide = _array(flat, np.dtype(np.uint64))
        low, high = int(wide.min()), int(wide.max())
        if low < info.min or high > info.max:
            raise OverflowError(f"{low if low < info.min else high} is out of range")
        return wide.astype(dtype)
    if types - {int, float}:
        raise TypeError(f"expected numbers, got {_what(types - {int, float})}")
    return _array(flat, np.dtype(np.float64)).astype(dtype)


def _what(types: set[type]) -> str:
    if len(types) > 1:
        return "mixed values"
    names = {bool: "booleans", float: "floats", str: "strings", dict: "objects"}
    return names.get(next(iter(types)), "non-numbers") if types else "nothing"


def _want_binary(request: InferenceRequest, name: str, default: bool) -> bool:
    for out in request.outputs:
        if out.name == name and "binary_data" in out.parameters:
            return bool(out.parameters["binary_data"])
    return default


def encode_elements(response: InferenceResponse, request: InferenceRequest) -> int:
    """How many output elements cost ``encode_response`` Python work each (known before
    encoding: the outputs' sizes): those written as JSON, and BYTES ones written binary."""
    default_binary = bool(request.parameters.get("binary_data_output", False))
    total = 0
    for out in response.outputs:
        if "shared_memory_region" in out.parameters:
            continue
        if _want_binary(request, out.name, default_binary):
            total += python_elements(out.datatype, out.data)
        else:
            total += out.data.size
    return total


def encode_response(
    response: InferenceResponse, request: InferenceRequest, pieces: bool = False
) -> tuple[bytes, int | None]:
    """Body bytes, and the JSON header's length when binary tensors follow it. ``pieces``:
    each JSON tensor is encoded a slice at a time (the same bytes), for a worker thread
    that must let the event loop have the GIL between slices."""
    default_binary = bool(request.parameters.get("binary_data_output", False))
    outputs = []
    chunks: list[bytes] = []
    datas: list[Any] = []  # with ``pieces``: each entry's JSON data, encoded apart
    for out in response.outputs:
        entry: dict[str, Any] = {
            "name": out.name,
            "datatype": out.datatype.value,
            "shape": list(out.shape),
        }
        if out.parameters:
            entry["parameters"] = dict(out.parameters)
        data = None
        if "shared_memory_region" in out.parameters:
            pass  # the tensor went to shared memory; only its parameters come back
        elif _want_binary(request, out.name, default_binary):
            raw = to_binary(out.datatype, out.data)
            entry.setdefault("parameters", {})["binary_data_size"] = len(raw)
            chunks.append(raw)
        elif pieces:
            data = to_json_data(out.datatype, out.data)
        else:
            entry["data"] = to_json_data(out.datatype, out.data)
        outputs.append(entry)
        datas.append(data)
    body: dict[str, Any] = {
        "model_name": response.model_name,
        "model_version": response.model_version,
    }
    if response.id:
        body["id"] = response.id
    if response.parameters:
        body["parameters"] = response.parameters
    if pieces:
        header = _dumps_in_pieces(body, outputs, datas)
    else:
        body["outputs"] = outputs
        header = orjson.dumps(body, option=_JSON_OPTS)
    if not chunks:
        return header, None
    return b"".join([header, *chunks]), len(header)


def _dumps_in_pieces(
    body: dict[str, Any], outputs: list[dict[str, Any]], datas: list[Any]
) -> bytes:
    """``orjson.dumps({**body, "outputs": outputs})`` with each output's ``datas`` entry
    (when not None) as its last key, ``"data"``, encoded a slice at a time."""
    entries = []
    for entry, data in zip(outputs, datas, strict=True):
        text = orjson.dumps(entry, option=_JSON_OPTS)
        if data is not None:
            text = b"".join(
                [text[:-1], b',"data":', json_pieces.dumps_array(data, _JSON_OPTS), b"}"]
            )
        entries.append(text)
    head = orjson.dumps(body, option=_JSON_OPTS)[:-1]
    return b"".join([head, b',"outputs":[', b",".join(entries), b"]}"])


def to_json_data(datatype: DataType, data: np.ndarray) -> Any:
    if datatype is DataType.BYTES:
        return [
            v.decode("utf-8", "replace") if isinstance(v, bytes) else str(v) for v in data.ravel()
        ]
    if datatype is DataType.BF16:
        return np.ascontiguousarray(data, dtype=np.float32).ravel()
    return np.ascontiguousarray(data).ravel()
