"""Tensors that live in system shared memory instead of the request/response body.

Shared by the HTTP and gRPC frontends: inputs that name a ``shared_memory_region`` are
read from it before the request reaches core; outputs that name one are written to it
and come back with only their parameters. Regions a request uses are pinned until it ends.
"""

from __future__ import annotations

import asyncio
from typing import Any

from kiln.core.errors import invalid_arg
from kiln.core.types import (
    DataType,
    InferenceRequest,
    InferenceResponse,
    InferInput,
    element_count,
)
from kiln.frontends.tensors import (
    OFF_LOOP_ENCODE_ELEMENTS,
    from_binary,
    python_elements,
    to_binary,
)
from kiln.server.server import Server

REGION = "shared_memory_region"
BYTE_SIZE = "shared_memory_byte_size"
OFFSET = "shared_memory_offset"


def window(kind: str, tensor: str, params: dict[str, Any]) -> tuple[str, int, int] | None:
    """(region, byte_size, offset) named by a tensor's parameters, or None."""
    region = params.get(REGION)
    if region is None:
        return None
    if not isinstance(region, str) or not region:
        raise invalid_arg(f"{kind} '{tensor}': '{REGION}' must be a region name")
    size, offset = params.get(BYTE_SIZE), params.get(OFFSET, 0)
    if size is None:
        raise invalid_arg(f"{kind} '{tensor}': '{REGION}' needs '{BYTE_SIZE}'")
    for key, value in ((BYTE_SIZE, size), (OFFSET, offset)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise invalid_arg(f"{kind} '{tensor}': '{key}' must be an integer >= 0")
    return region, size, offset


def _check_input_window(model: str, tensor: InferInput, region: str, size: int) -> None:
    """A fixed-size tensor's window must be exactly what its shape needs: the window is
    read whole, so a client's byte size must not size that read on its own (a sparse
    object costs its client nothing)."""
    if tensor.datatype is DataType.BYTES:
        return  # its elements' lengths are in the data: checked as it is decoded
    needed = element_count(tensor.shape) * tensor.datatype.itemsize
    if size != needed:
        raise invalid_arg(
            f"input '{tensor.name}' for model '{model}': {BYTE_SIZE} {size} of region "
            f"'{region}' does not match shape [{','.join(map(str, tensor.shape))}] of "
            f"{tensor.datatype.value}, which needs {needed} bytes"
        )


async def infer(server: Server, request: InferenceRequest) -> InferenceResponse:
    """``server.infer`` with shared-memory inputs read and outputs written."""
    used: list[str] = []
    for tensor in request.inputs:
        place = window("input", tensor.name, tensor.parameters)
        if place is None:
            continue
        region, size, offset = place
        _check_input_window(request.model_name, tensor, region, size)
        raw = server.shm.read(region, offset, size, tensor.name)
        tensor.data = from_binary(tensor.name, tensor.datatype, tensor.shape, memoryview(raw))
        used.append(region)
    targets = {}
    for wanted in request.outputs:
        place = window("output", wanted.name, wanted.parameters)
        if place is not None:
            region, size, offset = place
            server.shm.check(region, offset, size, wanted.name)
            targets[wanted.name] = place
            used.append(region)
    if not used:
        return await server.infer(request)
    server.shm.acquire(used)
    try:
        response = await server.infer(request)
        # Encode and size-check every output before writing any: all or nothing.
        pending = []
        for out in response.outputs:
            if out.name in targets:
                region, size, offset = targets[out.name]
                if python_elements(out.datatype, out.data) > OFF_LOOP_ENCODE_ELEMENTS:
                    # BYTES elements cost Python work each: not on the event loop
                    raw = await asyncio.to_thread(to_binary, out.datatype, out.data)
                else:
                    raw = to_binary(out.datatype, out.data)
                if len(raw) > size:
                    raise invalid_arg(
                        f"output '{out.name}': {len(raw)} bytes do not fit the {size}-byte "
                        f"window of shared memory region '{region}'"
                    )
                pending.append((out, region, offset, size, raw))
        for out, region, offset, size, raw in pending:
            server.shm.write(region, offset, raw, size, out.name)
            out.parameters = {REGION: region, BYTE_SIZE: len(raw)}
            if offset:
                out.parameters[OFFSET] = offset
        return response
    finally:
        server.shm.release(used)
