"""A generation's answer: the engine's outputs of every choice (``outputs``), gathered into
one completion or chat completion body (``answer_body``), or streamed as Server-Sent Events
(``event_stream``); ``respond`` picks by the request's ``stream``."""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import orjson
from starlette.responses import Response, StreamingResponse

from kiln.core.errors import KilnError
from kiln.frontends.openai import tools
from kiln.frontends.openai.endpoint import json_response
from kiln.frontends.openai.generation import (
    BeamOptions,
    Delta,
    OutputOptions,
    beam_run,
    merged,
    run,
    started,
)
from kiln.frontends.openai.generation_request import GenerationRequest
from kiln.frontends.openai.keep_alive import with_keep_alive
from kiln.frontends.openai.logprobs import (
    CompletionLogprobs,
    chat_logprobs,
    vllm_prompt_logprobs,
)
from kiln.frontends.openai.protocol import OpenAIError
from kiln.frontends.openai.request_ids import request_id
from kiln.llm.engine_client import EngineClient
from kiln.llm.sequence import SamplingParams

if TYPE_CHECKING:  # importing the sampler imports torch
    from kiln.llm.sampler import TokenLogprobs

LogprobsFormat = Callable[[list["TokenLogprobs"]], dict[str, Any]]


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
            # undetokenized (--tokens-only), a delta of tokens is a chunk of "", as vLLM's
            tokens = not req.detokenize and d.token_ids
            if (
                d.text
                or d.finish_reason
                or tokens
                or (echo is not None and d.index in echo.pending)
            ):
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


async def respond(
    llm: EngineClient,
    req: GenerationRequest,
    prepared: list[tuple[list[int], SamplingParams]],
    chat: bool,
) -> Response:
    if not req.stream:
        return json_response(await answer_body(llm, req, prepared, chat))
    events = await event_stream(llm, req, prepared, chat)
    return StreamingResponse(events, media_type="text/event-stream")


async def event_stream(
    llm: EngineClient,
    req: GenerationRequest,
    prepared: list[tuple[list[int], SamplingParams]],
    chat: bool,
) -> AsyncIterator[bytes]:
    """A streamed completion's SSE events, once the first output came (an error before
    it keeps its HTTP status)."""
    rid = f"{'chatcmpl' if chat else 'cmpl'}-{request_id(req.request_id)}"
    deltas = outputs(llm, req, prepared, rid, chat)
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


def outputs(
    llm: EngineClient, req: GenerationRequest, prepared: list[tuple[list[int], SamplingParams]],
    rid: str, chat: bool,
) -> AsyncGenerator[Delta, None]:  # fmt: skip
    """Every choice's deltas, merged (choice ``index`` = prompt ``i`` * ``n`` + sample).
    A whole answer with no stop string to watch for needs no tokens before the last: its
    outputs wait in the engine's collector until the choice ends (vLLM's ``FINAL_ONLY``),
    detokenized once instead of once a step."""
    options = OutputOptions(req.include_stop_str_in_output, req.skip_special_tokens,
                            req.detokenize)  # fmt: skip
    if req.beam_search:
        beams = BeamOptions(req.length_penalty)
        return merged(
            [beam_run(llm, ids, p, req.stop, beams, req.priority, rid, options)
             for ids, p in prepared],
            req.params.n,
        )  # fmt: skip
    if not req.stream and not req.stop:
        prepared = [(ids, replace(p, stream_interval=p.max_tokens)) for ids, p in prepared]
    # vLLM's external ids, which its abort names: a completions prompt's is its own
    # (``cmpl-<id>-<i>``), a chat's the answer's id (a batch's conversation: ``_<i>``)
    aborts = [f"{rid}-{i}" if not chat else rid if len(prepared) == 1 else f"{rid}_{i}"
              for i in range(len(prepared))]  # fmt: skip
    return merged(
        [run(llm, ids, p, req.stop, req.priority, rid, options, abort)
         for (ids, p), abort in zip(prepared, aborts, strict=True)],
        req.params.n,
    )  # fmt: skip


async def answer_body(
    llm: EngineClient,
    req: GenerationRequest,
    prepared: list[tuple[list[int], SamplingParams]],
    chat: bool,
) -> dict[str, Any]:
    """A whole (not streamed) completion or chat completion body."""
    rid = f"{'chatcmpl' if chat else 'cmpl'}-{request_id(req.request_id)}"
    deltas = outputs(llm, req, prepared, rid, chat)
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
