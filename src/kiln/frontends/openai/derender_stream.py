"""vLLM's streamed derender (``stream: true`` on ``/v1/chat/completions/derender`` and
``/v1/completions/derender``): one ``/inference/v1/generate`` stream chunk per call, turned
into the chat (completions) stream chunk it is, with the decoding state the client carries
to the next call (vLLM's ``DerenderStreamState``): nothing is kept on the server. And the
derender routes, whole or streamed."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from kiln.frontends.openai.derender import (
    choices_of,
    derender_chat,
    derender_completion,
    prompt_tokens,
    token_ids,
    usage,
)
from kiln.frontends.openai.derender import prompt_ids as seed_ids
from kiln.frontends.openai.derender_parse import ROLE, ChatParsing, chat_parsing, original, replayed
from kiln.frontends.openai.endpoint import BodyReader, json_response, model_for, read_json
from kiln.frontends.openai.logprobs import CompletionLogprobs, chat_logprobs
from kiln.frontends.openai.protocol import OpenAIError, flag
from kiln.llm.engine_client import EngineClient
from kiln.llm.tokenizer import seed_window
from kiln.server.server import Server

#: the decoding window a stream state carries (vLLM's bound on ``prev_tokens``)
MAX_WINDOW = 1024
#: the digits of a token id in the window
_MAX_DIGITS = 10
#: vLLM's bound on ``logprob_context_token_ids`` (the tokens its logprobs look back on)
MAX_LOGPROB_CONTEXT = 4
#: a tool call's id in ``last_tool_call_ids`` (kiln's are 46 characters, Mistral's 9)
MAX_CALL_ID = 128


def _error(message: str, param: str) -> OpenAIError:
    return OpenAIError(message, param=param)


def _flag(value: dict[str, Any], key: str) -> bool:
    found = value.get(key, False)
    if not isinstance(found, bool):
        raise _error(f"'stream_state.{key}' must be a boolean", f"stream_state.{key}")
    return found


def _window(llm: EngineClient, value: dict[str, Any], state: dict[str, Any]) -> None:
    """The plain path's decoding window: kiln's ``prev_tokens`` are token ids, as decimal
    strings (vLLM's hold token pieces), with its two offsets."""
    window = value.get("prev_tokens", [])
    where = "stream_state.prev_tokens"
    if not isinstance(window, list) or len(window) > MAX_WINDOW:
        raise _error(f"'{where}' must be a list of at most {MAX_WINDOW} tokens", where)
    for t in window:
        if not (isinstance(t, str) and 0 < len(t) <= _MAX_DIGITS and t.isascii()
                and t.isdigit() and int(t) < llm.vocab_size):  # fmt: skip
            raise _error(f"'{where}' must hold the token ids kiln answered", where)
    state["prev_tokens"] = [int(t) for t in window]
    for key, top in (("prefix_offset", len(window)), ("read_offset", len(window)),
                     ("logprob_text_offset", 1 << 40)):  # fmt: skip
        number = value.get(key, 0)
        if type(number) is not int or not 0 <= number <= top:
            raise _error(f"'stream_state.{key}' must be an integer in [0, {top}]",
                         f"stream_state.{key}")  # fmt: skip
        state[key] = number
    if state["prefix_offset"] > state["read_offset"]:
        raise _error("'stream_state.prefix_offset' is past its read_offset",
                     "stream_state.prefix_offset")  # fmt: skip
    context = value.get("logprob_context_token_ids", [])
    where = "stream_state.logprob_context_token_ids"
    if not isinstance(context, list) or len(context) > MAX_LOGPROB_CONTEXT:
        raise _error(f"'{where}' must be a list of at most {MAX_LOGPROB_CONTEXT} token ids",
                     where)  # fmt: skip
    token_ids(context, where, llm.vocab_size, MAX_LOGPROB_CONTEXT, empty=True)


def _history(llm: EngineClient, value: dict[str, Any], state: dict[str, Any]) -> None:
    """The parser path's replay: the output so far, its chunks' sizes (each counted, their
    sum the output's length) and the ids of the tool calls it began."""
    limit = llm.max_model_len
    where = "stream_state.output_token_ids"
    ids = token_ids(value.get("output_token_ids", []), where, llm.vocab_size, limit, empty=True)
    lens = value.get("output_chunk_lens", [])
    where = "stream_state.output_chunk_lens"
    if not isinstance(lens, list) or len(lens) > len(ids):
        raise _error(f"'{where}' must be a list of at most one size per output token", where)
    if not all(type(n) is int and 0 < n <= len(ids) for n in lens) or sum(lens) != len(ids):
        raise _error(
            f"'{where}' must be positive sizes that sum to len(output_token_ids) ({len(ids)})",
            where,
        )
    calls = value.get("last_tool_call_ids", [])
    where = "stream_state.last_tool_call_ids"
    if not isinstance(calls, list) or len(calls) > len(ids):
        raise _error(f"'{where}' must be a list of at most one id per output token", where)
    if not all(isinstance(c, str) and 0 < len(c) <= MAX_CALL_ID for c in calls):
        raise _error(f"'{where}' must hold ids of at most {MAX_CALL_ID} characters", where)
    state.update(output_token_ids=ids, output_chunk_lens=lens, last_tool_call_ids=calls)


def read_state(llm: EngineClient, value: Any) -> dict[str, Any] | None:
    """The client-carried ``stream_state``, checked (None: the stream's first call)."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise _error("'stream_state' must be the object the last call answered", "stream_state")
    state: dict[str, Any] = {"role_sent": _flag(value, "role_sent"),
                             "tools_streamed": _flag(value, "tools_streamed")}  # fmt: skip
    _window(llm, value, state)
    _history(llm, value, state)
    return state


def first_state(prompt: list[int]) -> dict[str, Any]:
    """A stream's state before its first chunk: the window seeded with the prompt's last
    tokens (vLLM's), nothing replayed yet."""
    window, prefix, read = seed_window(prompt)
    return {"prev_tokens": window, "prefix_offset": prefix, "read_offset": read,
            "role_sent": False, "tools_streamed": False, "logprob_text_offset": 0,
            "output_token_ids": [], "output_chunk_lens": [],
            "last_tool_call_ids": []}  # fmt: skip


def decode_delta(
    llm: EngineClient, ids: list[int], state: dict[str, Any], skip: bool, final: bool = False
) -> str:
    """The text ``ids`` add after the state's window (incremental detokenization, as
    vLLM's: a token that ends inside a character waits for the next one, unless the choice
    ends: ``final``, as chat and completions release it), the state moved on and its
    window trimmed to what the next token still needs."""
    window, prefix, read = state["prev_tokens"], state["prefix_offset"], state["read_offset"]
    decode = llm.tokenizer.decode
    parts = []
    for i, token in enumerate(ids):
        window.append(token)
        before = decode(window[prefix:read], skip)
        text = decode(window[prefix:], skip)
        last = final and i == len(ids) - 1
        if len(text) > len(before) and (last or not text.endswith("\ufffd")):
            parts.append(text[len(before) :])
            prefix, read = read, len(window)
        window, read, prefix = window[prefix:], read - prefix, 0
    state.update(prev_tokens=window, prefix_offset=prefix, read_offset=read)
    return "".join(parts)


def _wire_state(state: dict[str, Any]) -> dict[str, Any]:
    """vLLM's ``DerenderStreamState`` fields."""
    return {
        "prev_tokens": [str(t) for t in state["prev_tokens"]],
        "prefix_offset": state["prefix_offset"],
        "read_offset": state["read_offset"],
        "role_sent": state["role_sent"],
        "logprob_context_token_ids": [],
        "logprob_text_offset": state["logprob_text_offset"],
        "output_token_ids": state["output_token_ids"],
        "output_chunk_lens": state["output_chunk_lens"],
        "tools_streamed": state["tools_streamed"],
        "last_tool_call_ids": state["last_tool_call_ids"],
    }


def _parts(
    llm: EngineClient, body: dict[str, Any]
) -> tuple[str, list[dict[str, Any]], dict[str, Any], dict[str, Any] | None]:
    """A call's chunk id, its choice (at most one, as vLLM), the state (seeded with the
    prompt on the first call) and the chunk's usage (the caller's prompt count)."""
    chunk = body.get("generate_chunk")
    if not isinstance(chunk, dict):
        raise _error("'generate_chunk' must be a generate stream chunk", "generate_chunk")
    choices = choices_of(llm, chunk, "generate_chunk", chunk=True)
    if len(choices) > 1:
        raise _error(f"a streamed derender takes one choice per chunk (got {len(choices)})",
                     "generate_chunk.choices")  # fmt: skip
    prompt = seed_ids(llm, body.get("prompt_token_ids"), chunk, "prompt_token_ids",
                      "generate_chunk.prompt_token_ids")  # fmt: skip
    state = read_state(llm, body.get("stream_state"))
    if state is None:
        state = first_state(prompt)
    state["prompt"] = prompt
    # vLLM's: the prompt, the output so far and this chunk's tokens fit the context
    total = len(prompt) + len(state["output_token_ids"])
    total += sum(len(c["token_ids"]) for c in choices)
    if total > llm.max_model_len:
        raise _error(
            f"prompt_token_ids, stream_state.output_token_ids and the chunk's tokens hold "
            f"{total} tokens, more than the model's context ({llm.max_model_len})",
            "stream_state.output_token_ids",
        )
    counted = chunk.get("usage")
    if counted is not None:
        if not isinstance(counted, dict):
            raise _error("'generate_chunk.usage' must be an object", "generate_chunk.usage")
        given = body.get("prompt_tokens")
        count = prompt_tokens(given if given is not None else counted.get("prompt_tokens"),
                              "prompt_tokens")  # fmt: skip
        completion = prompt_tokens(counted.get("completion_tokens"), "generate_chunk.usage")
        counted = usage(count, completion)
    return str(chunk.get("request_id", ""))[:1024], choices, state, counted


def _parsed_delta(
    llm: EngineClient, parsing: ChatParsing, c: dict[str, Any], state: dict[str, Any]
) -> tuple[dict[str, Any], str | None]:
    """The parser path (vLLM's ``_derender_chat_stream_parsed``): the earlier chunks
    replayed, then this one's delta; the state carries the output on."""
    history, lens = state["output_token_ids"], state["output_chunk_lens"]
    stream, detok = replayed(llm, parsing, state["prompt"], history, lens,
                             state["last_tool_call_ids"])  # fmt: skip
    ids, reason = c["token_ids"], c["finish_reason"]
    text = detok.add(ids, final=reason is not None) if ids else ""
    delta, reason = stream.feed(text, reason)
    if ids:
        state.update(output_token_ids=history + ids, output_chunk_lens=[*lens, len(ids)])
    if stream.calls is not None:
        state.update(tools_streamed=stream.calls.called, last_tool_call_ids=stream.calls.ids)
    return delta, reason


def derender_chat_chunk(llm: EngineClient, body: dict[str, Any], model: str) -> dict[str, Any]:
    """vLLM's ``DerenderChatStreamResponse``: one ``chat.completion.chunk`` (the role in
    the first one with a choice) and the state for the next call; with a tool or
    reasoning parser, its delta as chat's stream reads it. On a worker thread."""
    parsing = chat_parsing(llm, body, stream=True)
    rid, choices, state, counted = _parts(llm, body)
    out = []
    for c in choices:
        reason = c["finish_reason"]
        if parsing.active:
            delta, reason = _parsed_delta(llm, parsing, c, state)
        else:
            final = reason is not None
            text = decode_delta(llm, c["token_ids"], state, parsing.skip_special_tokens, final)
            delta = {"content": text or None}
        delta = {"role": None if state["role_sent"] else ROLE, **delta}
        state["role_sent"] = True
        entries = c["logprobs"]
        out.append(
            {
                "index": c["index"],
                "delta": delta,
                "logprobs": None if entries is None else chat_logprobs(llm.tokenizer, entries),
                "finish_reason": reason,
                "stop_reason": c["stop_reason"],
            }
        )
    chunk = {"id": rid, "object": "chat.completion.chunk", "created": int(time.time()),
             "model": model, "choices": out, "usage": counted}  # fmt: skip
    return {"chunk": chunk, "stream_state": _wire_state(state)}


def derender_completion_chunk(
    llm: EngineClient, body: dict[str, Any], model: str
) -> dict[str, Any]:
    """vLLM's ``DerenderCompletionStreamResponse``: one ``text_completion`` chunk and the
    state for the next call (logprobs' ``text_offset`` carried on). On a worker thread."""
    skip = flag(original(body, "completion_request"), "skip_special_tokens", True)
    rid, choices, state, counted = _parts(llm, body)
    out = []
    for c in choices:
        final = c["finish_reason"] is not None
        text = decode_delta(llm, c["token_ids"], state, skip, final)
        entries, offset = c["logprobs"], state["logprob_text_offset"]
        logprobs = None
        if entries is not None:
            logprobs = CompletionLogprobs(llm.tokenizer, offset)(entries)
        state["logprob_text_offset"] = offset + len(text)
        reasons = {"finish_reason": c["finish_reason"], "stop_reason": c["stop_reason"]}
        out.append({"index": c["index"], "text": text, "logprobs": logprobs, **reasons})
    chunk = {"id": rid, "object": "text_completion", "created": int(time.time()),
             "model": model, "choices": out, "usage": counted}  # fmt: skip
    return {"chunk": chunk, "stream_state": _wire_state(state)}


class DerenderRoutes:
    """``reader``: the HTTP frontend whose body limits apply."""

    def __init__(self, server: Server, reader: BodyReader) -> None:
        self.server, self.reader = server, reader

    async def chat(self, request: Request) -> Response:
        body = await read_json(request, self.reader)
        llm = model_for(self.server, body)
        model = body.get("model") or llm.model_name
        work = derender_chat_chunk if flag(body, "stream", False) else derender_chat
        return json_response(await asyncio.to_thread(work, llm, body, model))

    async def completions(self, request: Request) -> Response:
        body = await read_json(request, self.reader)
        llm = model_for(self.server, body)
        model = body.get("model") or llm.model_name
        work = derender_completion_chunk if flag(body, "stream", False) else derender_completion
        return json_response(await asyncio.to_thread(work, llm, body, model))
