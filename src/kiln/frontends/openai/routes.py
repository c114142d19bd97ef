"""``/v1/*`` routes: OpenAI-shaped JSON, or Server-Sent Events when ``stream`` is true."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import orjson
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import BaseRoute, Route

from kiln.core.errors import KilnError
from kiln.core.server import Server
from kiln.core.trace import FrontendSlot, http_slot
from kiln.frontends.http.app import HttpFrontend
from kiln.frontends.openai.generation import Delta, run
from kiln.frontends.openai.logprobs import (
    CompletionLogprobs,
    chat_logprobs,
    vllm_prompt_logprobs,
)
from kiln.frontends.openai.protocol import (
    GenerationRequest,
    OpenAIError,
    chat_messages,
    chat_request,
    check_prompt_chars,
    completion_request,
)
from kiln.llm.params import InvalidField, with_defaults

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


async def _body(request: Request, reader: HttpFrontend) -> dict[str, Any]:
    # the HTTP frontend's reader: --http-max-input-size (413) and --http-read-timeout-secs
    # (408) hold here as on the KServe routes
    raw = await reader.read_body(request)
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise OpenAIError(f"the request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise OpenAIError("the request body must be a JSON object")
    return body


async def _received(
    request: Request, slot: FrontendSlot | None, reader: HttpFrontend
) -> dict[str, Any]:
    """The request's JSON body; a traced request's receive ends here."""
    body = await _body(request, reader)
    if slot is not None:
        slot.recv_end = time.monotonic_ns()
    return body


def _precheck_prompt(server: Server, body: dict[str, Any]) -> None:
    """Refuse a completion prompt that cannot fit the model's context from its size alone,
    before the work in proportion to it (checking each token id, tokenizing)."""
    model, prompt = body.get("model"), body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one, as completion_request reads it
    if not isinstance(model, str) or not isinstance(prompt, str | list):
        return  # completion_request names the field
    llm = llm_models(server).get(model)
    if llm is None:
        return
    limit = llm.engine.config.max_model_len
    if isinstance(prompt, str):
        check_prompt_chars(len(prompt), limit, "prompt")
    elif len(prompt) >= limit and isinstance(prompt[0], int):
        raise OpenAIError(
            f"This model's maximum context length is {limit} tokens. However, the prompt "
            f"has {len(prompt)} tokens, leaving no room to generate. Please reduce the prompt.",
            param="prompt",
            code="context_length_exceeded",
        )


def _chat_prompt(llm: LLMBackend, messages: list[dict[str, Any]]) -> str:
    check_prompt_chars(
        sum(len(m["content"]) for m in messages), llm.engine.config.max_model_len, "messages"
    )
    return llm.tokenizer.apply_chat_template(messages)


def _with_model_defaults(server: Server, body: dict[str, Any]) -> dict[str, Any]:
    """The body with the model's generation_config.json defaults filled in."""
    model = body.get("model")
    llm = llm_models(server).get(model) if isinstance(model, str) else None
    return with_defaults(body, llm.sampling_defaults) if llm is not None else body


def _prepare(llm: LLMBackend, req: GenerationRequest, default_max: int | None) -> list[int]:
    """The prompt's token ids, the request's checks done. On a worker thread: tokenizing
    takes time in proportion to the prompt, which must not stall the event loop."""
    vocab = llm.engine.args.vocab_size
    if isinstance(req.prompt, list):
        ids = req.prompt
        if any(not 0 <= t < vocab for t in ids):
            raise OpenAIError(f"prompt token ids must be in [0, {vocab})", param="prompt")
    else:
        # completions get the tokenizer's BOS; a chat template writes its own (vLLM's rule)
        ids = llm.tokenizer.encode(req.prompt, add_special_tokens=default_max is not None)
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
    if llm.max_new_tokens:  # generation_config.json's bound, as vLLM applies it
        max_tokens = min(max_tokens, llm.max_new_tokens)
    req.params = replace(req.params, max_tokens=max(max_tokens, 1))
    for param, check in (
        ("n", lambda: llm.engine.check_n(req.params.n)),
        ("priority", lambda: llm.engine.check_priority(req.priority)),
    ):
        try:
            check()
        except KilnError as exc:
            raise OpenAIError(str(exc), param=param) from None
    try:
        llm.engine.check_request(len(ids), req.params, req.priority)
    except InvalidField as exc:
        raise OpenAIError(str(exc), param=exc.field) from None
    except KilnError as exc:
        raise OpenAIError(str(exc), param="prompt", code="context_length_exceeded") from None
    return ids


def _usage(prompt_tokens: int, completion: dict[int, int]) -> dict[str, int]:
    """``completion``: tokens per choice index (their sum is the request's)."""
    total = sum(completion.values())
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": total,
        "total_tokens": prompt_tokens + total,
    }


def _prompt_field(
    llm: LLMBackend, req: GenerationRequest, entries: list[TokenLogprobs | None] | None
) -> list[dict[str, dict[str, Any]] | None] | None:
    """vLLM's ``prompt_logprobs`` of an answer (None when the engine sent none)."""
    if entries is None:
        return None
    return vllm_prompt_logprobs(llm.tokenizer, entries, req.params.prompt_logprobs or 0)


def _logprobs_format(
    llm: LLMBackend, req: GenerationRequest, chat: bool, echoed: str
) -> LogprobsFormat | None:
    if req.params.logprobs is None:
        return None
    if chat:
        return lambda entries: chat_logprobs(llm.tokenizer, entries)
    return CompletionLogprobs(llm.tokenizer, len(echoed))


@dataclass(slots=True)
class _Echo:
    """A streamed completion's ``echo``: each choice's first chunk starts with the prompt
    (and, with logprobs, the prompt tokens' logprobs from text offset 0), as vLLM streams it."""

    text: str
    first_token: int
    pending: set[int]  # the choices whose prompt has not gone out yet


async def _sse(
    deltas: AsyncIterator[Delta],
    req: GenerationRequest,
    chat: bool,
    rid: str,
    formats: list[LogprobsFormat | None],
    echo: _Echo | None = None,
) -> AsyncIterator[bytes]:
    """``formats``: each choice's logprobs formatter (None: no logprobs asked)."""
    created = int(time.time())
    kind = "chat.completion.chunk" if chat else "text_completion"
    head = {"id": rid, "object": kind, "created": created, "model": req.model}

    def chunk(index: int, d: Delta | None) -> bytes:
        text = d.text if d else None
        fmt = formats[index]
        lp = None
        if chat:
            delta: dict[str, Any] = {"role": "assistant", "content": ""} if d is None else {}
            if text:
                delta["content"] = text
            choice: dict[str, Any] = {"index": index, "delta": delta}
        elif echo is not None and d is not None and index in echo.pending:
            echo.pending.discard(index)
            choice = {"index": index, "text": echo.text + (text or "")}
            if isinstance(fmt, CompletionLogprobs) and d.prompt_logprobs:
                # the prompt's tokens first, from offset 0 (the first has no logprob)
                known = [e for e in d.prompt_logprobs[1:] if e is not None]
                lp = fmt(known + d.logprobs, echo.first_token)
        else:
            choice = {"index": index, "text": text or ""}
        if lp is None and fmt is not None and d is not None:
            lp = fmt(d.logprobs)
        choice.update(logprobs=lp, finish_reason=d.finish_reason if d else None)
        return b"data: " + orjson.dumps({**head, "choices": [choice]}) + b"\n\n"

    if chat:
        for index in range(req.params.n):
            yield chunk(index, None)
    completion: dict[int, int] = {}
    prompt_tokens = 0
    try:
        async for d in deltas:
            completion[d.index] = d.completion_tokens
            prompt_tokens = d.prompt_tokens
            if d.text or d.finish_reason or (echo is not None and d.index in echo.pending):
                yield chunk(d.index, d)
    except KilnError as exc:
        yield b"data: " + orjson.dumps(OpenAIError.from_kiln(exc).body()) + b"\n\n"
    if req.include_usage and completion:
        final = {**head, "choices": [], "usage": _usage(prompt_tokens, completion)}
        yield b"data: " + orjson.dumps(final) + b"\n\n"
    yield b"data: [DONE]\n\n"


async def _respond(llm: LLMBackend, req: GenerationRequest, ids: list[int], chat: bool) -> Response:
    rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    deltas = run(llm, ids, req.params, req.stop, req.priority, rid)
    n = req.params.n
    echo = not chat and req.echo
    # a prompt of token ids is echoed as its text, as vLLM does
    echoed = (
        "" if not echo else req.prompt if isinstance(req.prompt, str) else llm.tokenizer.decode(ids)
    )
    if req.stream:
        # the prompt's logprobs go through the same formatter, so offsets start at 0
        formats = [_logprobs_format(llm, req, chat, "") for _ in range(n)]
        streamed = _Echo(echoed, ids[0], set(range(n))) if echo else None
        events = _sse(deltas, req, chat, rid, formats, streamed)
        return StreamingResponse(events, media_type="text/event-stream")
    formats = [_logprobs_format(llm, req, chat, echoed) for _ in range(n)]
    texts: list[list[str]] = [[] for _ in range(n)]
    entries: list[list[TokenLogprobs]] = [[] for _ in range(n)]
    prompt_entries: list[list[TokenLogprobs | None] | None] = [None] * n
    reasons: list[str | None] = [None] * n
    completion: dict[int, int] = {}
    try:
        async for d in deltas:
            texts[d.index].append(d.text)
            entries[d.index].extend(d.logprobs)
            if d.prompt_logprobs is not None:
                prompt_entries[d.index] = d.prompt_logprobs
            reasons[d.index] = d.finish_reason or reasons[d.index]
            completion[d.index] = d.completion_tokens
    except KilnError as exc:
        raise OpenAIError.from_kiln(exc) from None
    choices: list[dict[str, Any]] = []
    for index in range(n):
        content = "".join(texts[index])
        if chat:
            choice: dict[str, Any] = {
                "index": index,
                "message": {"role": "assistant", "content": content},
            }
        else:
            choice = {"index": index, "text": echoed + content}
        fmt = formats[index]
        prompt = prompt_entries[index]
        lp: dict[str, Any] | None = None
        if fmt is not None and prompt and echo and isinstance(fmt, CompletionLogprobs):
            # echo: the prompt's tokens first, from text offset 0 (the first has no logprob)
            known = [e for e in prompt[1:] if e is not None]
            lp = CompletionLogprobs(llm.tokenizer, 0)(known + entries[index], ids[0])
        elif fmt is not None:
            lp = fmt(entries[index])
        choice.update(logprobs=lp, finish_reason=reasons[index])
        if req.prompt_logprobs_field and not chat:  # vLLM's field, per choice
            choice["prompt_logprobs"] = _prompt_field(llm, req, prompt)
        choices.append(choice)
    body: dict[str, Any] = {}
    if req.prompt_logprobs_field and chat:  # vLLM's field, once for the chat's prompt
        body["prompt_logprobs"] = _prompt_field(llm, req, prompt_entries[0])
    return _json(
        {
            "id": rid,
            "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()),
            "model": req.model,
            "choices": choices,
            **body,
            "usage": _usage(len(ids), completion),
        }
    )


def openai_routes(server: Server, reader: HttpFrontend | None = None) -> list[BaseRoute]:
    """``reader``: the HTTP frontend whose body limits apply (default: the server's size
    limit, no read timeout)."""
    reader = reader or HttpFrontend(server)

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
        slot = http_slot(server.tracer, request.headers)
        try:
            body = await _received(request, slot, reader)
            _precheck_prompt(server, body)
            req = completion_request(_with_model_defaults(server, body))
            llm = _llm(server, req.model)
            # OpenAI's default max_tokens for completions: 16
            ids = await asyncio.to_thread(_prepare, llm, req, 16)
            return await _respond(llm, req, ids, chat=False)
        except ClientDisconnect:
            return Response(status_code=400)  # nobody reads it
        except OpenAIError as exc:
            return _json(exc.body(), exc.status)
        except KilnError as exc:
            err = OpenAIError.from_kiln(exc)
            return _json(err.body(), err.status)

    async def chat(request: Request) -> Response:
        slot = http_slot(server.tracer, request.headers)
        try:
            body = await _received(request, slot, reader)
            messages = chat_messages(body)
            model = body.get("model")
            llm = _llm(server, model) if isinstance(model, str) else None
            # the template renders in proportion to the messages: off the event loop too
            prompt = await asyncio.to_thread(_chat_prompt, llm, messages) if llm else ""
            req = chat_request(_with_model_defaults(server, body), prompt)
            llm = _llm(server, req.model)
            ids = await asyncio.to_thread(_prepare, llm, req, None)
            return await _respond(llm, req, ids, chat=True)
        except ClientDisconnect:
            return Response(status_code=400)
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
