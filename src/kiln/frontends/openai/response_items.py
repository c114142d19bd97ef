"""The Responses API's output items, written from a chat message: a ``reasoning`` item (a
model with a reasoning parser), a ``message`` with ``output_text`` and ``function_call``
items."""

from __future__ import annotations

import uuid
from typing import Any


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def output_items(
    message: dict[str, Any],
    ids: list[str] | None = None,
    logprobs: list[dict[str, Any]] | None = None,
) -> list[dict[str, Any]]:
    """A chat message as output items: a ``message`` (its text, with ``logprobs``: its
    tokens', chat's entries; there is one even when empty, unless the answer is calls
    only) and one ``function_call`` per tool call."""
    calls = message.get("tool_calls") or []
    fresh = iter(ids) if ids is not None else None

    def next_id(prefix: str) -> str:
        return next(fresh) if fresh is not None else new_id(prefix)

    items: list[dict[str, Any]] = []
    if message.get("reasoning"):  # a thinking model's <think> part, first
        items.append(reasoning_item(next_id("rs"), message["reasoning"], "completed"))
    content = message.get("content")
    if content or not calls:
        items.append(message_item(next_id("msg"), content or "", "completed", logprobs))
    for call in calls:
        items.append(
            call_item(
                next_id("fc"),
                call["id"],
                call["function"]["name"],
                call["function"]["arguments"],
                "completed",
            )
        )
    return items


def reasoning_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    content = [{"type": "reasoning_text", "text": text}] if status == "completed" else []
    return {"type": "reasoning", "id": item_id, "summary": [], "content": content,
            "status": status}  # fmt: skip


def message_item(
    item_id: str, text: str, status: str, logprobs: list[dict[str, Any]] | None = None
) -> dict[str, Any]:
    content = [text_part(text, logprobs)]
    return {
        "type": "message",
        "id": item_id,
        "status": status,
        "role": "assistant",
        "content": content if status == "completed" else [],
    }


def text_part(text: str, logprobs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}


def call_item(item_id: str, call_id: str, name: str, arguments: str, status: str) -> dict[str, Any]:
    return {
        "type": "function_call",
        "id": item_id,
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }
