"""``ModelInferRequest`` / ``ModelInferResponse`` <-> core's request and response.

Only the wire is checked here (datatype spelling, raw vs typed contents, byte and element
counts, each error naming its tensor); names, shapes and batch sizes are checked once, in
core, so gRPC and HTTP refuse the same requests with the same messages.
"""

from __future__ import annotations

from typing import Any

import numpy as np

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
from kiln.frontends.grpc.grpc_service_pb2 import (
    InferParameter,
    InferTensorContents,
    ModelInferRequest,
    ModelInferResponse,
)
from kiln.frontends.tensors import fp32_to_bf16, from_binary, serialize_bytes

# Which InferTensorContents field carries each datatype (FP16/BF16 have none: raw only).
TYPED_FIELD = {
    DataType.BOOL: "bool_contents",
    DataType.INT8: "int_contents",
    DataType.INT16: "int_contents",
    DataType.INT32: "int_contents",
    DataType.INT64: "int64_contents",
    DataType.UINT8: "uint_contents",
    DataType.UINT16: "uint_contents",
    DataType.UINT32: "uint_contents",
    DataType.UINT64: "uint64_contents",
    DataType.FP32: "fp32_contents",
    DataType.FP64: "fp64_contents",
    DataType.BYTES: "bytes_contents",
}

SHM_REGION = "shared_memory_region"
_CHUNK = 1 << 16  # typed contents copied per slice (``_array``)


# ---- parameters ----------------------------------------------------------------------
def parameters_to_dict(params: Any) -> dict[str, Any]:
    """``map<string, InferParameter>`` (or ModelRepositoryParameter) -> plain values."""
    out: dict[str, Any] = {}
    for key, value in params.items():
        which = value.WhichOneof("parameter_choice")
        out[key] = getattr(value, which) if which is not None else None
    return out


def set_parameters(target: Any, params: dict[str, Any]) -> None:
    for key, value in params.items():
        target[key].CopyFrom(to_infer_parameter(value))


def to_infer_parameter(value: Any) -> InferParameter:
    if isinstance(value, bool | np.bool_):
        return InferParameter(bool_param=bool(value))
    if isinstance(value, int | np.integer):
        v = int(value)
        return InferParameter(uint64_param=v) if v >= 2**63 else InferParameter(int64_param=v)
    if isinstance(value, float | np.floating):
        return InferParameter(double_param=float(value))
    if isinstance(value, bytes):
        return InferParameter(string_param=value.decode("utf-8", "replace"))
    return InferParameter(string_param=str(value))


# ---- request -------------------------------------------------------------------------
def decode_request(msg: ModelInferRequest, max_elements: int = 0) -> InferenceRequest:
    """``max_elements``: ``--max-tensor-elements`` (0: none), applied before decoding data."""
    request = InferenceRequest(
        model_name=msg.model_name,
        model_version=msg.model_version,
        id=msg.id,
        parameters=parameters_to_dict(msg.parameters),
    )
    raw = msg.raw_input_contents
    # raw entries go, in order, to the inputs that carry their data in the message: the
    # ones with a shared-memory region take none (as tritonclient sends them).
    wants_raw = [t.name for t in msg.inputs if SHM_REGION not in t.parameters]
    if raw:
        # Triton's check and text, before the count (its client examples test for it)
        for tensor in msg.inputs:
            if SHM_REGION not in tensor.parameters and tensor.HasField("contents"):
                raise invalid_arg(
                    f"contents field must not be specified when using raw_input_contents "
                    f"for '{tensor.name}' for model '{msg.model_name}'"
                )
    if raw and len(raw) != len(wants_raw):
        if len(raw) < len(wants_raw):
            detail = f"input '{wants_raw[len(raw)]}' has none"
        else:
            detail = f"{len(raw) - len(wants_raw)} more than there are inputs to take them"
        raise invalid_arg(
            f"the request holds {len(raw)} raw_input_contents for {len(wants_raw)} inputs "
            f"sending data in the message ({detail}) for model '{msg.model_name}'"
        )
    next_raw = 0
    for tensor in msg.inputs:
        name = tensor.name
        try:
            datatype = DataType.from_wire(tensor.datatype)
        except ValueError as exc:
            raise invalid_arg(f"input '{name}': {exc}") from None
        shape = tuple(tensor.shape)
        tensor_elements(msg.model_name, name, shape, max_elements)  # before any data
        params = parameters_to_dict(tensor.parameters)
        has_contents = tensor.HasField("contents")
        if SHM_REGION in params:
            if has_contents:
                raise invalid_arg(
                    f"input '{name}' has both a shared-memory region and 'contents' for "
                    f"model '{msg.model_name}'"
                )
            data = np.empty(0)  # filled in by the shared-memory layer
        elif raw:
            data = from_raw(name, datatype, shape, raw[next_raw])
            next_raw += 1
        else:
            data = from_contents(name, datatype, shape, tensor.contents)
        request.inputs.append(InferInput(name, datatype, shape, data, params))
    for out in msg.outputs:
        request.outputs.append(RequestedOutput(out.name, parameters_to_dict(out.parameters)))
    return request


def from_raw(name: str, datatype: DataType, shape: tuple[int, ...], buf: bytes) -> np.ndarray:
    return from_binary(name, datatype, shape, buf, "raw_input_contents")


def from_contents(
    name: str, datatype: DataType, shape: tuple[int, ...], contents: InferTensorContents
) -> np.ndarray:
    field = TYPED_FIELD.get(datatype)
    if field is None:
        raise invalid_arg(
            f"input '{name}': {datatype.value} has no typed 'contents' field; send it in "
            "raw_input_contents"
        )
    values = getattr(contents, field)
    count = element_count(shape)
    if len(values) != count:
        raise invalid_arg(
            f"input '{name}': shape {list(shape)} expects {count} elements, but "
            f"contents.{field} holds {len(values)}"
        )
    if datatype is DataType.BYTES:
        return _array(values, np.dtype(object)).reshape(shape)
    if field in ("int_contents", "uint_contents") and datatype.itemsize < 4:
        # INT8/INT16/UINT8/UINT16 travel widened: refuse values their type cannot hold.
        wide = _array(values, np.dtype(np.int64))
        info = np.iinfo(datatype.numpy_dtype)
        if wide.size and (wide.min() < info.min or wide.max() > info.max):
            raise invalid_arg(
                f"input '{name}': contents.{field} holds values outside the range of "
                f"{datatype.value} [{info.min}, {info.max}]"
            )
        return wide.astype(datatype.numpy_dtype).reshape(shape)
    return _array(values, datatype.numpy_dtype).reshape(shape)


def _array(values: Any, dtype: np.dtype[Any]) -> np.ndarray:
    """A repeated field's values as a ``dtype`` array, copied a slice at a time: one NumPy
    call over millions of a message's values never gives up the GIL, so it would hold the
    event loop even from the worker thread a big message decodes on."""
    out = np.empty(len(values), dtype=dtype)
    for start in range(0, len(values), _CHUNK):
        out[start : start + _CHUNK] = values[start : start + _CHUNK]
    return out


# ---- response ------------------------------------------------------------------------
def to_raw(datatype: DataType, data: np.ndarray) -> bytes:
    if datatype is DataType.BYTES:
        return serialize_bytes(data)
    if datatype is DataType.BF16:
        return fp32_to_bf16(data).tobytes()
    return np.ascontiguousarray(data, dtype=datatype.numpy_dtype.newbyteorder("<")).tobytes()


def encode_response(response: InferenceResponse) -> ModelInferResponse:
    """Every output travels in raw_output_contents, one entry per output, in order:
    tritonclient's ``as_numpy`` decodes only those."""
    msg = ModelInferResponse(
        model_name=response.model_name, model_version=response.model_version, id=response.id
    )
    set_parameters(msg.parameters, response.parameters)
    for out in response.outputs:
        tensor = msg.outputs.add(name=out.name, datatype=out.datatype.value, shape=out.shape)
        set_parameters(tensor.parameters, out.parameters)
        # An output written to shared memory keeps its slot (empty) so indices stay aligned.
        in_shm = SHM_REGION in out.parameters
        msg.raw_output_contents.append(b"" if in_shm else to_raw(out.datatype, out.data))
    return msg
