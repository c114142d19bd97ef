"""Triton's generate extension on ``backend: "llm"`` models, shaped as Triton's vLLM and
TensorRT-LLM backends answer it.

Request: ``{"text_input": "...", "parameters": {"max_tokens": 16, "temperature": 0}}``.
Sampling fields may also sit at the top level, as the generate extension maps top-level
keys to inputs (TensorRT-LLM's ensemble takes ``max_tokens``, ``temperature``... as
inputs); vLLM's ``sampling_parameters`` JSON string is read too. Response: ``model_name``,
``model_version``, ``text_output``, plus ``finish_reason`` / ``num_input_tokens`` /
``num_output_tokens`` when ``return_finish_reason`` / ``return_num_input_tokens`` /
``return_num_output_tokens`` ask for them. ``generate`` returns the prompt followed by the
completion unless ``exclude_input_in_output`` is true (vLLM backend's default);
``generate_stream`` sends one event per chunk of new text, never the prompt.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import orjson
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from kiln.backends.registry import LLM_BACKENDS
from kiln.core.errors import KilnError, invalid_arg
from kiln.core.trace import http_slot
from kiln.frontends import disconnect
from kiln.frontends.http.codec import parse_body
from kiln.frontends.openai.generation import Delta, run
from kiln.frontends.openai.protocol import MAX_CHARS_PER_TOKEN
from kiln.llm.engine_client import EngineClient
from kiln.llm.params import (
    SAMPLING_FIELDS,
    InvalidField,
    integer,
    sampling_fields,
    with_defaults,
)
from kiln.llm.sequence import SamplingParams

if TYPE_CHECKING:
    from kiln.server.server import Server

_FLAGS = (
    "stream",
    "exclude_input_in_output",
    "return_finish_reason",
    "return_num_input_tokens",
    "return_num_output_tokens",
)
_KNOWN = frozenset((*SAMPLING_FIELDS, *_FLAGS, "max_tokens", "stop", "lora_name"))
DEFAULT_MAX_TOKENS = 16  # vLLM's SamplingParams default, which Triton's vLLM backend keeps
#: stop strings are searched in every chunk of new text: a bound on that work
MAX_STOP_STRINGS = 64


@dataclass(slots=True)
class LLMGenerateRequest:
    model_name: str
    model_version: str
    id: str
    prompt: str
    prompt_ids: list[int]
    params: SamplingParams
    stop: tuple[str, ...]
    flags: dict[str, bool]
    #: ``"stream": false`` given (generate_stream then sends one event)
    explicit_no_stream: bool = False
    #: the engine it runs on: its version's (a rollout's draw), bound to its ``lora_name``
    #: adapter (Triton's vLLM backend's) when it names one
    engine: EngineClient | None = None


def find_llm(server: Server, request: Request) -> EngineClient | None:
    """The engine of the request's model through core, or None for a model of another
    backend (an unknown or not ready model raises infer's error)."""
    p = request.path_params
    runtime = server.model(p["model"], p.get("version", ""))
    if runtime.config.backend not in LLM_BACKENDS:
        return None
    return server.llm_engine(p["model"], p.get("version", ""))


def _fields(body: dict[str, Any], model: str) -> dict[str, Any]:
    params = body.get("parameters") or {}
    if not isinstance(params, dict):
        raise invalid_arg("generate request: 'parameters' must be an object")
    fields = dict(params)
    raw = body.get("sampling_parameters")
    if raw is not None:
        try:
            extra = orjson.loads(raw) if isinstance(raw, str) else None
        except orjson.JSONDecodeError:
            extra = None
        if not isinstance(extra, dict):
            raise invalid_arg(
                "generate request: 'sampling_parameters' must be a JSON object string"
            )
        fields.update(extra)
    fields.update({k: v for k, v in body.items() if k not in ("text_input", "id", "parameters")})
    fields.pop("sampling_parameters", None)
    unknown = sorted(set(fields) - _KNOWN)
    if unknown:
        raise invalid_arg(
            f"generate request for model '{model}': unknown field '{unknown[0]}' "
            f"(known: text_input, {', '.join(sorted(_KNOWN))})"
        )
    return fields


def decode(body: dict[str, Any], llm: EngineClient, model: str, version: str) -> LLMGenerateRequest:
    text = body.get("text_input")
    if isinstance(text, list) and len(text) == 1:
        text = text[0]  # the generate extension's flat one-element list
    if not isinstance(text, str) or not text:
        raise invalid_arg(f"generate request for model '{model}': 'text_input' must be a string")
    fields = _fields(body, model)
    name = fields.pop("lora_name", None)
    if name is not None:
        if llm.loras is None:
            raise invalid_arg(
                f"generate request for model '{model}': lora_name {name!r} is not an adapter "
                "of this model (LoRA is not enabled)"
            )
        try:
            found = llm.loras.named(name)
        except KilnError as exc:
            raise invalid_arg(f"generate request for model '{model}': {exc.message}") from None
        llm = llm.with_lora(found)
    flags: dict[str, bool] = {}
    for key in _FLAGS:
        value = fields.get(key, False)
        if not isinstance(value, bool):
            raise invalid_arg(f"generate request: '{key}' must be a boolean, got {value!r}")
        flags[key] = value
    stop = fields.get("stop") or []
    stops = tuple([stop] if isinstance(stop, str) else stop if isinstance(stop, list) else [None])
    if not all(isinstance(s, str) and s for s in stops):
        raise invalid_arg("generate request: 'stop' must be a string or a list of strings")
    if len(stops) > MAX_STOP_STRINGS:
        raise invalid_arg(
            f"generate request: 'stop' holds {len(stops)} strings, more than {MAX_STOP_STRINGS}"
        )
    try:
        sampling = sampling_fields(with_defaults(fields, llm.sampling_defaults))
        max_tokens = integer(fields, "max_tokens")
    except InvalidField as exc:
        raise invalid_arg(f"generate request for model '{model}': {exc.message}") from None
    limit = llm.max_model_len
    if len(text) > limit * MAX_CHARS_PER_TOKEN:  # cannot fit: refused before tokenizing
        raise invalid_arg(
            f"generate request for model '{model}': 'text_input' has {len(text)} characters, "
            f"more than {limit * MAX_CHARS_PER_TOKEN} ({MAX_CHARS_PER_TOKEN} per token): it "
            f"cannot fit the model's context of {limit} tokens"
        )
    ids = llm.tokenizer.encode(text, add_special_tokens=True)  # as vLLM's generate
    room = limit - len(ids)
    if max_tokens is not None and (max_tokens <= 0 or max_tokens > max(room, 1)):
        raise invalid_arg(
            f"generate request for model '{model}': max_tokens must be in [1, {max(room, 1)}] "
            f"(the context holds {limit} tokens, the prompt has {len(ids)}), got {max_tokens}"
        )
    max_tokens = max_tokens or min(DEFAULT_MAX_TOKENS, max(room, 1))
    if llm.max_new_tokens:  # generation_config.json's bound, as vLLM applies it
        max_tokens = min(max_tokens, llm.max_new_tokens)
    params = SamplingParams(max_tokens=max_tokens, **sampling)
    try:
        llm.check_request(len(ids), params)
    except InvalidField as exc:
        raise invalid_arg(f"generate request for model '{model}': {exc.message}") from None
    rid = str(body.get("id", ""))
    no_stream = fields.get("stream") is False
    bound = llm if llm.lora_request is not None else None
    return LLMGenerateRequest(
        model, version, rid, text, ids, params, stops, flags, no_stream, bound
    )


def _payload(req: LLMGenerateRequest, text: str, d: Delta, tokens: int) -> dict[str, Any]:
    body: dict[str, Any] = {"model_name": req.model_name, "model_version": req.model_version}
    if req.id:
        body["id"] = req.id
    body["text_output"] = text
    if req.flags["return_finish_reason"] and d.finish_reason is not None:
        body["finish_reason"] = d.finish_reason
    if req.flags["return_num_input_tokens"]:
        body["num_input_tokens"] = d.prompt_tokens
    if req.flags["return_num_output_tokens"]:
        body["num_output_tokens"] = tokens
    return body


def _event(body: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(body) + b"\n\n"


def _sticky(
    frontend: Any, request: Request, body: dict[str, Any], llm: EngineClient
) -> tuple[dict[str, Any], EngineClient]:
    """A rollout sticky on a request parameter (``rollout_sticky_key``): the version is
    drawn again with the request's ``parameters`` and its forwarded headers, before that
    version's tokenizer reads the prompt. The sticky key is routing, not sampling: it is
    taken out of ``parameters`` (the headers never enter them)."""
    model = request.path_params["model"]
    rollout = frontend.server.rollouts.models.get(model)
    sticky = rollout.policy.sticky_parameter if rollout is not None else ""
    if not sticky:
        return body, llm
    params = body.get("parameters")
    keys = dict(params) if isinstance(params, dict) else {}
    if sticky in keys and sticky not in _KNOWN:
        body = {**body, "parameters": {k: v for k, v in keys.items() if k != sticky}}
    forward = frontend.header_forward
    if forward is not None:
        keys.update(forward.select(request.headers.items()))
    if sticky not in keys:
        return body, llm  # no key: the draw find_llm made stands
    return body, frontend.server.llm_engine(model, "", keys)


async def _decoded(frontend: Any, request: Request, llm: EngineClient) -> LLMGenerateRequest:
    p = request.path_params
    slot = http_slot(frontend.server.tracer, request.headers)  # while the server traces
    body = await parse_body(await frontend.read_body(request))
    if slot is not None:
        slot.recv_end = time.monotonic_ns()
    if not p.get("version") and isinstance(body, dict):
        body, llm = _sticky(frontend, request, body, llm)
    # tokenizing takes time in proportion to the prompt: off the event loop
    req = await asyncio.to_thread(decode, body, llm, p["model"], llm.model_version)
    if req.engine is None:
        req.engine = llm  # the version drawn here, which the callers run it on
    return req


async def _whole(llm: EngineClient, req: LLMGenerateRequest) -> dict[str, Any]:
    texts: list[str] = []
    last: Delta | None = None
    async with aclosing(run(llm, req.prompt_ids, req.params, req.stop, 0, req.id)) as deltas:
        async for d in deltas:
            texts.append(d.text)
            last = d
    assert last is not None  # the engine always ends a request with a finished output
    prefix = "" if req.flags["exclude_input_in_output"] else req.prompt
    return _payload(req, prefix + "".join(texts), last, last.completion_tokens)


async def generate(frontend: Any, request: Request, llm: EngineClient) -> Response:
    req = await _decoded(frontend, request, llm)
    llm = req.engine or llm
    if req.flags["stream"]:
        raise invalid_arg(
            f"model '{req.model_name}': 'stream': true sends several responses, "
            "which generate cannot: use generate_stream"
        )
    disconnect.watch(request)  # a client that leaves before the answer aborts the request
    try:
        whole = await _whole(llm, req)
    except asyncio.CancelledError:
        return disconnect.answered_nobody(request)  # raises unless the client left
    finally:
        disconnect.stop(request)
    return Response(orjson.dumps(whole), media_type="application/json")


async def generate_stream(frontend: Any, request: Request, llm: EngineClient) -> Response:
    """One event per chunk of new text; with ``"stream": false``, one event with the whole
    output, as Triton's vLLM backend answers a non-streaming request."""
    req = await _decoded(frontend, request, llm)
    llm = req.engine or llm
    if not req.flags["stream"] and req.explicit_no_stream:
        body = await _whole(llm, req)

        async def one() -> AsyncIterator[bytes]:
            yield _event(body)

        return StreamingResponse(one(), media_type="text/event-stream")
    deltas = run(llm, req.prompt_ids, req.params, req.stop, 0, req.id)
    # the first delta is awaited here, so an error the engine raises keeps its HTTP status
    try:
        first = await deltas.__anext__()
    except BaseException:
        await deltas.aclose()
        raise

    async def events() -> AsyncIterator[bytes]:
        sent = 0
        async with aclosing(deltas):
            pending: Delta | None = first
            while pending is not None:
                d = pending
                if d.text or d.finish_reason:
                    yield _event(_payload(req, d.text, d, d.completion_tokens - sent))
                    sent = d.completion_tokens
                try:
                    pending = await deltas.__anext__()
                except StopAsyncIteration:
                    pending = None
                except KilnError as exc:
                    yield _event({"error": exc.message})
                    pending = None

    return StreamingResponse(events(), media_type="text/event-stream")
