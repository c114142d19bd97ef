"""vLLM's tokens-in, tokens-out routes (its scale-out API): ``POST /inference/v1/generate``
(a ``GenerateRequest``: prompt token ids and vLLM's ``SamplingParams``; token ids out, whole
or streamed) and ``POST /inference/v1/abort_requests`` (and vLLM's legacy
``/abort_requests``).

A request runs as a completions request of token ids: its sampling parameters become
that body's fields and go through the same checks (``completion_request``, ``prepare``),
and it runs through the same engine client (admission, priorities, metrics, a client
that leaves aborts it)."""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import aclosing
from dataclasses import replace
from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from kiln.core.errors import KilnError
from kiln.core.trace import http_slot
from kiln.frontends.openai.endpoint import BodyReader, json_response, model_for, read_json, received
from kiln.frontends.openai.generation import Delta, OutputOptions, run, started
from kiln.frontends.openai.generation_request import GenerationRequest, completion_request
from kiln.frontends.openai.keep_alive import with_keep_alive
from kiln.frontends.openai.logprobs import chat_logprobs, vllm_prompt_logprobs
from kiln.frontends.openai.preparation import prepare, thinking_markers
from kiln.frontends.openai.protocol import OpenAIError
from kiln.frontends.openai.request_ids import MAX_LENGTH as MAX_REQUEST_ID
from kiln.frontends.openai.request_ids import request_id
from kiln.frontends.openai.tokens_only import check_generate
from kiln.llm.engine_client import EngineClient
from kiln.llm.sampler import TokenLogprobs
from kiln.server.server import Server

#: vLLM ``SamplingParams`` fields that are kiln's completions fields of the same name
SAMPLING_PARAMS = frozenset(
    (
        "n", "temperature", "top_p", "top_k", "min_p", "repetition_penalty",
        "presence_penalty", "frequency_penalty", "seed", "stop", "stop_token_ids",
        "ignore_eos", "max_tokens", "min_tokens", "logprobs", "prompt_logprobs",
        "logprob_token_ids", "logit_bias", "allowed_token_ids", "bad_words",
        "structured_outputs", "include_stop_str_in_output", "skip_special_tokens",
        "spaces_between_special_tokens", "stream_interval", "thinking_token_budget",
    )
)  # fmt: skip
#: vLLM's internal fields, which it sets itself whatever a client sends (any value)
_INTERNAL = frozenset(("output_kind", "skip_clone", "output_text_buffer_length", "detokenize"))
#: the fields kiln does not implement, with the values that ask for nothing
_UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "extra_args": (None, {}),
    "skip_reading_prefix_cache": (None, False),
    "flat_logprobs": (None, False),
    "watermarking": (None,),
    "repetition_detection": (None,),
    "prompt_logprob_token_ids": (None,),
    "prompt_logprob_start": (None,),
    "routed_experts_prompt_start": (None,),
    "trace_decode_token_ids": (None, False),
}
#: a GenerateRequest's fields kiln reads, and those that must ask for nothing
_FIELDS = frozenset(
    (
        "request_id", "token_ids", "token_offsets", "sampling_params", "model",
        "reasoning_ended", "reasoning_parser_kwargs", "return_token_ids", "output_mode",
        "stream", "stream_options", "cache_salt", "priority",
    )
)  # fmt: skip
_REFUSED = ("features", "content_parts", "kv_transfer_params", "ec_transfer_params")
#: ids in one abort_requests body, and the longest id: the longest a request in flight
#: has (an engine's id: ``generate-tokens-<X-Request-Id>-<8 hex>``)
MAX_ABORT_IDS = 1024
MAX_ABORT_ID = len("generate-tokens-") + MAX_REQUEST_ID + len("-01234567")


def _remap(exc: OpenAIError, sampled: set[str]) -> OpenAIError:
    """An error of the completions checks, naming the GenerateRequest's field."""
    param = exc.param
    if param is not None:
        root = param.split(".", 1)[0]
        if root in sampled:
            exc.param = f"sampling_params.{param}"
        elif root == "prompt":
            exc.param = "token_ids"
    return exc


def completions_body(body: dict[str, Any], model: str, vocab: int, limit: int) -> dict[str, Any]:
    """A GenerateRequest as the completions body it runs as. ``token_ids`` are counted
    against the context (``limit``) before each id is checked against ``vocab``."""
    for key in body:
        if key in _REFUSED and body[key] is not None:
            raise OpenAIError(f"'{key}' is not supported by kiln: send null", param=key)
        if key not in _FIELDS and key not in _REFUSED:
            raise OpenAIError(f"unknown GenerateRequest field {key[:100]!r}", param=key[:100])
    ids = body.get("token_ids")
    if not isinstance(ids, list) or not ids:
        raise OpenAIError("'token_ids' must be a non-empty list of token ids", param="token_ids")
    if len(ids) >= limit:
        raise OpenAIError(
            f"'token_ids' holds {len(ids)} tokens: the model's context is {limit} tokens, "
            "leaving no room to generate",
            param="token_ids",
            code="context_length_exceeded",
        )
    if not all(type(t) is int and 0 <= t < vocab for t in ids):
        raise OpenAIError(f"'token_ids' must be token ids in [0, {vocab})", param="token_ids")
    mode = body.get("output_mode", "tokens")
    if mode not in ("tokens", "text"):
        raise OpenAIError(
            f"output_mode must be 'tokens' or 'text', got {mode!r}", param="output_mode"
        )
    for key in ("reasoning_ended", "return_token_ids"):
        if body.get(key) is not None and not isinstance(body[key], bool):
            raise OpenAIError(f"'{key}' must be a boolean", param=key)
    params = body.get("sampling_params")
    if not isinstance(params, dict):
        raise OpenAIError("'sampling_params' must be an object", param="sampling_params")
    if mode == "text" and params.get("detokenize") is False:
        raise OpenAIError(
            "output_mode='text' requires sampling_params.detokenize to be true",
            param="output_mode",
        )
    out: dict[str, Any] = {"model": model, "prompt": ids}
    for key, value in params.items():
        if key in SAMPLING_PARAMS:
            out[key] = value
        elif key in _UNSUPPORTED:
            if not any(value == ok and type(value) is type(ok) for ok in _UNSUPPORTED[key]):
                raise OpenAIError(
                    f"sampling_params.{key} is not supported by kiln: send null",
                    param=f"sampling_params.{key}",
                )
        elif key not in _INTERNAL:
            name = f"sampling_params.{key[:100]}"
            raise OpenAIError(f"unknown field {name!r}", param=name)
    for key in ("stream", "stream_options", "cache_salt", "priority", "request_id"):
        if body.get(key) is not None:
            out[key] = body[key]
    return out


def _clamp(logprob: float) -> float:
    return -9999.0 if math.isnan(logprob) else max(logprob, -9999.0)


def token_logprobs(entries: list[TokenLogprobs], asked: int) -> dict[str, Any]:
    """vLLM's ``GenerateLogProbs``: per token its id, logprob and rank, and the sampled
    token then the top alternatives (``max(asked, 1)`` of them in all), by id."""
    content = []
    for e in entries:
        ranks = {t: r for r, (t, _) in enumerate(e.top, start=1)}
        rank = e.rank or ranks.get(e.token_id)
        ranked = [(e.token_id, e.logprob, rank)]
        ranked += [(t, lp, ranks[t]) for t, lp in e.top if t != e.token_id]
        top = [{"token_id": t, "logprob": _clamp(lp), "rank": r} for t, lp, r in ranked]
        content.append(
            {"token_id": e.token_id, "logprob": _clamp(e.logprob), "rank": rank,
             "top_logprobs": top[: max(asked, 1)]}
        )  # fmt: skip
    return {"content": content}


def _usage(prompt: int, completion: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt,
        "total_tokens": prompt + completion,
        "completion_tokens": completion,
        "prompt_tokens_details": None,
    }


def _choice(
    index: int, reason: str | None, stop: Any, ids: list[int], versions: Any = None
) -> dict[str, Any]:
    return {
        "index": index, "finish_reason": reason, "stop_reason": stop, "token_ids": ids,
        "routed_experts": None, "sampling_mask": None, "weight_versions": versions,
    }  # fmt: skip


class TokensOutRoutes:
    """``reader``: the HTTP frontend whose body limits apply."""

    def __init__(self, server: Server, reader: BodyReader) -> None:
        self.server, self.reader = server, reader

    async def generate(self, request: Request) -> Response:
        body = await received(request, http_slot(self.server.tracer, request.headers), self.reader)
        llm = model_for(self.server, body)
        if llm.runner == "pooling":
            raise OpenAIError("the model does not support the generate tokens API", param="model")
        model = body.get("model") or llm.model_name
        sampled = set(body["sampling_params"]) if isinstance(body.get("sampling_params"),
                                                               dict) else set()  # fmt: skip
        tokens_only = self.server.options.tokens_only
        if tokens_only:  # vLLM's force_no_detokenize
            check_generate(body)
        try:
            cbody = await asyncio.to_thread(
                completions_body, body, model, llm.vocab_size, llm.max_model_len
            )
            req = completion_request(cbody)
            thinking_markers(llm, req)
            ((ids, params),) = await asyncio.to_thread(prepare, llm, req, None)
        except OpenAIError as exc:
            raise _remap(exc, sampled) from None
        if not req.stream and not req.stop:  # a whole answer: no step's tokens before the last
            params = replace(params, stream_interval=params.max_tokens)
        rid = f"generate-tokens-{request_id(req.request_id)}"  # what abort_requests names
        options = OutputOptions(req.include_stop_str_in_output, req.skip_special_tokens,
                                not tokens_only)  # fmt: skip
        deltas = run(llm, ids, params, req.stop, req.priority, rid, options)
        if not req.stream:
            return json_response(await _whole(llm, req, ids, deltas, rid, body))
        interval = llm.sse_keep_alive_interval
        if interval:
            llm.check_admission(params.n)  # vLLM's preflight: a 503 before the stream
        deltas = await started(deltas, interval or None)
        events = _events(llm, req, ids, deltas, rid, body)
        return StreamingResponse(with_keep_alive(events, interval), media_type="text/event-stream")

    async def abort_requests(self, request: Request) -> Response:
        """vLLM's: the requests ``request_ids`` name end now, each choice with
        finish_reason ``abort``; ids of no request in flight are ignored. An id names a
        request as vLLM's engine matches it (``EngineClient.engine_ids``): generate's
        ``generate-tokens-<id>``, a chat's ``chatcmpl-<id>``, a completions prompt's
        ``cmpl-<id>-<i>``, or the engine's own id (those and 8 random hex digits)."""
        body = await read_json(request, self.reader)
        ids = body.get("request_ids")
        if ids is None:
            raise OpenAIError("Missing 'request_ids' in request body", param="request_ids")
        ids = [ids] if isinstance(ids, str) else ids
        if not isinstance(ids, list) or not all(isinstance(i, str) for i in ids):
            raise OpenAIError("'request_ids' must be a list of strings", param="request_ids")
        if len(ids) > MAX_ABORT_IDS:
            raise OpenAIError(
                f"'request_ids' holds {len(ids)} ids, more than {MAX_ABORT_IDS}",
                param="request_ids",
            )
        if any(len(i) > MAX_ABORT_ID for i in ids):
            raise OpenAIError(
                f"a request id is at most {MAX_ABORT_ID} characters (no request in flight "
                "has a longer one)",
                param="request_ids",
            )
        wanted = set(ids)
        for llm in self.server.llm_engines().values():
            matched = llm.engine_ids(wanted)
            if matched:
                with contextlib.suppress(KilnError):  # unloaded meanwhile: they end with it
                    await llm.control("abort", request_ids=matched)
        return Response(status_code=200)


async def _whole(
    llm: EngineClient,
    req: GenerationRequest,
    ids: list[int],
    deltas: AsyncGenerator[Delta, None],
    rid: str,
    body: dict[str, Any],
) -> dict[str, Any]:
    """vLLM's ``GenerateTokensResponse``."""
    n = req.params.n
    text_mode = body.get("output_mode") == "text"
    texts: list[list[str]] = [[] for _ in range(n)]
    tokens: list[list[int]] = [[] for _ in range(n)]
    entries: list[list[TokenLogprobs]] = [[] for _ in range(n)]
    reasons: list[str | None] = [None] * n
    stops: list[int | str | None] = [None] * n
    versions: list[list[dict[str, Any]] | None] = [None] * n
    prompt_entries: list[TokenLogprobs | None] | None = None
    try:
        async with aclosing(deltas):
            async for d in deltas:
                tokens[d.index] += d.token_ids
                texts[d.index].append(d.text)
                entries[d.index] += d.logprobs
                reasons[d.index] = d.finish_reason or reasons[d.index]
                stops[d.index] = d.stop_reason if d.stop_reason is not None else stops[d.index]
                if d.weight_versions is not None:
                    versions[d.index] = d.weight_versions
                if d.prompt_logprobs is not None:
                    prompt_entries = d.prompt_logprobs
    except KilnError as exc:
        raise OpenAIError.from_kiln(exc) from None
    asked = req.params.logprobs
    choices = []
    for i in range(n):
        choice = _choice(i, reasons[i] or "stop", stops[i], tokens[i], versions[i])
        if text_mode:
            choice["text"] = "".join(texts[i])
        choice["logprobs"] = _logprobs(llm, entries[i], asked, text_mode)
        choices.append(choice)
    prompt_logprobs = None
    if req.prompt_logprobs_field and prompt_entries is not None:
        count = req.params.prompt_logprobs or 0
        prompt_logprobs = vllm_prompt_logprobs(llm.tokenizer, prompt_entries, count)
    completion = sum(len(t) for t in tokens)
    return {
        "request_id": rid,
        "model": req.model,
        "created": int(time.time()),
        "usage": _usage(len(ids), completion),
        "prompt_logprobs": prompt_logprobs,
        "prompt_token_id_logprobs": None,
        "prompt_token_ids": ids if body.get("return_token_ids") is True else None,
        "mm_placeholders": None,
        "metrics": None,
        "kv_transfer_params": None,
        "ec_transfer_params": None,
        "output_mode": "text" if text_mode else "tokens",
        "choices": choices,
    }


def _logprobs(
    llm: EngineClient, entries: list[TokenLogprobs], asked: int | None, text: bool
) -> dict[str, Any] | None:
    """A choice's logprobs: by token id (``tokens``), or chat's shape (``text``)."""
    if asked is None:
        return None
    if text:
        return chat_logprobs(llm.tokenizer, entries)
    return token_logprobs(entries, asked)


async def _events(
    llm: EngineClient,
    req: GenerationRequest,
    ids: list[int],
    deltas: AsyncGenerator[Delta, None],
    rid: str,
    body: dict[str, Any],
) -> AsyncIterator[bytes]:
    """vLLM's ``GenerateTokensStreamResponse`` (``GenerateTextStreamResponse``) chunks: one
    per choice's delta, then (with ``stream_options.include_usage``) one with the usage and
    no choices, then ``[DONE]``."""
    asked = req.params.logprobs
    return_ids = body.get("return_token_ids") is True
    text_mode = body.get("output_mode") == "text"
    mode = "text" if text_mode else "tokens"
    counts: dict[int, int] = {}
    first = True
    async with aclosing(deltas):
        try:
            async for d in deltas:
                counts[d.index] = len(d.token_ids) + counts.get(d.index, 0)
                if not d.token_ids and d.finish_reason is None and not (text_mode and d.text):
                    continue
                choice = _choice(
                    d.index, d.finish_reason, d.stop_reason, d.token_ids, d.weight_versions
                )
                if text_mode:
                    choice["text"] = d.text
                choice["logprobs"] = _logprobs(llm, d.logprobs, asked, text_mode)
                chunk: dict[str, Any] = {"request_id": rid, "usage": None}
                if first and return_ids:
                    chunk["prompt_token_ids"] = ids
                first = False
                if req.continuous_usage:
                    chunk["usage"] = _usage(len(ids), counts[d.index])
                chunk.update(output_mode=mode, choices=[choice])
                yield b"data: " + orjson.dumps(chunk) + b"\n\n"
        except KilnError as exc:
            yield b"data: " + orjson.dumps(OpenAIError.from_kiln(exc).body()) + b"\n\n"
            yield b"data: [DONE]\n\n"
            return
    if req.include_usage:
        usage = _usage(len(ids), sum(counts.values()))
        final = {"request_id": rid, "usage": usage, "output_mode": mode, "choices": []}
        yield b"data: " + orjson.dumps(final) + b"\n\n"
    yield b"data: [DONE]\n\n"
