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
    check_common,
    choices_of,
    derender_chat,
    derender_completion,
    original,
    prompt_tokens,
    usage,
)
from kiln.frontends.openai.endpoint import BodyReader, json_response, model_for, read_json
from kiln.frontends.openai.logprobs import CompletionLogprobs, chat_logprobs
from kiln.frontends.openai.protocol import OpenAIError, flag
from kiln.llm.engine_client import EngineClient
from kiln.server.server import Server

#: the decoding window a stream state carries (vLLM's bound on ``prev_tokens``)
MAX_WINDOW = 1024
#: the digits of a token id in the window
_MAX_DIGITS = 10


def _error(message: str, param: str) -> OpenAIError:
    return OpenAIError(message, param=param)


def read_state(llm: EngineClient, value: Any) -> dict[str, Any]:
    """The client-carried ``stream_state``, checked. kiln's ``prev_tokens`` are its
    decoding window: token ids, as decimal strings (vLLM's hold token pieces)."""
    state: dict[str, Any] = {"prev_tokens": [], "prefix_offset": 0, "read_offset": 0,
                             "role_sent": False, "logprob_text_offset": 0}  # fmt: skip
    if value is None:
        return state
    if not isinstance(value, dict):
        raise _error("'stream_state' must be the object the last call answered", "stream_state")
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
    state["role_sent"] = value.get("role_sent") is True
    return state


def decode_delta(llm: EngineClient, ids: list[int], state: dict[str, Any], skip: bool) -> str:
    """The text ``ids`` add after the state's window (incremental detokenization, as
    vLLM's: a token that ends inside a character waits for the next one), the state moved
    on and its window trimmed to what the next token still needs."""
    window, prefix, read = state["prev_tokens"], state["prefix_offset"], state["read_offset"]
    decode = llm.tokenizer.decode
    parts = []
    for token in ids:
        window.append(token)
        before = decode(window[prefix:read], skip)
        text = decode(window[prefix:], skip)
        if len(text) > len(before) and not text.endswith("\ufffd"):
            parts.append(text[len(before) :])
            prefix, read = read, len(window)
        window, read, prefix = window[prefix:], read - prefix, 0
    state.update(prev_tokens=window, prefix_offset=prefix, read_offset=read)
    return "".join(parts)


def _wire_state(state: dict[str, Any]) -> dict[str, Any]:
    """vLLM's ``DerenderStreamState`` fields (the parser path's stay empty: kiln's derender
    runs no tool parser)."""
    return {
        "prev_tokens": [str(t) for t in state["prev_tokens"]],
        "prefix_offset": state["prefix_offset"],
        "read_offset": state["read_offset"],
        "role_sent": state["role_sent"],
        "logprob_context_token_ids": [],
        "logprob_text_offset": state["logprob_text_offset"],
        "output_token_ids": [],
        "output_chunk_lens": [],
        "tools_streamed": False,
        "last_tool_call_ids": [],
    }


def _parts(
    llm: EngineClient, body: dict[str, Any], key: str
) -> tuple[str, list[dict[str, Any]], dict[str, Any], bool, dict[str, Any] | None]:
    """A call's chunk id, its choice (at most one, as vLLM), the state, the original
    request's ``skip_special_tokens`` and the chunk's usage (the caller's prompt count)."""
    check_common(llm, body)
    skip = flag(original(body, key), "skip_special_tokens", True)
    chunk = body.get("generate_chunk")
    if not isinstance(chunk, dict):
        raise _error("'generate_chunk' must be a generate stream chunk", "generate_chunk")
    choices = choices_of(llm, chunk, "generate_chunk", chunk=True)
    if len(choices) > 1:
        raise _error(f"a streamed derender takes one choice per chunk (got {len(choices)})",
                     "generate_chunk.choices")  # fmt: skip
    state = read_state(llm, body.get("stream_state"))
    counted = chunk.get("usage")
    if counted is not None:
        if not isinstance(counted, dict):
            raise _error("'generate_chunk.usage' must be an object", "generate_chunk.usage")
        given = body.get("prompt_tokens")
        prompt = prompt_tokens(given if given is not None else counted.get("prompt_tokens"),
                               "prompt_tokens")  # fmt: skip
        completion = prompt_tokens(counted.get("completion_tokens"), "generate_chunk.usage")
        counted = usage(prompt, completion)
    return str(chunk.get("request_id", ""))[:1024], choices, state, skip, counted


def derender_chat_chunk(llm: EngineClient, body: dict[str, Any], model: str) -> dict[str, Any]:
    """vLLM's ``DerenderChatStreamResponse``: one ``chat.completion.chunk`` (the role in
    the first one with a choice) and the state for the next call. On a worker thread."""
    rid, choices, state, skip, counted = _parts(llm, body, "chat_request")
    out = []
    for c in choices:
        text = decode_delta(llm, c["token_ids"], state, skip)
        role = None if state["role_sent"] else "assistant"
        state["role_sent"] = True
        entries = c["logprobs"]
        out.append(
            {
                "index": c["index"],
                "delta": {"role": role, "content": text or None},
                "logprobs": None if entries is None else chat_logprobs(llm.tokenizer, entries),
                "finish_reason": c["finish_reason"],
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
    rid, choices, state, skip, counted = _parts(llm, body, "completion_request")
    out = []
    for c in choices:
        text = decode_delta(llm, c["token_ids"], state, skip)
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
