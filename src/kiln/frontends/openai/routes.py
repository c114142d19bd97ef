"""``/v1/*`` routes: OpenAI-shaped JSON, or Server-Sent Events when ``stream`` is true."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Protocol

import orjson
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import BaseRoute, Route, request_response
from starlette.types import ASGIApp, Receive, Scope, Send

from kiln import __version__
from kiln.core.errors import KilnError, Status
from kiln.core.trace import FrontendSlot, http_slot
from kiln.frontends import disconnect
from kiln.frontends.openai import classify as classifier
from kiln.frontends.openai import (
    cohere,
    embeddings,
    generative_scoring,
    lora,
    messages,
    reasoning,
    responses,
    scores,
    tools,
)
from kiln.frontends.openai.content import content_text, for_template
from kiln.frontends.openai.generation import (
    BeamOptions,
    Delta,
    OutputOptions,
    beam_run,
    merged,
    run,
    started,
)
from kiln.frontends.openai.keep_alive import with_keep_alive
from kiln.frontends.openai.logprobs import (
    CompletionLogprobs,
    chat_logprobs,
    vllm_prompt_logprobs,
)
from kiln.frontends.openai.protocol import (
    CHAT_FIELDS,
    MAX_CHARS_PER_TOKEN,
    TOKENIZE_FIELDS,
    GenerationRequest,
    OpenAIError,
    chat_messages,
    chat_request,
    chat_template_options,
    check_fields,
    check_prompt_chars,
    completion_request,
    detokenize_ids,
    flag,
    with_server_kwargs,
)
from kiln.frontends.openai.reasoning import ReasoningParser
from kiln.frontends.openai.request_ids import RequestIdError, remember_header, request_id
from kiln.frontends.openai.tokenizer_info import tokenizer_info
from kiln.llm.engine_client import EngineClient
from kiln.llm.params import InvalidField, with_defaults
from kiln.llm.sequence import SamplingParams
from kiln.server.server import Server

if TYPE_CHECKING:  # importing the sampler imports torch
    from kiln.llm.sampler import TokenLogprobs

log = logging.getLogger(__name__)

LogprobsFormat = Callable[[list["TokenLogprobs"]], dict[str, Any]]


SCORE_PATHS = ("/score", "/v1/score")
#: conversations in one /v1/chat/completions/batch request
MAX_BATCH_CONVERSATIONS = 1024
RERANK_PATHS = ("/rerank", "/v1/rerank", "/v2/rerank")


def _json(body: Any, status: int = 200) -> Response:
    return Response(orjson.dumps(body), status, media_type="application/json")


def _llm(server: Server, name: str, body: dict[str, Any] | None = None) -> EngineClient:
    """The model's engine through core: an unknown or unloaded model is core's error (the
    one infer gives), in OpenAI's shape. ``body``: a rollout's sticky key is one of its
    fields (e.g. ``user``)."""
    try:
        return server.llm_engine(name, parameters=body)
    except KilnError as exc:
        if exc.status is Status.NOT_FOUND:
            bound = lora.adapter(server, name)  # a LoRA adapter of a served model
            if bound is not None:
                return bound
            raise OpenAIError(str(exc), 404, param="model", code="model_not_found") from None
        if exc.status is Status.INVALID_ARG:
            raise OpenAIError(str(exc), param="model") from None
        raise


def _generator(
    server: Server, name: str, api: str, body: dict[str, Any] | None = None
) -> EngineClient:
    """A model that generates: one served with ``runner: pooling`` answers embeddings
    only, as vLLM's pooling runner does."""
    llm = _llm(server, name, body)
    if llm.runner == "pooling":
        raise OpenAIError(
            f"The model '{name}' does not support {api} API: it is served with runner "
            "'pooling' (embeddings, or classification for a classifier)",
            param="model",
        )
    return llm


class BodyReader(Protocol):
    """The HTTP frontend these routes are mounted on (``HttpFrontend``): it reads bodies
    under its limits. Passed in: ``frontends.http`` sits above ``frontends.openai``."""

    async def read_body(self, request: Request) -> bytes: ...


#: a body longer than this is parsed off the event loop (the KServe routes' bound too)
OFF_LOOP_PARSE_BYTES = 1 << 20


async def _body(request: Request, reader: BodyReader) -> dict[str, Any]:
    try:  # X-Request-Id names the answer (vLLM's rule): request_ids.py
        remember_header(request)
    except RequestIdError as exc:
        raise OpenAIError(str(exc)) from None
    read: dict[str, Any] | None = getattr(request.state, "openai_body", None)
    if read is not None:  # /invocations read it to pick the route
        return read
    # the HTTP frontend's reader: --http-max-input-size (413) and --http-read-timeout-secs
    # (408) hold here as on the KServe routes
    raw = await reader.read_body(request)
    disconnect.watch(request)  # a client that leaves from now on cancels the handler
    try:
        # a large body parses on a worker thread (62 MB of token ids: half a second that
        # every other client would wait), as the KServe routes decode theirs
        if len(raw) > OFF_LOOP_PARSE_BYTES:
            body = await asyncio.to_thread(orjson.loads, raw)
        else:
            body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise OpenAIError(f"the request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise OpenAIError("the request body must be a JSON object")
    return body


async def _received(
    request: Request, slot: FrontendSlot | None, reader: BodyReader
) -> dict[str, Any]:
    """The request's JSON body; a traced request's receive ends here."""
    body = await _body(request, reader)
    if slot is not None:
        slot.recv_end = time.monotonic_ns()
    return body


def _detokenize(llm: EngineClient, body: dict[str, Any]) -> str:
    """As vLLM's ``/detokenize``: the text of every token, special ones included."""
    return llm.tokenizer.decode(detokenize_ids(body, llm.vocab_size), False)


def _precheck_prompt(llm: EngineClient | None, body: dict[str, Any]) -> None:
    """Refuse a completion prompt that cannot fit the model's context from its size alone,
    before the work in proportion to it (checking each token id, tokenizing)."""
    raw = body.get("prompt")
    if llm is None or not isinstance(raw, str | list):
        return  # completion_request names the field
    limit = llm.max_model_len
    prompts = raw if isinstance(raw, list) and raw and isinstance(raw[0], str | list) else [raw]
    truncating = body.get("truncate_prompt_tokens") is not None
    for prompt in prompts:
        if isinstance(prompt, str):
            check_prompt_chars(len(prompt), limit, "prompt")
        elif isinstance(prompt, list) and not truncating and len(prompt) >= limit:
            raise OpenAIError(
                f"This model's maximum context length is {limit} tokens. However, the prompt "
                f"has {len(prompt)} tokens, leaving no room to generate. Please reduce the "
                "prompt.",
                param="prompt",
                code="context_length_exceeded",
            )


def _chat_prompt(
    llm: EngineClient, messages: list[dict[str, Any]], template: dict[str, Any]
) -> str:
    chars = sum(len(content_text(m["content"])) for m in messages)
    check_prompt_chars(chars, llm.max_model_len, "messages")
    kwargs = with_server_kwargs(llm, template)  # a request's untrusted template: refused
    prompt = llm.tokenizer.apply_chat_template(for_template(llm, messages, template), **kwargs)
    # the template adds what the messages' count missed (tools, documents, its variables):
    # the rendered text is checked too, before the tokenizer's work in proportion to it
    check_prompt_chars(len(prompt), llm.max_model_len, "messages")
    return prompt


def _with_model_defaults(body: dict[str, Any], llm: EngineClient | None) -> dict[str, Any]:
    """The body with the serving version's generation_config.json defaults filled in (not
    for beam search, which ranks by the model's logprobs alone: its penalties would be
    refused as the client's)."""
    if llm is None or body.get("use_beam_search") is True:
        return body
    return with_defaults(body, llm.sampling_defaults)


def _prompt_ids(
    llm: EngineClient, req: GenerationRequest, prompt: str | list[int], bos: bool
) -> list[int]:
    """``bos``: the tokenizer's special tokens (BOS) are added to a text prompt (vLLM's
    ``add_special_tokens``)."""
    vocab = llm.vocab_size
    if isinstance(prompt, list):
        ids = prompt
        if any(not 0 <= t < vocab for t in ids):
            raise OpenAIError(f"prompt token ids must be in [0, {vocab})", param="prompt")
    else:
        ids = llm.tokenizer.encode(prompt, add_special_tokens=bos)
    keep = req.truncate_prompt_tokens
    if keep is not None:
        limit = llm.max_model_len
        keep = limit if keep == -1 else keep
        if keep > limit:
            raise OpenAIError(
                f"truncate_prompt_tokens ({keep}) is greater than max_model_len ({limit})",
                param="truncate_prompt_tokens",
            )
        ids = ids[-keep:]  # vLLM keeps the prompt's end: the text right before the answer
    return ids


def _check_bad_words(llm: EngineClient, words: tuple[str, ...]) -> None:
    """``bad_words`` are tokenized like a prompt: their text together is bounded as a
    prompt's is (longer, no output could hold them), before the tokenizer's work."""
    chars = sum(len(w) for w in words)
    limit = llm.max_model_len * MAX_CHARS_PER_TOKEN
    if chars > limit:
        raise OpenAIError(
            f"'bad_words' hold {chars} characters, more than {limit} ({MAX_CHARS_PER_TOKEN} "
            f"per token of the model's context, {llm.max_model_len}): no output could hold them",
            param="bad_words",
        )


def _prepare(
    llm: EngineClient, req: GenerationRequest, default_max: int | None, chat: bool = False
) -> list[tuple[list[int], SamplingParams]]:
    """Each prompt's token ids and sampling parameters, the request's checks done. On a
    worker thread: tokenizing takes time in proportion to the prompt, which must not stall
    the event loop."""
    if len(req.prompts) > llm.max_queued:
        raise OpenAIError(
            f"'prompt' holds {len(req.prompts)} prompts, more than the model queues at once "
            f"({llm.max_queued})",
            param="prompt",
        )
    _check_bad_words(llm, req.bad_words)
    bad_words = llm.tokenizer.bad_words_ids(req.bad_words) if req.bad_words else ()
    checks: tuple[tuple[str, Callable[[], object]], ...] = (
        ("n", lambda: llm.check_n(req.params.n)),
        ("priority", lambda: llm.check_priority(req.priority)),
    )
    for param, check in checks:
        try:
            check()
        except KilnError as exc:
            raise OpenAIError(str(exc), param=param) from None
    if req.beam_search:
        _check_beam_search(llm, req)
    prepared = []
    for prompt in req.prompts:
        ids = _prompt_ids(llm, req, prompt, bos=req.add_special_tokens)
        limit = llm.max_model_len
        room = limit - len(ids)
        max_tokens = req.max_tokens or (min(default_max, room) if default_max else room)
        if max_tokens > room and room > 0:
            raise OpenAIError(
                f"This model's maximum context length is {limit} tokens. However, you "
                f"requested {len(ids) + max_tokens} tokens ({len(ids)} in the prompt, "
                f"{max_tokens} for the completion). Please reduce the prompt or max_tokens.",
                param="max_tokens",
                code="context_length_exceeded",
            )
        if llm.max_new_tokens:  # generation_config.json's bound, as vLLM applies it
            max_tokens = min(max_tokens, llm.max_new_tokens)
        params = replace(req.params, max_tokens=max(max_tokens, 1), bad_words_token_ids=bad_words)
        try:
            llm.check_request(len(ids), params, req.priority)  # compiles a grammar too
        except InvalidField as exc:
            # chat asks for alternatives with top_logprobs (logprobs is its switch)
            field = "top_logprobs" if chat and exc.field == "logprobs" else exc.field
            raise OpenAIError(str(exc), param=field) from None
        except KilnError as exc:
            raise OpenAIError(str(exc), param="prompt", code="context_length_exceeded") from None
        prepared.append((ids, params))
    return prepared


#: streamed background responses whose events are kept for GET ?stream=true
MAX_FEEDS = 64


def _server_defaults(llm: EngineClient, req: GenerationRequest, body: dict[str, Any]) -> None:
    """vLLM's server flags over a request: ``--enable-force-include-usage`` (a stream's
    last chunk carries ``usage`` whatever its ``stream_options``) and
    ``--return-tokens-as-token-ids`` (the default of the request's field)."""
    if llm.force_include_usage and req.stream:
        req.include_usage = True
    if body.get("return_tokens_as_token_ids") is None and llm.return_tokens_as_token_ids:
        req.return_tokens_as_token_ids = True


def _check_beam_search(llm: EngineClient, req: GenerationRequest) -> None:
    """What beam search cannot run with, refused before anything is queued: each step asks
    the engine for 2 x ``n`` logprobs a beam (bounded by the model's ``max_logprobs``); each
    step's requests hold their whole sequence, so without the prefix cache a search would
    recompute every beam from its prompt's start at every step (its work growing with the
    square of its length: one request could hold the engine); and a grammar constrains
    sampling, not the logprobs beams are ranked by."""
    if not llm.engine.config.enable_prefix_caching:
        raise OpenAIError(
            "beam search needs the prefix cache, which this model runs without "
            "(--enable-prefix-caching)",
            param="use_beam_search",
        )
    n = req.params.n
    limit = llm.engine.config.max_logprobs
    if limit != -1 and 2 * n > limit:
        raise OpenAIError(
            f"beam search with n = {n} ranks {2 * n} candidates a beam each step, more than "
            f"this model's max_logprobs ({limit}): ask for at most {limit // 2} beams",
            param="n",
        )
    if req.params.structured_outputs is not None:
        raise OpenAIError(
            "beam search does not run with structured outputs (response_format, "
            "structured_outputs, guided_*, or a tool_choice that forces a call)",
            param="use_beam_search",
        )


def _usage(prompt_tokens: int, completion: dict[int, int], cached: int = 0) -> dict[str, Any]:
    """``completion``: tokens per choice index (their sum is the request's); ``cached``:
    prompt tokens the prefix cache held (OpenAI's ``prompt_tokens_details``)."""
    total = sum(completion.values())
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": total,
        "total_tokens": prompt_tokens + total,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def _prompt_field(
    llm: EngineClient, req: GenerationRequest, entries: list[TokenLogprobs | None] | None
) -> list[dict[str, dict[str, Any]] | None] | None:
    """vLLM's ``prompt_logprobs`` of an answer (None when the engine sent none)."""
    if entries is None:
        return None
    return vllm_prompt_logprobs(llm.tokenizer, entries, req.params.prompt_logprobs or 0)


def _logprobs_format(
    llm: EngineClient, req: GenerationRequest, chat: bool, echoed: str
) -> LogprobsFormat | None:
    if req.params.logprobs is None:
        return None
    as_ids = req.return_tokens_as_token_ids
    if chat:
        return lambda entries: chat_logprobs(llm.tokenizer, entries, as_ids)
    return CompletionLogprobs(llm.tokenizer, len(echoed), as_ids)


@dataclass(slots=True)
class _Echo:
    """A streamed completion's ``echo``: each choice's first chunk starts with its prompt
    (and, with logprobs, the prompt tokens' logprobs from text offset 0), as vLLM streams it."""

    texts: list[str]  # per prompt
    first_tokens: list[int]  # per prompt
    n: int
    pending: set[int]  # the choices whose prompt has not gone out yet


async def _sse(
    deltas: AsyncIterator[Delta],
    req: GenerationRequest,
    chat: bool,
    rid: str,
    formats: list[LogprobsFormat | None],
    prompt_counts: list[int],
    echo: _Echo | None = None,
) -> AsyncIterator[bytes]:
    """``formats``: each choice's logprobs formatter (None: no logprobs asked);
    ``prompt_counts``: each prompt's tokens."""
    created = int(time.time())
    kind = "chat.completion.chunk" if chat else "text_completion"
    head = {"id": rid, "object": kind, "created": created, "model": req.model}
    n = req.params.n
    completion: dict[int, int] = {}
    cached: dict[int, int] = {}  # per prompt

    def event(choice: dict[str, Any]) -> bytes:
        out = {**head, "choices": [choice]}
        if req.continuous_usage:  # vLLM's: the choice's prompt and its tokens so far
            index = choice["index"]
            out["usage"] = _usage(
                prompt_counts[index // n], {0: completion.get(index, 0)}, cached.get(index // n, 0)
            )
        return b"data: " + orjson.dumps(out) + b"\n\n"

    # each choice's tool-call reader (tool_choice auto, required or named; chat is one prompt)
    calls = [req.tools.stream() if req.tools else None for _ in range(req.params.n)]
    # and its reasoning reader (a thinking model's <think> part, before the tool calls')
    thoughts = [req.reasoning.stream() if req.reasoning else None for _ in range(req.params.n)]

    def chunk(index: int, d: Delta) -> bytes | None:
        """The event of choice ``index``'s delta ``d``; None when a tool-call reader holds
        its text back (it may begin a call)."""
        text, reason = d.text, d.finish_reason
        fmt = formats[index]
        lp = None
        if chat:
            delta: dict[str, Any] = {}
            thinking = thoughts[index]
            if thinking is not None:
                thought, text = thinking.feed(text, final=reason is not None)
                if thought and req.include_reasoning:
                    delta.update(_reasoning(thought))
            stream = calls[index]
            if stream is not None and req.tools is not None:
                text, deltas = stream.feed(text, final=reason is not None)
                reason = req.tools.finish_reason(stream.called, reason)
                if deltas:
                    delta["tool_calls"] = deltas
            if not (text or delta or reason or d.logprobs):
                return None
            if text:
                delta["content"] = text
            choice: dict[str, Any] = {"index": index, "delta": delta}
        elif echo is not None and index in echo.pending:
            echo.pending.discard(index)
            choice = {"index": index, "text": echo.texts[index // echo.n] + text}
            if isinstance(fmt, CompletionLogprobs) and d.prompt_logprobs:
                # the prompt's tokens first, from offset 0 (the first has no logprob)
                known = [e for e in d.prompt_logprobs[1:] if e is not None]
                lp = fmt(known + d.logprobs, echo.first_tokens[index // echo.n])
        else:
            choice = {"index": index, "text": text}
        if lp is None and fmt is not None:
            lp = fmt(d.logprobs)
        choice.update(logprobs=lp, finish_reason=reason)
        if reason is not None:  # vLLM's: the stop string or stop token that ended it
            choice["stop_reason"] = d.stop_reason
        return event(choice)

    if chat:
        for index in range(req.params.n):
            yield event({"index": index, "delta": {"role": req.role, "content": ""},
                         "logprobs": None, "finish_reason": None})  # fmt: skip
        if req.chat_echo:  # vLLM's chat echo: the last message's text, after the role
            for index in range(req.params.n):
                content = {"content": req.chat_echo}
                yield event({"index": index, "delta": content, "logprobs": None,
                             "finish_reason": None})  # fmt: skip
    try:
        async for d in deltas:
            completion[d.index] = d.completion_tokens
            cached[d.index // n] = d.cached_tokens
            if d.text or d.finish_reason or (echo is not None and d.index in echo.pending):
                out = chunk(d.index, d)
                if out is not None:
                    yield out
    except KilnError as exc:
        yield b"data: " + orjson.dumps(OpenAIError.from_kiln(exc).body()) + b"\n\n"
    if req.include_usage and completion:
        usage = _usage(sum(prompt_counts), completion, sum(cached.values()))
        final = {**head, "choices": [], "usage": usage}
        yield b"data: " + orjson.dumps(final) + b"\n\n"
    yield b"data: [DONE]\n\n"


async def _respond(
    llm: EngineClient,
    req: GenerationRequest,
    prepared: list[tuple[list[int], SamplingParams]],
    chat: bool,
) -> Response:
    if not req.stream:
        return _json(await _answer(llm, req, prepared, chat))
    events = await _stream(llm, req, prepared, chat)
    return StreamingResponse(events, media_type="text/event-stream")


async def _stream(
    llm: EngineClient,
    req: GenerationRequest,
    prepared: list[tuple[list[int], SamplingParams]],
    chat: bool,
) -> AsyncIterator[bytes]:
    """A streamed completion's SSE events, once the first output came (an error before
    it keeps its HTTP status)."""
    rid = f"{'chatcmpl' if chat else 'cmpl'}-{request_id(req.request_id)}"
    deltas = _outputs(llm, req, prepared, rid)
    n = req.params.n
    total = n * len(prepared)
    firsts = [ids[0] for ids, _ in prepared]
    echo = not chat and req.echo
    echoed = _echoed(llm, req, prepared, echo)
    # the prompt's logprobs go through the same formatter, so offsets start at 0
    formats = [_logprobs_format(llm, req, chat, "") for _ in range(total)]
    streamed = _Echo(echoed, firsts, n, set(range(total))) if echo else None
    interval = llm.sse_keep_alive_interval
    if interval:
        # vLLM's preflight: a request its admission limits refuse is a 503 before the
        # stream begins, whenever its first output would come
        llm.check_admission(total)
    # an error before any output: its HTTP status (with keep-alive, one within the
    # interval; the stream begins then, and its comments cover the wait)
    deltas = await started(deltas, interval or None)
    counts = [len(ids) for ids, _ in prepared]
    return with_keep_alive(_sse(deltas, req, chat, rid, formats, counts, streamed), interval)


def _reasoning(text: str | None) -> dict[str, str | None]:
    """A message's (or delta's) reasoning: vLLM's ``reasoning``, and ``reasoning_content``,
    its older name (which SGLang and llama.cpp write too), beside it."""
    return {"reasoning": text, "reasoning_content": text}


def _echoed(
    llm: EngineClient, req: GenerationRequest, prepared: list[tuple[list[int], SamplingParams]],
    echo: bool,
) -> list[str]:  # fmt: skip
    """Each prompt's echoed text ("" without ``echo``): a prompt of token ids (or a
    truncated one) is echoed as its text, as vLLM does."""
    return [
        ""
        if not echo
        else p
        if isinstance(p, str) and req.truncate_prompt_tokens is None
        else llm.tokenizer.decode(ids)
        for p, (ids, _) in zip(req.prompts, prepared, strict=True)
    ]


def _outputs(
    llm: EngineClient, req: GenerationRequest, prepared: list[tuple[list[int], SamplingParams]],
    rid: str,
) -> AsyncGenerator[Delta, None]:  # fmt: skip
    """Every choice's deltas, merged (choice ``index`` = prompt ``i`` * ``n`` + sample).
    A whole answer with no stop string to watch for needs no tokens before the last: its
    outputs wait in the engine's collector until the choice ends (vLLM's ``FINAL_ONLY``),
    detokenized once instead of once a step."""
    options = OutputOptions(req.include_stop_str_in_output, req.skip_special_tokens)
    if req.beam_search:
        beams = BeamOptions(req.length_penalty)
        return merged(
            [beam_run(llm, ids, p, req.stop, beams, req.priority, rid, options)
             for ids, p in prepared],
            req.params.n,
        )  # fmt: skip
    if not req.stream and not req.stop:
        prepared = [(ids, replace(p, stream_interval=p.max_tokens)) for ids, p in prepared]
    return merged(
        [run(llm, ids, p, req.stop, req.priority, rid, options) for ids, p in prepared],
        req.params.n,
    )


async def _answer(
    llm: EngineClient,
    req: GenerationRequest,
    prepared: list[tuple[list[int], SamplingParams]],
    chat: bool,
) -> dict[str, Any]:
    """A whole (not streamed) completion or chat completion body."""
    rid = f"{'chatcmpl' if chat else 'cmpl'}-{request_id(req.request_id)}"
    deltas = _outputs(llm, req, prepared, rid)
    n = req.params.n
    total = n * len(prepared)
    prompt_tokens = sum(len(ids) for ids, _ in prepared)
    firsts = [ids[0] for ids, _ in prepared]
    echo = not chat and req.echo
    echoed = _echoed(llm, req, prepared, echo)
    formats = [_logprobs_format(llm, req, chat, echoed[i // n]) for i in range(total)]
    texts: list[list[str]] = [[] for _ in range(total)]
    entries: list[list[TokenLogprobs]] = [[] for _ in range(total)]
    prompt_entries: list[list[TokenLogprobs | None] | None] = [None] * total
    reasons: list[str | None] = [None] * total
    stopped_by: list[int | str | None] = [None] * total  # vLLM's stop_reason
    completion: dict[int, int] = {}
    cached: dict[int, int] = {}  # per prompt
    try:
        async for d in deltas:
            texts[d.index].append(d.text)
            entries[d.index].extend(d.logprobs)
            if d.prompt_logprobs is not None:
                prompt_entries[d.index] = d.prompt_logprobs
            reasons[d.index] = d.finish_reason or reasons[d.index]
            if d.stop_reason is not None:
                stopped_by[d.index] = d.stop_reason
            completion[d.index] = d.completion_tokens
            cached[d.index // n] = d.cached_tokens
    except KilnError as exc:
        raise OpenAIError.from_kiln(exc) from None
    choices: list[dict[str, Any]] = []
    for index in range(total):
        content = "".join(texts[index])
        thought: dict[str, Any] = {}
        if chat and req.reasoning is not None:
            thinking, answer = req.reasoning.split(content)
            content = answer or ""
            thought = _reasoning(thinking) if req.include_reasoning else {}
        if chat and req.tools is not None and req.tools.parser is not None:
            message, reasons[index] = tools.tool_message(
                req.tools, req.role, content, reasons[index]
            )
            if req.chat_echo:  # the echoed message is no part of the calls' text
                message["content"] = req.chat_echo + (message["content"] or "")
            choice: dict[str, Any] = {"index": index, "message": message}
        elif chat:
            choice = {
                "index": index,
                "message": {"role": req.role, "content": req.chat_echo + content},
            }
        else:
            choice = {"index": index, "text": echoed[index // n] + content}
        if thought:
            message = choice["message"]
            if not message["content"]:  # vLLM's: no answer after (or beside) the thinking
                message["content"] = None
            choice["message"] = {**message, **thought}
        fmt = formats[index]
        prompt = prompt_entries[index]
        lp: dict[str, Any] | None = None
        if fmt is not None and prompt and echo and isinstance(fmt, CompletionLogprobs):
            # echo: the prompt's tokens first, from text offset 0 (the first has no logprob)
            known = [e for e in prompt[1:] if e is not None]
            as_ids = req.return_tokens_as_token_ids
            lp = CompletionLogprobs(llm.tokenizer, 0, as_ids)(
                known + entries[index], firsts[index // n]
            )
        elif fmt is not None:
            lp = fmt(entries[index])
        choice.update(logprobs=lp, finish_reason=reasons[index], stop_reason=stopped_by[index])
        if req.prompt_logprobs_field and not chat:  # vLLM's field, per choice
            choice["prompt_logprobs"] = _prompt_field(llm, req, prompt)
        choices.append(choice)
    body: dict[str, Any] = {}
    if req.prompt_logprobs_field and chat:  # vLLM's field, once for the chat's prompt
        body["prompt_logprobs"] = _prompt_field(llm, req, prompt_entries[0])
    return {
        "id": rid,
        "object": "chat.completion" if chat else "text_completion",
        "created": int(time.time()),
        "model": req.model,
        "choices": choices,
        **body,
        "usage": _usage(prompt_tokens, completion, sum(cached.values())),
    }


def _model_for(server: Server, body: dict[str, Any]) -> EngineClient:
    """``/tokenize`` and ``/detokenize``: ``model`` may be left out when one model serves."""
    model = body.get("model")
    if model is None:
        models = server.llm_engines()
        if len(models) == 1:
            return next(iter(models.values()))
        raise OpenAIError(f"'model' is required: {len(models)} llm models are ready", param="model")
    if not isinstance(model, str):
        raise OpenAIError("'model' must be a string", param="model")
    return _llm(server, model)


def _tokenize(llm: EngineClient, body: dict[str, Any]) -> dict[str, Any]:
    """vLLM's ``/tokenize``: a ``prompt``, or chat ``messages`` rendered as chat renders
    them. On a worker thread (the template and the tokenizer work in proportion)."""
    limit = llm.max_model_len
    pieces = flag(body, "return_token_strs", False)
    if "messages" in body:
        template = chat_template_options(body)
        listed = tools.check_tools(body)
        if listed:  # as chat renders them (vLLM's /tokenize takes tools too)
            template["template_kwargs"] = {"tools": listed, **template["template_kwargs"]}
        messages = tools.template_messages(chat_messages(body))
        text = _chat_prompt(llm, messages, template)
    else:
        prompt = body.get("prompt")
        if not isinstance(prompt, str):
            raise OpenAIError("'prompt' (a string) or 'messages' is required", param="prompt")
        check_prompt_chars(len(prompt), limit, "prompt")
        text = prompt
    # vLLM's default: BOS for a prompt, none on top of a chat template's own
    ids = llm.tokenizer.encode(text, flag(body, "add_special_tokens", "messages" not in body))
    return {
        "count": len(ids),
        "max_model_len": limit,
        "tokens": ids,
        "token_strs": llm.tokenizer.token_pieces(ids) if pieces else None,
    }


Handler = Callable[[Request], Awaitable[Response]]


def _answers_errors(handler: Handler) -> Handler:
    """OpenAI's error shape for what ``handler`` raises."""

    async def guarded(request: Request) -> Response:
        try:
            return await handler(request)
        except asyncio.CancelledError:
            return disconnect.answered_nobody(request)  # raises unless the client left
        except ClientDisconnect:
            return Response(status_code=400)  # nobody reads it
        except OpenAIError as exc:
            return _json(exc.body(), exc.status)
        except KilnError as exc:
            err = OpenAIError.from_kiln(exc)
            return _json(err.body(), err.status)
        except Exception:
            # a bug of kiln's, not the client's: logged with its traceback, and answered in
            # OpenAI's shape on a connection that stays open (a 500 escaping to the server
            # closes the client's keep-alive connection under its next request)
            log.exception("%s %s failed", request.method, request.url.path)
            err = OpenAIError("internal server error: see the server's log", 500,
                              type_="server_error")  # fmt: skip
            return _json(err.body(), err.status)
        finally:
            disconnect.stop(request)

    return guarded


def _thinking_markers(llm: EngineClient, req: GenerationRequest) -> None:
    """With vLLM's ``thinking_token_budget``: the reasoning parser's markers, which the
    engine counts between and forces the end of (without a parser the engine refuses the
    budget, as vLLM does without its reasoning config)."""
    if req.params.thinking_token_budget is None or llm.reasoning_parser is None:
        return
    encode = llm.tokenizer.encode
    parser = ReasoningParser(llm.reasoning_parser)
    start, end = (tuple(encode(text, False)) for text in (parser.start, parser.end))
    req.params = replace(req.params, reasoning_start=start, reasoning_end=end)


def _anthropic_errors(handler: Handler) -> Handler:
    """Anthropic's error shape (``{"type": "error", "error": {...}}``) for what
    ``handler`` raises, with the same HTTP status."""
    guarded = _answers_errors(handler)

    async def anthropic(request: Request) -> Response:
        response = await guarded(request)
        if response.status_code < 400 or isinstance(response, StreamingResponse):
            return response
        try:
            message = orjson.loads(response.body)["error"]["message"]
        except (ValueError, KeyError, TypeError):
            return response  # no body (a client that left): nothing to reshape
        return _json(messages.error_body(response.status_code, message), response.status_code)

    return anthropic


async def _chat_setup(
    server: Server, body: dict[str, Any], api: str, drawn: EngineClient | None = None
) -> tuple[EngineClient, GenerationRequest, list[tuple[list[int], SamplingParams]]]:
    """A chat completions body, checked, rendered by the chat template and tokenized: the
    model's engine (``drawn``: the one already drawn for the request), the request and
    each prompt's token ids and parameters."""
    messages = chat_messages(body)
    template = chat_template_options(body)
    model = body.get("model")
    # drawn once (a rollout split): the version whose template renders the prompt
    # is the version that generates
    llm = drawn or (_generator(server, model, api, body) if isinstance(model, str) else None)
    calling = tools.tool_request(body, llm) if llm else None
    messages = tools.template_messages(messages)
    # vLLM's --exclude-tools-when-tool-choice-none: tool_choice none renders no tools
    exclude = llm is not None and llm.exclude_tools_when_tool_choice_none
    if calling is not None and not (exclude and calling.choice == "none"):
        # transformers' ``tools=`` (the request's kwargs win)
        template["template_kwargs"] = {"tools": calling.tools, **template["template_kwargs"]}
    # the template renders in proportion to the messages: off the event loop too
    prompt = await asyncio.to_thread(_chat_prompt, llm, messages, template) if llm else ""
    role = llm.response_role if llm is not None else "assistant"
    req = chat_request(_with_model_defaults(body, llm), messages, prompt, template, role)
    tools.apply(req, calling)
    if llm is None:  # chat_request refused a 'model' that is not a string
        llm = _generator(server, req.model, api, body)
    _server_defaults(llm, req, body)
    _thinking_markers(llm, req)
    if llm.reasoning_parser is not None:
        req.reasoning = ReasoningParser(llm.reasoning_parser)
        if llm.reasoning_parser in reasoning.SPECIAL_MARKERS:
            req.skip_special_tokens = False  # the markers are control tokens
        if req.params.structured_outputs is not None:
            # vLLM's rule: the model thinks freely, the constraint holds after </think>
            end = tuple(llm.tokenizer.encode(req.reasoning.end))
            req.params = replace(req.params, reasoning_end=end)
    prepared = await asyncio.to_thread(_prepare, llm, req, None, True)
    return llm, req, prepared


class _InFlight:
    """vLLM's server load (``GET /load``): the requests in flight on the routes that
    generate or pool, from their arrival until their answer, a streamed one too, has been
    sent (or its client left)."""

    def __init__(self) -> None:
        self.count = 0

    def route(self, path: str, handler: Handler, methods: list[str]) -> Route:
        return Route(path, _Counted(request_response(handler), self), methods=methods)


class _Counted:
    """An endpoint as an ASGI app counted in flight around its whole call."""

    def __init__(self, app: ASGIApp, load: _InFlight) -> None:
        self.app, self.load = app, load

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        self.load.count += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.load.count -= 1


def openai_routes(server: Server, reader: BodyReader) -> list[BaseRoute]:
    """``reader``: the HTTP frontend whose body limits apply."""
    #: the Responses API's stored responses (``store``, ``previous_response_id``)
    stored = responses.ResponseStore()
    #: background responses still running, by id (their engine requests bound them)
    running: dict[str, asyncio.Task[None]] = {}
    #: streamed background responses' events, by id (the MAX_FEEDS most recent)
    feeds: dict[str, responses.EventFeed] = {}

    async def models(request: Request) -> Response:
        created = int(time.time())
        engines = server.llm_engines()
        names = [(name, name) for name in engines]  # (served name, its model)
        names += [(a, m) for a, m in server.options.llm_aliases.items() if m in engines]
        data = [
            {
                "id": name,
                "object": "model",
                "created": created,
                "owned_by": "kiln",
                "root": model,
                "parent": None,
                "max_model_len": engines[model].max_model_len,
                "permission": [_permission(created)],
            }
            for name, model in sorted(names)
        ]
        adapters = lora.cards(server, created)
        data += [{**card, "permission": [_permission(created)]} for card in adapters]
        return _json({"object": "list", "data": data})

    async def completions(request: Request) -> Response:
        slot = http_slot(server.tracer, request.headers)
        body = await _received(request, slot, reader)
        model = body.get("model")
        drawn = _generator(server, model, "Completions", body) if isinstance(model, str) else None
        req = completion_request(_with_model_defaults(body, drawn))
        _precheck_prompt(drawn, body)
        llm = drawn or _generator(server, req.model, "Completions", body)
        _server_defaults(llm, req, body)
        _thinking_markers(llm, req)
        # OpenAI's default max_tokens for completions: 16
        prepared = await asyncio.to_thread(_prepare, llm, req, 16)
        return await _respond(llm, req, prepared, chat=False)

    async def chat(request: Request) -> Response:
        slot = http_slot(server.tracer, request.headers)
        body = await _received(request, slot, reader)
        check_fields(body, CHAT_FIELDS, "chat completions")
        llm, req, prepared = await _chat_setup(server, body, "Chat Completions")
        return await _respond(llm, req, prepared, chat=True)

    async def batch_chat(request: Request) -> Response:
        """vLLM's ``POST /v1/chat/completions/batch``: ``messages`` holds conversations,
        each rendered and generated as its own chat request with the body's other fields;
        one choice per conversation, indexed in order, usage summed. Not streamed, without
        tools, beam search or ``n`` > 1, as in vLLM."""
        slot = http_slot(server.tracer, request.headers)
        body = await _received(request, slot, reader)
        check_fields(body, CHAT_FIELDS, "batch chat completions")
        conversations = body.get("messages")
        if (
            not isinstance(conversations, list)
            or not conversations
            or not all(isinstance(c, list) and c for c in conversations)
        ):
            raise OpenAIError(
                "'messages' must be a non-empty list of conversations, each a non-empty "
                "list of messages",
                param="messages",
            )
        if len(conversations) > MAX_BATCH_CONVERSATIONS:
            raise OpenAIError(
                f"'messages' holds {len(conversations)} conversations, more than "
                f"{MAX_BATCH_CONVERSATIONS}",
                param="messages",
            )
        for field, asks in (("stream", body.get("stream") not in (None, False)),
                            ("tools", bool(body.get("tools"))),
                            ("use_beam_search", body.get("use_beam_search") not in (None, False)),
                            ("n", body.get("n") not in (None, 1)),
                            ("echo", body.get("echo") not in (None, False))):  # fmt: skip
            if asks:
                raise OpenAIError(
                    f"Batch chat completions do not support '{field}': send each "
                    "conversation to /v1/chat/completions for it",
                    param=field,
                )
        llm: EngineClient | None = None
        first: GenerationRequest | None = None
        prompts: list[Any] = []
        prepared: list[tuple[list[int], SamplingParams]] = []
        for i, conversation in enumerate(conversations):
            try:
                llm, req, one = await _chat_setup(
                    server, {**body, "messages": conversation}, "Chat Completions", llm
                )
            except OpenAIError as exc:
                if exc.param is not None and exc.param.startswith("messages"):
                    exc.param = f"messages[{i}]" + exc.param.removeprefix("messages")
                    exc.message = f"conversation {i}: {exc.message}"
                raise
            if first is None:  # the model known: the batch must fit its queue
                embeddings.check_queue(llm, req.priority, len(conversations),
                                       "{} conversations", "messages")  # fmt: skip
            first = first or req
            prompts += req.prompts
            prepared += one
        assert llm is not None and first is not None
        whole = replace(first, prompts=prompts)  # one request of every conversation's prompt
        return _json(await _answer(llm, whole, prepared, chat=True))

    async def create_response(request: Request) -> Response:
        slot = http_slot(server.tracer, request.headers)
        body = await _received(request, slot, reader)
        call = responses.ResponsesCall.read(body, stored)
        try:
            llm, req, prepared = await _chat_setup(server, call.chat_body, "Responses")
        except OpenAIError as exc:
            raise responses.renamed(exc) from None
        rid = f"resp_{uuid.uuid4().hex}"
        if call.background:  # answered now, run on: GET fetches it, /cancel stops it
            response = call.skeleton(rid, req.model, "queued")
            stored.put(response, call.conversation)
            feed = None
            if req.stream:  # its events kept, for this request and GET ?stream=true
                feed = feeds[rid] = responses.EventFeed()
                while len(feeds) > MAX_FEEDS:
                    feeds.pop(next(iter(feeds)))
            task = asyncio.create_task(_run_background(llm, req, prepared, call, rid, feed))
            running[rid] = task
            task.add_done_callback(lambda _: running.pop(rid, None))
            if feed is not None:
                return StreamingResponse(feed.read(), media_type="text/event-stream")
            return _json(response)
        if req.stream:
            deltas = await started(_outputs(llm, req, prepared, rid))
            counts = sum(len(ids) for ids, _ in prepared)
            tok = llm.tokenizer

            def entries(tokens: list[TokenLogprobs]) -> list[dict[str, Any]]:
                content: list[dict[str, Any]] = chat_logprobs(tok, tokens)["content"]
                return content

            scored = entries if call.logprobs else None
            events = responses.events(call, rid, req, deltas, counts, stored, scored)
            return StreamingResponse(events, media_type="text/event-stream")
        answer = await _answer(llm, req, prepared, chat=True)
        return _json(call.finish(rid, answer, stored))

    async def anthropic_messages(request: Request) -> Response:
        """Anthropic's ``POST /v1/messages``, through chat completions (``messages.py``)."""
        slot = http_slot(server.tracer, request.headers)
        body = await _received(request, slot, reader)
        chat_body = messages.chat_body(body)
        llm, req, prepared = await _chat_setup(server, chat_body, "Messages")
        rid = f"msg_{request_id(None)}"  # X-Request-Id names it, as chat's
        if req.stream:
            events = await _stream(llm, req, prepared, chat=True)
            prompt = sum(len(ids) for ids, _ in prepared)
            converted = messages.events(events, rid, req.model, prompt)
            return StreamingResponse(converted, media_type="text/event-stream")
        return _json(messages.message(await _answer(llm, req, prepared, chat=True), rid))

    async def anthropic_count_tokens(request: Request) -> Response:
        """Anthropic's ``POST /v1/messages/count_tokens``: the prompt's tokens as the chat
        template renders the messages, the system prompt and the tools."""
        body = await _body(request, reader)
        chat_body = messages.chat_body(body, count_only=True)
        if not isinstance(chat_body["model"], str):
            raise OpenAIError("'model' is required: a string", param="model")
        llm = _generator(server, chat_body["model"], "Messages", body)
        counted = await asyncio.to_thread(_tokenize, llm, chat_body)
        return _json({"input_tokens": counted["count"]})

    async def _run_background(
        llm: EngineClient,
        req: GenerationRequest,
        prepared: list[tuple[list[int], SamplingParams]],
        call: responses.ResponsesCall,
        rid: str,
        feed: responses.EventFeed | None = None,
    ) -> None:
        """A background response's run: its stored object goes ``in_progress``, then is
        replaced by the finished one (or marked ``failed`` with the error); a streamed
        one's events go to ``feed`` as they come."""

        def mark(status: str, error: dict[str, Any] | None = None) -> None:
            with contextlib.suppress(OpenAIError):  # evicted from the store meanwhile
                current = stored.get(rid)
                if current["status"] in ("queued", "in_progress"):
                    current["status"] = status
                    if error is not None:
                        current["error"] = error

        mark("in_progress")
        if feed is not None:
            try:
                deltas = _outputs(llm, req, prepared, rid)
                scored = None
                if call.logprobs:
                    tok = llm.tokenizer
                    scored = lambda t: chat_logprobs(tok, t)["content"]  # noqa: E731
                counts = sum(len(ids) for ids, _ in prepared)
                stream = responses.events(call, rid, req, deltas, counts, stored, scored)
                async with contextlib.aclosing(stream) as events:
                    async for event in events:
                        feed.append(event)
            except Exception:
                log.exception("background response %s failed", rid)
                mark("failed", {"code": "server_error", "message": "see the server's log"})
            finally:
                feed.close()
            return
        try:
            answer = await _answer(llm, req, prepared, chat=True)
        except OpenAIError as exc:
            mark("failed", {"code": exc.code or exc.type, "message": exc.message})
            return
        except Exception:
            log.exception("background response %s failed", rid)
            mark("failed", {"code": "server_error", "message": "see the server's log"})
            return
        with contextlib.suppress(OpenAIError):
            if stored.get(rid)["status"] == "cancelled":
                return  # cancelled as it finished: stays cancelled
        call.finish(rid, answer, stored)

    async def get_response(request: Request) -> Response:
        """A stored response; with ``?stream=true`` a streamed background response's events
        (from after ``starting_after``, a sequence number), as they come."""
        rid = request.path_params["response_id"]
        response = stored.get(rid)
        if request.query_params.get("stream") not in ("true", "1"):
            return _json(response)
        feed = feeds.get(rid)
        if feed is None:
            raise OpenAIError(
                f"response '{rid[:100]}' was not created with background and stream: it has "
                "no events to stream",
                param="stream",
            )
        raw = request.query_params.get("starting_after", "-1")
        if not raw.lstrip("-").isdigit() or not -1 <= int(raw) < 1 << 31:
            raise OpenAIError(
                "'starting_after' must be a sequence number (an integer, -1 for all)",
                param="starting_after",
            )
        return StreamingResponse(feed.read(int(raw)), media_type="text/event-stream")

    async def cancel_response(request: Request) -> Response:
        """OpenAI's ``POST /v1/responses/{id}/cancel``: a background response still queued
        or running is stopped (its engine request aborted) and marked ``cancelled``."""
        rid = request.path_params["response_id"]
        response = stored.get(rid)
        if response["status"] not in ("queued", "in_progress"):
            raise OpenAIError(
                f"Cannot cancel a response that is {response['status']} (only a background "
                "response still queued or in progress)",
                param="response_id",
            )
        response["status"] = "cancelled"
        task = running.get(rid)
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        return _json(response)

    async def delete_response(request: Request) -> Response:
        return _json(stored.delete(request.path_params["response_id"]))

    async def embed(request: Request, pooling: bool = False) -> Response:
        body = await _received(request, http_slot(server.tracer, request.headers), reader)
        req = embeddings.embedding_request(body, pooling)
        llm = _llm(server, req.model)
        if llm.lora_request is not None:
            raise OpenAIError("LoRA adapters serve generation, not embeddings", param="model")
        token_classifier = llm.engine.args.is_token_classifier
        if req.task == "token_classify" or (pooling and not req.task and token_classifier):
            classifier.check_token_classifier(llm, req)  # vLLM's /pooling of a token classifier
            prompts = await asyncio.to_thread(embeddings.token_ids, llm, req)
            embeddings.check_token_values(llm, prompts, "token_classify")
            rows = await llm.pool(prompts, req.priority, tokens=True)
            tokens = sum(len(p) for p in prompts)
            raw = await asyncio.to_thread(classifier.token_pooling_body, llm, req, rows, tokens)
            return Response(raw, media_type="application/json")
        if req.task == "classify" or (pooling and not req.task and llm.engine.args.num_labels):
            classifier.check_model(llm, req)  # vLLM's /pooling of a classifier
            prompts = await asyncio.to_thread(embeddings.token_ids, llm, req)
            logits = await llm.pool(prompts, req.priority)
            tokens = sum(len(p) for p in prompts)
            return _json(classifier.pooling_body(llm, req, logits, tokens))
        embeddings.check_model(llm, req)
        prompts = await asyncio.to_thread(embeddings.token_ids, llm, req)
        every = req.task == "token_embed"
        if every:
            embeddings.check_token_values(llm, prompts, "token_embed")
        vectors = await llm.pool(prompts, req.priority, every)
        tokens = sum(len(p) for p in prompts)
        raw = await asyncio.to_thread(embeddings.response_body, llm, req, vectors, tokens)
        return Response(raw, media_type="application/json")

    async def cohere_embed(request: Request) -> Response:
        """Cohere's ``POST /v2/embed``, as vLLM serves it (``cohere.py``)."""
        body = await _received(request, http_slot(server.tracer, request.headers), reader)
        check_fields(body, cohere.FIELDS, "Cohere embed")
        req = cohere.read(body)
        llm = _model_for(server, {"model": req.model} if req.model else {})
        name = req.model or next(n for n, e in server.llm_engines().items() if e is llm)
        embed = cohere.embedding_request(llm, req, name)
        embeddings.check_model(llm, embed)
        prompts = await asyncio.to_thread(embeddings.token_ids, llm, embed)
        cohere.check_lengths(req, prompts)
        vectors = await llm.pool(prompts, embed.priority)
        tokens = sum(len(p) for p in prompts)
        raw = await asyncio.to_thread(cohere.answer, llm, req, embed, vectors, tokens)
        return Response(raw, media_type="application/json")

    async def pool(request: Request) -> Response:
        """vLLM's ``/pooling``: an embeddings request, answered in the pooling shape."""
        return await embed(request, pooling=True)

    async def _scored(request: Request, rerank: bool) -> Response:
        """vLLM's score (pairs of texts) or rerank (a query, documents) on a pooling model:
        every text embedded in one pooling call, each pair scored by its cosine."""
        body = await _received(request, http_slot(server.tracer, request.headers), reader)
        req = scores.rerank_request(body) if rerank else scores.score_request(body)
        llm = _llm(server, req.model)
        if llm.lora_request is not None:
            raise OpenAIError("LoRA adapters serve generation, not scores", param="model")
        scores.check_model(llm, req, "Rerank" if rerank else "Score")
        if llm.engine.args.num_labels:  # a cross-encoder: each pair one input
            pairs = await asyncio.to_thread(scores.pair_ids, llm, req)
            values = scores.cross_scores(await llm.pool(pairs, req.priority))
            tokens = sum(len(p) for p in pairs)
        else:
            left, right = await asyncio.to_thread(scores.token_ids, llm, req)
            vectors = await llm.pool(left + right, req.priority)
            values = scores.cosines(vectors, len(left))
            tokens = scores.pair_tokens(left, right)
        answer = scores.rerank_body if rerank else scores.score_body
        return _json(answer(req, values, tokens))

    async def classify(request: Request) -> Response:
        """vLLM's ``/classify``: a sequence classifier's class probabilities per input."""
        body = await _received(request, http_slot(server.tracer, request.headers), reader)
        req, activation = classifier.classify_request(body)
        llm = _llm(server, req.model)
        if llm.lora_request is not None:
            raise OpenAIError("LoRA adapters serve generation, not classification", param="model")
        classifier.check_model(llm, req)
        prompts = await asyncio.to_thread(embeddings.token_ids, llm, req)
        logits = await llm.pool(prompts, req.priority)
        tokens = sum(len(p) for p in prompts)
        return _json(classifier.response_body(llm, req, logits, tokens, activation))

    async def score(request: Request) -> Response:
        return await _scored(request, rerank=False)

    async def rerank(request: Request) -> Response:
        return await _scored(request, rerank=True)

    async def tokenize(request: Request) -> Response:
        body = await _body(request, reader)
        check_fields(body, TOKENIZE_FIELDS, "tokenize")
        llm = _model_for(server, body)
        return _json(await asyncio.to_thread(_tokenize, llm, body))

    async def detokenize(request: Request) -> Response:
        body = await _body(request, reader)
        llm = _model_for(server, body)
        # checked and decoded off the event loop: a body holds millions of ids
        text = await asyncio.to_thread(_detokenize, llm, body)
        return _json({"prompt": text})

    async def load_lora(request: Request) -> Response:
        return await lora.load(server, await _body(request, reader))

    async def unload_lora(request: Request) -> Response:
        return await lora.unload(server, await _body(request, reader))

    async def model_card(request: Request) -> Response:
        """OpenAI's ``GET /v1/models/{model}`` (``client.models.retrieve``)."""
        name = request.path_params["model"]
        body = orjson.loads((await models(request)).body)
        for card in body["data"]:
            if card["id"] == name:
                return _json(card)
        raise OpenAIError(
            f"The model '{name[:200]}' does not exist", 404, param="model", code="model_not_found"
        )

    async def invocations(request: Request) -> Response:
        """vLLM's SageMaker route: the body's shape picks the API (``messages``: chat,
        ``prompt``: completions, ``input``: embeddings, ``text_1``: score, ``query``:
        rerank), as vLLM tries them in turn."""
        body = await _body(request, reader)
        request.state.openai_body = body
        if "messages" in body:
            return await chat(request)
        if "prompt" in body:
            return await completions(request)
        if "input" in body:
            model = body.get("model")
            llm = _llm(server, model) if isinstance(model, str) else None
            if llm is not None and llm.engine.args.num_labels:  # the model's task decides
                return await classify(request)
            if llm is not None and llm.engine.args.is_token_classifier:
                return await pool(request)  # each token's labels: /pooling's answer
            return await embed(request)
        if "text_1" in body or "data_1" in body:
            return await score(request)
        if "query" in body:
            return await rerank(request)
        raise OpenAIError(
            "/invocations needs a chat ('messages'), completions ('prompt'), embeddings "
            "('input'), score ('text_1') or rerank ('query') request body"
        )

    async def health(request: Request) -> Response:
        return Response(status_code=200)

    async def score_generatively(request: Request) -> Response:
        """vLLM's ``POST /generative_scoring`` (``generative_scoring.py``)."""
        body = await _body(request, reader)
        check_fields(body, generative_scoring.FIELDS, "generative scoring")
        req = generative_scoring.read(body)
        llm = _generator(server, req.model, "Generative Scoring", body)
        embeddings.check_queue(llm, req.priority, len(req.items), "{} items", "items")
        prompts = await asyncio.to_thread(generative_scoring.prompts, llm, req)
        params = SamplingParams(
            max_tokens=1,
            temperature=0.0,
            logprobs=0,
            logprob_token_ids=tuple(req.labels),
            cache_salt=req.cache_salt,
        )
        rid = f"generative-scoring-{request_id(req.request_id)}"
        logprobs: list[list[float]] = [[] for _ in prompts]
        completion = 0
        streams = [run(llm, ids, params, (), req.priority, rid) for ids in prompts]
        try:
            async with contextlib.aclosing(merged(streams, 1)) as deltas:
                async for d in deltas:
                    for entry in d.logprobs:  # the one token's: the sampled one, the labels
                        listed = dict(entry.top)
                        logprobs[d.index] = [listed[t] for t in req.labels]
                    if d.finish_reason is not None:
                        completion += d.completion_tokens
        except KilnError as exc:
            raise OpenAIError.from_kiln(exc) from None
        scores = [generative_scoring.score(lps, req.apply_softmax) for lps in logprobs]
        prompt_tokens = sum(len(ids) for ids in prompts)
        return _json(generative_scoring.body(rid, req.model, scores, prompt_tokens, completion))

    async def version(request: Request) -> Response:
        return _json({"version": __version__})

    async def get_tokenizer_info(request: Request) -> Response:
        """vLLM's ``GET /tokenizer_info``: the models served with
        ``--enable-tokenizer-info-endpoint`` (``?model=`` names one when several are);
        without any, the route is not there (404, as vLLM's)."""
        shown = {n: m for n, m in server.llm_engines().items() if m.enable_tokenizer_info_endpoint}
        if not shown:
            return _json({"detail": "Not Found"}, 404)
        name = request.query_params.get("model")
        if name is None:
            if len(shown) > 1:
                raise OpenAIError(
                    f"'model' is required: {len(shown)} models serve /tokenizer_info "
                    "(GET /tokenizer_info?model=NAME)",
                    param="model",
                )
            llm = next(iter(shown.values()))
        elif name in shown:
            llm = shown[name]
        else:
            raise OpenAIError(
                f"The model '{name[:200]}' does not exist or is not served with "
                "--enable-tokenizer-info-endpoint",
                404,
                param="model",
                code="model_not_found",
            )
        return _json(tokenizer_info(llm.tokenizer))

    inflight = _InFlight()

    async def load(request: Request) -> Response:
        """vLLM's ``GET /load`` (its ``--enable-server-load-tracking``, always on here):
        the generation and pooling requests in flight, for a load-aware router."""
        return _json({"server_load": inflight.count})

    def counted(path: str, handler: Handler) -> Route:
        return inflight.route(path, handler, ["POST"])

    return [
        Route("/v1/models", models, methods=["GET"]),
        counted("/v1/completions", _answers_errors(completions)),
        counted("/v1/chat/completions", _answers_errors(chat)),
        counted("/v1/chat/completions/batch", _answers_errors(batch_chat)),
        counted("/generative_scoring", _answers_errors(score_generatively)),
        counted("/v2/embed", _answers_errors(cohere_embed)),
        counted("/v1/embeddings", _answers_errors(embed)),
        counted("/pooling", _answers_errors(pool)),
        counted("/classify", _answers_errors(classify)),
        # vLLM's score and rerank APIs: its own paths, the /v1 ones it still answers, and
        # /v2/rerank (Cohere's v2 path)
        *(counted(path, _answers_errors(score)) for path in SCORE_PATHS),
        *(counted(path, _answers_errors(rerank)) for path in RERANK_PATHS),
        counted("/v1/responses", _answers_errors(create_response)),
        # Anthropic's Messages API, as vLLM serves it
        counted("/v1/messages", _anthropic_errors(anthropic_messages)),
        counted("/v1/messages/count_tokens", _anthropic_errors(anthropic_count_tokens)),
        Route("/v1/responses/{response_id}", _answers_errors(get_response), methods=["GET"]),
        Route("/v1/responses/{response_id}", _answers_errors(delete_response), methods=["DELETE"]),
        Route(
            "/v1/responses/{response_id}/cancel", _answers_errors(cancel_response), methods=["POST"]
        ),
        Route("/v1/load_lora_adapter", _answers_errors(load_lora), methods=["POST"]),
        Route("/v1/unload_lora_adapter", _answers_errors(unload_lora), methods=["POST"]),
        Route("/tokenize", _answers_errors(tokenize), methods=["POST"]),
        Route("/detokenize", _answers_errors(detokenize), methods=["POST"]),
        Route("/health", health, methods=["GET"]),
        Route("/ping", health, methods=["GET", "POST"]),  # SageMaker's health check
        Route("/invocations", _answers_errors(invocations), methods=["POST"]),
        Route("/v1/models/{model:path}", _answers_errors(model_card), methods=["GET"]),
        Route("/version", version, methods=["GET"]),
        Route("/load", load, methods=["GET"]),
        Route("/tokenizer_info", _answers_errors(get_tokenizer_info), methods=["GET"]),
    ]


def _permission(created: int) -> dict[str, Any]:
    """vLLM's ``ModelPermission`` entry (OpenAI's legacy field; nothing is restricted)."""
    return {
        "id": f"modelperm-{uuid.uuid4().hex}",
        "object": "model_permission",
        "created": created,
        "allow_create_engine": False,
        "allow_sampling": True,
        "allow_logprobs": True,
        "allow_search_indices": False,
        "allow_view": True,
        "allow_fine_tuning": False,
        "organization": "*",
        "group": None,
        "is_blocking": False,
    }
