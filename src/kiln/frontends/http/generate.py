"""Triton's generate extension: ``POST /v2/models/{m}/generate`` and ``generate_stream``.

The body is a flat JSON object: each key names a model input (its value a scalar or a
flat list), plus optional ``id`` and ``parameters``. Each response is a flat JSON object
too: ``model_name``, ``model_version``, and one key per output (a scalar when the output
has one element, else a flat list). ``generate_stream`` sends every response of a
decoupled model as a Server-Sent Event, ``data: {json}\\n\\n``; an error after the stream
started arrives as ``data: {"error": "..."}``. Models of ``backend: "llm"`` take text
instead (``llm_generate``).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import orjson
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from kiln.config.signature import ModelSignature
from kiln.core.errors import KilnError, invalid_arg
from kiln.core.limits import tensor_elements
from kiln.core.stream import CLIENT_STREAM_WINDOW
from kiln.core.types import InferenceRequest, InferenceResponse, InferInput, element_count
from kiln.frontends import disconnect
from kiln.frontends.http import llm_generate
from kiln.frontends.http.codec import (
    from_json,
    parse_json,
    to_json_data,
)
from kiln.frontends.json_pieces import OFF_LOOP_PARSE_BYTES, dumps_array
from kiln.frontends.tensors import OFF_LOOP_ENCODE_ELEMENTS

_RESERVED = ("id", "parameters")


def decode_generate(
    body: dict[str, Any],
    signature: ModelSignature,
    model: str,
    version: str,
    max_elements: int = 0,
) -> InferenceRequest:
    """``max_elements``: ``--max-tensor-elements`` (0: none), applied before decoding data."""
    params = body.get("parameters") or {}
    if not isinstance(params, dict):
        raise invalid_arg("generate request: 'parameters' must be an object")
    request = InferenceRequest(model, version, str(body.get("id", "")), parameters=params)
    batching = signature.max_batch_size > 0
    for key, value in body.items():
        if key in _RESERVED:
            continue
        spec = signature.inputs.get(key)
        if spec is None:
            known = ", ".join(sorted(signature.inputs))
            raise invalid_arg(
                f"generate request for model '{model}': '{key}' is not an input of the "
                f"model (inputs: {known})"
            )
        flat = value if isinstance(value, list) else [value]
        fixed = all(d >= 0 for d in spec.dims)
        if fixed and len(spec.dims) != 1 and len(flat) == element_count(spec.dims):
            shape: tuple[int, ...] = spec.dims
        else:
            shape = (len(flat),)  # a flat list fills a one-dimensional input
        if batching:
            shape = (1, *shape)
        tensor_elements(model, key, shape, max_elements)  # before any data is decoded
        data = from_json(key, spec.datatype, shape, flat)
        request.inputs.append(InferInput(key, spec.datatype, shape, data))
    return request


def encode_generate(response: InferenceResponse, pieces: bool = False) -> dict[str, Any]:
    """``pieces``: each output of several elements is encoded here, a slice at a time
    (``json_pieces.dumps_array``: the same bytes), for a worker thread that must let the
    event loop have the GIL between slices."""
    body: dict[str, Any] = {
        "model_name": response.model_name,
        "model_version": response.model_version,
    }
    if response.id:
        body["id"] = response.id
    for out in response.outputs:
        data = to_json_data(out.datatype, out.data)
        if pieces and len(data) != 1:
            listed = isinstance(data, np.ndarray)
            body[out.name] = _Json(dumps_array(data, _OPTS, tolist=listed))
            continue
        values = data.tolist() if hasattr(data, "tolist") else list(data)
        body[out.name] = values[0] if len(values) == 1 else values
    return body


_OPTS = orjson.OPT_SERIALIZE_NUMPY


class _Json(bytes):
    """A value's JSON text, encoded already."""


def _dumps(obj: Any) -> bytes:
    return orjson.dumps(obj, option=_OPTS)


def _encode_in_pieces(response: InferenceResponse) -> bytes:
    """``_dumps(encode_generate(response))``: the same bytes, no call on a whole output."""
    parts = []
    for key, value in encode_generate(response, pieces=True).items():
        text = value if isinstance(value, _Json) else _dumps(value)
        parts.append(b"".join([_dumps(key), b":", text]))
    return b"{" + b",".join(parts) + b"}"


async def encode(response: InferenceResponse) -> bytes:
    """The response's JSON. One with more than ``OFF_LOOP_ENCODE_ELEMENTS`` output
    elements is encoded on a worker thread a slice at a time, as an infer response is:
    ``tolist`` and orjson hold the GIL for a whole call, so 32 M elements held every
    client for 1.1 s on the loop. Smaller ones stay on the loop (a thread hop would cost
    more than the encode)."""
    if sum(out.data.size for out in response.outputs) > OFF_LOOP_ENCODE_ELEMENTS:
        return await asyncio.to_thread(_encode_in_pieces, response)
    return _dumps(encode_generate(response))


def _decode(
    body: bytes, signature: ModelSignature, model: str, version: str, max_elements: int
) -> InferenceRequest:
    return decode_generate(parse_json(body), signature, model, version, max_elements)


async def _request(frontend: Any, request: Request) -> InferenceRequest:
    p = request.path_params
    name, version = p["model"], p.get("version", "")
    body = await frontend.read_body(request)
    signature = frontend.server.model(name, version).signature
    args = (body, signature, name, version, frontend.server.options.max_tensor_elements)
    if len(body) > OFF_LOOP_PARSE_BYTES:
        # as ``infer_body``: a big JSON body decodes on a thread (parsed a piece at a
        # time), other clients go on
        decoded = await asyncio.to_thread(_decode, *args)
    else:
        decoded = _decode(*args)
    forward = frontend.header_forward
    if forward is not None:  # --http-header-forward-pattern
        decoded.parameters.update(forward.select(request.headers.items()))
    return decoded


async def generate(frontend: Any, request: Request) -> Response:
    """One response; a decoupled model must send exactly one."""
    llm = llm_generate.find_llm(frontend.server, request)
    if llm is not None:
        return await llm_generate.generate(frontend, request, llm)
    req = await _request(frontend, request)
    disconnect.watch(request)  # a client that leaves before the answer cancels the request
    try:
        responses = [r async for r in frontend.server.infer_stream(req)]
    except asyncio.CancelledError:
        return disconnect.answered_nobody(request)  # raises unless the client left
    finally:
        disconnect.stop(request)
    if len(responses) != 1:
        raise KilnError(
            f"model '{req.model_name}' sent {len(responses)} responses to a generate request, "
            "which expects exactly one: use generate_stream"
        )
    return Response(await encode(responses[0]), media_type="application/json")


async def generate_stream(frontend: Any, request: Request) -> Response:
    llm = llm_generate.find_llm(frontend.server, request)
    if llm is not None:
        return await llm_generate.generate_stream(frontend, request, llm)
    req = await _request(frontend, request)
    # uvicorn sends an event only once the client's socket took the ones before: a slow
    # reader holds the model back at the window (``core/stream.py``).
    stream = frontend.server.infer_stream(req, CLIENT_STREAM_WINDOW).__aiter__()
    disconnect.watch(request)  # until the first response; a write notices it from then on
    try:
        # The first response is awaited here, so an early error keeps its HTTP status.
        first: InferenceResponse | None = await stream.__anext__()
    except StopAsyncIteration:
        first = None
    except asyncio.CancelledError:
        return disconnect.answered_nobody(request)  # raises unless the client left
    finally:
        disconnect.stop(request)

    async def events() -> AsyncIterator[bytes]:
        if first is None:
            return
        yield b"data: " + await encode(first) + b"\n\n"
        try:
            async for response in stream:
                yield b"data: " + await encode(response) + b"\n\n"
        except KilnError as exc:
            yield b"data: " + _dumps({"error": exc.message}) + b"\n\n"

    return StreamingResponse(events(), media_type="text/event-stream")
