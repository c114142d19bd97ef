"""Pre-serialised request bodies: HTTP JSON, HTTP binary extension, gRPC ``ModelInferRequest``.

Bodies are built once per data entry before measuring, so the timed loop only writes bytes.
With shared memory, a tensor names its region window instead of carrying data.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kiln.bench.inputs import ModelSpec
from kiln.frontends.grpc import grpc_service_pb2 as pb


@dataclass(slots=True, frozen=True)
class ShmSlot:
    """Where one tensor lives in a registered system shared memory region."""

    region: str
    offset: int
    byte_size: int

    def parameters(self) -> dict[str, Any]:
        return {
            "shared_memory_region": self.region,
            "shared_memory_byte_size": self.byte_size,
            "shared_memory_offset": self.offset,
        }


@dataclass(slots=True)
class Placement:
    """Shared-memory slots of one data entry's inputs and of the outputs (empty: inline)."""

    inputs: dict[str, ShmSlot] = field(default_factory=dict)
    outputs: dict[str, ShmSlot] = field(default_factory=dict)


@dataclass(slots=True, frozen=True)
class HttpBody:
    body: bytes
    headers: dict[str, str]


def raw_bytes(datatype: str, arr: np.ndarray) -> bytes:
    """The binary encoding: little-endian elements; BYTES as 4-byte length + bytes each."""
    if datatype == "BYTES":
        return b"".join(struct.pack("<I", len(v)) + v for v in arr.ravel())
    return np.ascontiguousarray(arr).astype(arr.dtype.newbyteorder("<")).tobytes()


def json_data(datatype: str, arr: np.ndarray) -> list[Any]:
    """Flat JSON values: BYTES as text, BF16 bits widened to the float they stand for."""
    if datatype == "BYTES":
        return [v.decode("utf-8", "replace") for v in arr.ravel()]
    if datatype == "BF16":
        return (arr.astype(np.uint32) << 16).view(np.float32).ravel().tolist()
    return arr.ravel().tolist()


def _outputs_json(spec: ModelSpec, placement: Placement, binary: bool) -> list[dict[str, Any]]:
    if placement.outputs:
        return [{"name": n, "parameters": s.parameters()} for n, s in placement.outputs.items()]
    if binary:
        return [{"name": o.name, "parameters": {"binary_data": True}} for o in spec.outputs]
    return []


def http_body(
    spec: ModelSpec,
    entry: dict[str, np.ndarray],
    binary: bool,
    placement: Placement,
    parameters: dict[str, Any] | None = None,
) -> HttpBody:
    """``parameters``: the request's own (a sequence's id and flags)."""
    types = {t.name: t.datatype for t in spec.inputs}
    inputs: list[dict[str, Any]] = []
    blobs: list[bytes] = []
    for name, arr in entry.items():
        tensor: dict[str, Any] = {"name": name, "shape": list(arr.shape), "datatype": types[name]}
        if name in placement.inputs:
            tensor["parameters"] = placement.inputs[name].parameters()
        elif binary:
            blob = raw_bytes(types[name], arr)
            tensor["parameters"] = {"binary_data_size": len(blob)}
            blobs.append(blob)
        else:
            tensor["data"] = json_data(types[name], arr)
        inputs.append(tensor)
    doc: dict[str, Any] = {"inputs": inputs}
    if parameters:
        doc["parameters"] = parameters
    outputs = _outputs_json(spec, placement, binary)
    if outputs:
        doc["outputs"] = outputs
    header = json.dumps(doc, separators=(",", ":")).encode()
    if not blobs:
        return HttpBody(header, {"Content-Type": "application/json"})
    headers = {
        "Content-Type": "application/octet-stream",
        "Inference-Header-Content-Length": str(len(header)),
    }
    return HttpBody(header + b"".join(blobs), headers)


def _param(value: Any) -> pb.InferParameter:
    if isinstance(value, bool):
        return pb.InferParameter(bool_param=value)
    if isinstance(value, int):
        return pb.InferParameter(int64_param=value)
    return pb.InferParameter(string_param=str(value))


def grpc_request(
    spec: ModelSpec,
    entry: dict[str, np.ndarray],
    placement: Placement,
    parameters: dict[str, Any] | None = None,
) -> bytes:
    """A serialised ``ModelInferRequest`` with ``raw_input_contents`` (tritonclient's way);
    ``parameters``: the request's own (a sequence's id and flags)."""
    types = {t.name: t.datatype for t in spec.inputs}
    request = pb.ModelInferRequest(model_name=spec.name, model_version=spec.version)
    for key, value in (parameters or {}).items():
        request.parameters[key].CopyFrom(_param(value))
    for name, arr in entry.items():
        tensor = request.inputs.add(name=name, datatype=types[name], shape=list(arr.shape))
        if name in placement.inputs:
            for key, value in placement.inputs[name].parameters().items():
                tensor.parameters[key].CopyFrom(_param(value))
        else:
            request.raw_input_contents.append(raw_bytes(types[name], arr))
    for name, slot in placement.outputs.items():
        out = request.outputs.add(name=name)
        for key, value in slot.parameters().items():
            out.parameters[key].CopyFrom(_param(value))
    return bytes(request.SerializeToString())
