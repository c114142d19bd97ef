"""The Responses API's stream: its typed events (``response.created`` ...
``response.completed``) as a generation produces them, and the feed that keeps a streamed
background response's events for ``GET /v1/responses/{id}?stream=true``."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

import orjson

from kiln.core.errors import KilnError
from kiln.frontends.openai.protocol import OpenAIError
from kiln.frontends.openai.response_items import (
    call_item,
    message_item,
    new_id,
    reasoning_item,
    text_part,
)

if TYPE_CHECKING:
    from kiln.frontends.openai.generation import Delta
    from kiln.frontends.openai.generation_request import GenerationRequest
    from kiln.frontends.openai.response_store import ResponseStore
    from kiln.frontends.openai.responses import ResponsesCall
    from kiln.llm.sampler import TokenLogprobs


class EventFeed:
    """A streamed background response's events as its run produces them: read from the
    start by the request that created it, and from any ``starting_after`` by
    ``GET /v1/responses/{id}?stream=true`` (an event's index is its ``sequence_number``)."""

    def __init__(self) -> None:
        self._events: list[bytes] = []
        self._more = asyncio.Event()
        self.closed = False

    def append(self, event: bytes) -> None:
        self._events.append(event)
        self._more.set()

    def close(self) -> None:
        self.closed = True
        self._more.set()

    async def read(self, after: int = -1) -> AsyncIterator[bytes]:
        at = max(after + 1, 0)
        while True:
            while at < len(self._events):
                yield self._events[at]
                at += 1
            if self.closed:
                return
            self._more.clear()
            if at < len(self._events) or self.closed:
                continue
            await self._more.wait()


async def events(
    call: ResponsesCall,
    rid: str,
    req: GenerationRequest,
    deltas: AsyncIterator[Delta],
    prompt_tokens: int,
    stored: ResponseStore,
    logprobs: Callable[[list[TokenLogprobs]], list[dict[str, Any]]] | None = None,
) -> AsyncGenerator[bytes, None]:
    """The Responses API's stream: typed events, each with its ``sequence_number``.
    ``logprobs`` (when the request asked for them) turns a delta's token logprobs into
    the answer's entries: each text delta carries those of the tokens it releases (and of
    any a parser held back before it), the done events all of them."""
    numbers = itertools.count()

    def event(kind: str, **fields: Any) -> bytes:
        data = {"type": kind, "sequence_number": next(numbers), **fields}
        return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"

    start = call.skeleton(rid, req.model, "in_progress")
    yield event("response.created", response=start)
    yield event("response.in_progress", response=start)
    reader = req.tools.stream() if req.tools is not None else None
    thinking = req.reasoning.stream() if req.reasoning is not None else None
    ids: list[str] = []  # every output item's, in order
    thought = ""
    thought_at: int | None = None  # the reasoning item's output index while it is open
    text = ""
    message_at: int | None = None  # the message item's output index, once it is open
    calls: list[dict[str, Any]] = []  # chat tool calls: id, function name and arguments
    call_at: list[int] = []
    reason: str | None = None
    tokens = cached = 0
    scored: list[dict[str, Any]] = []  # every token's logprobs, and those not yet sent
    unsent: list[dict[str, Any]] = []

    def close_thought() -> list[bytes]:
        nonlocal thought_at
        if thought_at is None:
            return []
        at, thought_at = thought_at, None
        return [
            event("response.reasoning_text.done", item_id=ids[at], output_index=at,
                  content_index=0, text=thought),
            event("response.output_item.done", output_index=at,
                  item=reasoning_item(ids[at], thought, "completed")),
        ]  # fmt: skip

    def open_message() -> list[bytes]:
        nonlocal message_at
        message_at = len(ids)
        ids.append(new_id("msg"))
        item = message_item(ids[message_at], "", "in_progress")
        part = text_part("")
        return [
            event("response.output_item.added", output_index=message_at, item=item),
            event("response.content_part.added", item_id=ids[message_at],
                  output_index=message_at, content_index=0, part=part),
        ]  # fmt: skip

    def close_message() -> list[bytes]:
        assert message_at is not None
        item_id = ids[message_at]
        part = text_part(text, scored)
        return [
            event("response.output_text.done", item_id=item_id, output_index=message_at,
                  content_index=0, text=text, logprobs=scored),
            event("response.content_part.done", item_id=item_id, output_index=message_at,
                  content_index=0, part=part),
            event("response.output_item.done", output_index=message_at,
                  item=message_item(item_id, text, "completed", scored)),
        ]  # fmt: skip

    try:
        async for d in deltas:
            tokens, cached = d.completion_tokens, d.cached_tokens
            reason = d.finish_reason or reason
            piece, found = d.text, list[dict[str, Any]]()
            last = d.finish_reason is not None
            if logprobs is not None and d.logprobs:
                entries = logprobs(d.logprobs)
                scored += entries
                unsent += entries
            if thinking is not None:
                more, piece = thinking.feed(piece, final=last)
                if more and req.include_reasoning:
                    if thought_at is None and not thought:
                        thought_at = len(ids)
                        ids.append(new_id("rs"))
                        item = reasoning_item(ids[-1], "", "in_progress")
                        yield event("response.output_item.added", output_index=thought_at,
                                    item=item)  # fmt: skip
                    thought += more
                    yield event("response.reasoning_text.delta", item_id=ids[thought_at],  # type: ignore[index]
                                output_index=thought_at, content_index=0, delta=more)  # fmt: skip
            if reader is not None:
                piece, found = reader.feed(piece, final=last)
            if (piece or found) and thought_at is not None:
                for out in close_thought():
                    yield out
            if piece:
                if message_at is None:
                    for out in open_message():
                        yield out
                text += piece
                yield event("response.output_text.delta", item_id=ids[message_at],  # type: ignore[index]
                            output_index=message_at, content_index=0, delta=piece,
                            logprobs=unsent)  # fmt: skip
                unsent = []
            for part in found:
                if "id" in part:  # a new call: its name is known
                    calls.append({"id": part["id"], "type": "function",
                                  "function": {"name": part["function"]["name"],
                                               "arguments": ""}})  # fmt: skip
                    call_at.append(len(ids))
                    ids.append(new_id("fc"))
                    item = call_item(ids[-1], part["id"], part["function"]["name"], "",
                                      "in_progress")  # fmt: skip
                    yield event("response.output_item.added", output_index=call_at[-1], item=item)
                arguments = part["function"].get("arguments") or ""
                if arguments:
                    index = part["index"]
                    calls[index]["function"]["arguments"] += arguments
                    yield event("response.function_call_arguments.delta",
                                item_id=ids[call_at[index]], output_index=call_at[index],
                                delta=arguments)  # fmt: skip
    except KilnError as exc:
        err = OpenAIError.from_kiln(exc)
        yield event("error", code=err.code or err.type, message=err.message, param=err.param)
        return
    for out in close_thought():
        yield out
    if message_at is None and not calls:
        for out in open_message():
            yield out
    if message_at is not None:
        for out in close_message():
            yield out
    for index, c in enumerate(calls):
        at, name, arguments = call_at[index], c["function"]["name"], c["function"]["arguments"]
        yield event("response.function_call_arguments.done", item_id=ids[at], output_index=at,
                    name=name, arguments=arguments)  # fmt: skip
        yield event("response.output_item.done", output_index=at,
                    item=call_item(ids[at], c["id"], name, arguments, "completed"))  # fmt: skip
    if req.tools is not None and reader is not None:
        reason = req.tools.finish_reason(reader.called, reason)
    message: dict[str, Any] = {"role": "assistant", "content": text or None}
    if thought:
        message["reasoning"] = thought
    if calls:
        message["tool_calls"] = calls
    answer = {
        "model": req.model,
        "choices": [{"message": message, "finish_reason": reason,
                     "logprobs": {"content": scored}}],
        "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": tokens,
                  "total_tokens": prompt_tokens + tokens,
                  "prompt_tokens_details": {"cached_tokens": cached}},
    }  # fmt: skip
    # the items in output order: the message (when there is one) came before any call
    final = call.finish(rid, answer, stored, ids)
    kind = "response.completed" if final["status"] == "completed" else "response.incomplete"
    yield event(kind, response=final)
