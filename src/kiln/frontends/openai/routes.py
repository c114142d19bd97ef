"""``/v1/*`` routes: OpenAI-shaped JSON, or Server-Sent Events when ``stream`` is true."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import orjson
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import BaseRoute, Route

from kiln.core.errors import KilnError
from kiln.core.server import Server
from kiln.frontends.openai.generation import Delta, run
from kiln.frontends.openai.logprobs import CompletionLogprobs, chat_logprobs
from kiln.frontends.openai.protocol import (
    GenerationRequest,
    OpenAIError,
    chat_messages,
    chat_request,
    completion_request,
)

if TYPE_CHECKING:  # importing the backend imports torch
    from kiln.llm.backend import LLMBackend
    from kiln.llm.sampler import TokenLogprobs

LogprobsFormat = Callable[[list["TokenLogprobs"]], dict[str, Any]]


def _json(body: Any, status: int = 200) -> Response:
    return Response(orjson.dumps(body), status, media_type="application/json")


def llm_models(server: Server) -> dict[str, LLMBackend]:
    """The ready models served by the llm backend, by name."""
    found: dict[str, LLMBackend] = {}
    for entry in server.repository_index(ready_only=True):
        try:
            runtime = server.model(entry["name"])
        except KilnError:
            continue
        scheduler = getattr(runtime, "scheduler", None)
        for instance in getattr(scheduler, "instances", ()):
            if instance.backend.name == "llm":
                found[entry["name"]] = instance.backend
                break
    return found


def _llm(server: Server, name: str) -> LLMBackend:
    llm = llm_models(server).get(name)
    if llm is None:
        raise OpenAIError(
            f"The model '{name}' does not exist or is not a ready llm model",
            404,
            param="model",
            code="model_not_found",
        )
    return llm


async def _body(request: Request) -> dict[str, Any]:
    try:
        body = orjson.loads(await request.body())
    except orjson.JSONDecodeError as exc:
        raise OpenAIError(f"the request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise OpenAIError("the request body must be a JSON object")
    return body


def _prepare(llm: LLMBackend, req: GenerationRequest, default_max: int | None) -> list[int]:
    ids = req.prompt if isinstance(req.prompt, list) else llm.tokenizer.encode(req.prompt)
    limit = llm.engine.config.max_model_len
    room = limit - len(ids)
    max_tokens = req.max_tokens or (min(default_max, room) if default_max else room)
    if max_tokens > room and room > 0:
        raise OpenAIError(
            f"This model's maximum context length is {limit} tokens. However, you requested "
            f"{len(ids) + max_tokens} tokens ({len(ids)} in the prompt, {max_tokens} for the "
            "completion). Please reduce the prompt or max_tokens.",
            param="max_tokens",
            code="context_length_exceeded",
        )
    req.params = replace(req.params, max_tokens=max(max_tokens, 1))
    try:
        llm.engine.check_request(len(ids), req.params)
    except KilnError as exc:
        raise OpenAIError(str(exc), param="prompt", code="context_length_exceeded") from None
    return ids


def _usage(d: Delta) -> dict[str, int]:
    return {
        "prompt_tokens": d.prompt_tokens,
        "completion_tokens": d.completion_tokens,
        "total_tokens": d.prompt_tokens + d.completion_tokens,
    }


def _logprobs_format(
    llm: LLMBackend, req: GenerationRequest, chat: bool, echoed: str
) -> LogprobsFormat | None:
    if req.params.logprobs is None:
        return None
    if chat:
        return lambda entries: chat_logprobs(llm.tokenizer, entries)
    return CompletionLogprobs(llm.tokenizer, len(echoed))


async def _sse(
    deltas: AsyncIterator[Delta],
    req: GenerationRequest,
    chat: bool,
    rid: str,
    logprobs: LogprobsFormat | None,
) -> AsyncIterator[bytes]:
    created = int(time.time())
    kind = "chat.completion.chunk" if chat else "text_completion"
    head = {"id": rid, "object": kind, "created": created, "model": req.model}

    def chunk(d: Delta | None) -> bytes:
        text = d.text if d else None
        if chat:
            delta: dict[str, Any] = {"role": "assistant", "content": ""} if d is None else {}
            if text:
                delta["content"] = text
            choice: dict[str, Any] = {"index": 0, "delta": delta}
        else:
            choice = {"index": 0, "text": text or ""}
        lp = logprobs(d.logprobs) if logprobs is not None and d is not None else None
        choice.update(logprobs=lp, finish_reason=d.finish_reason if d else None)
        return b"data: " + orjson.dumps({**head, "choices": [choice]}) + b"\n\n"

    if chat:
        yield chunk(None)
    last: Delta | None = None
    try:
        async for d in deltas:
            last = d
            if d.text or d.finish_reason:
                yield chunk(d)
    except KilnError as exc:
        yield b"data: " + orjson.dumps(OpenAIError.from_kiln(exc).body()) + b"\n\n"
    if req.include_usage and last is not None:
        final = {**head, "choices": [], "usage": _usage(last)}
        yield b"data: " + orjson.dumps(final) + b"\n\n"
    yield b"data: [DONE]\n\n"


async def _respond(llm: LLMBackend, req: GenerationRequest, ids: list[int], chat: bool) -> Response:
    rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    deltas = run(llm, ids, req.params, req.stop)
    # a stream does not repeat the prompt, so its text offsets start at 0
    echo = not chat and not req.stream and req.echo and isinstance(req.prompt, str)
    echoed = req.prompt if echo and isinstance(req.prompt, str) else ""
    logprobs = _logprobs_format(llm, req, chat, echoed)
    if req.stream:
        events = _sse(deltas, req, chat, rid, logprobs)
        return StreamingResponse(events, media_type="text/event-stream")
    text, entries, last = [], [], None
    try:
        async for d in deltas:
            text.append(d.text)
            entries.extend(d.logprobs)
            last = d
    except KilnError as exc:
        raise OpenAIError.from_kiln(exc) from None
    assert last is not None
    content = "".join(text)
    if chat:
        choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": content}}
    else:
        choice = {"index": 0, "text": echoed + content}
    lp = logprobs(entries) if logprobs is not None else None
    choice.update(logprobs=lp, finish_reason=last.finish_reason)
    return _json(
        {
            "id": rid,
            "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()),
            "model": req.model,
            "choices": [choice],
            "usage": _usage(last),
        }
    )


def openai_routes(server: Server) -> list[BaseRoute]:
    async def models(request: Request) -> Response:
        data = [
            {
                "id": name,
                "object": "model",
                "created": 0,
                "owned_by": "kiln",
                "max_model_len": llm.engine.config.max_model_len,
            }
            for name, llm in sorted(llm_models(server).items())
        ]
        return _json({"object": "list", "data": data})

    async def completions(request: Request) -> Response:
        try:
            req = completion_request(await _body(request))
            llm = _llm(server, req.model)
            ids = _prepare(llm, req, 16)  # OpenAI's default max_tokens for completions
            return await _respond(llm, req, ids, chat=False)
        except OpenAIError as exc:
            return _json(exc.body(), exc.status)
        except KilnError as exc:
            err = OpenAIError.from_kiln(exc)
            return _json(err.body(), err.status)

    async def chat(request: Request) -> Response:
        try:
            body = await _body(request)
            messages = chat_messages(body)
            model = body.get("model")
            llm = _llm(server, model) if isinstance(model, str) else None
            prompt = llm.tokenizer.apply_chat_template(messages) if llm else ""
            req = chat_request(body, prompt)
            llm = _llm(server, req.model)
            ids = _prepare(llm, req, None)
            return await _respond(llm, req, ids, chat=True)
        except OpenAIError as exc:
            return _json(exc.body(), exc.status)
        except KilnError as exc:
            err = OpenAIError.from_kiln(exc)
            return _json(err.body(), err.status)

    return [
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat, methods=["POST"]),
    ]
