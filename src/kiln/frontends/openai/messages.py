"""Anthropic's Messages API (``POST /v1/messages``, ``/v1/messages/count_tokens``), as vLLM
serves it: a request becomes a chat completions request, and the chat answer (or stream)
becomes Anthropic's message (or its events), so that the ``anthropic`` client and tools
built on it (an agent pointed at ``ANTHROPIC_BASE_URL``) run against kiln.

The conversion, block by block: ``system`` (a string or text blocks) is the system message;
``text`` blocks are the content; an assistant's ``tool_use`` blocks its ``tool_calls``, a
user's ``tool_result`` blocks ``tool`` messages; ``thinking`` blocks an assistant's
``reasoning``. ``tools`` / ``tool_choice`` (``auto``, ``any``: required, ``tool``: named,
``none``), ``stop_sequences``, ``temperature``, ``top_p``, ``top_k``, ``thinking``
(``enabled``: its ``budget_tokens`` the ``thinking_token_budget``; ``disabled``:
``reasoning_effort: none``) and ``output_config`` (``effort``, a JSON
schema ``format``) map onto chat's. kiln serves text: an ``image`` block is refused.
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import AsyncIterator
from typing import Any

import orjson

from kiln.frontends.openai.chat_input import MAX_MESSAGES
from kiln.frontends.openai.protocol import OpenAIError

log = logging.getLogger(__name__)

#: content blocks in one message (a conversation's bound is chat's ``MAX_MESSAGES``)
MAX_BLOCKS = 4096
#: Anthropic's error ``type`` for an HTTP status
ERROR_TYPES = {
    400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
    404: "not_found_error", 408: "timeout_error", 413: "request_too_large",
    429: "rate_limit_error", 503: "overloaded_error",
}  # fmt: skip
#: vLLM's sampling extras a Messages request may carry too (as extra fields of the client)
_SAMPLING = ("seed", "min_p", "min_tokens", "ignore_eos", "repetition_penalty",
             "presence_penalty", "frequency_penalty", "structured_outputs")  # fmt: skip
_FIELDS = frozenset({
    "model", "messages", "max_tokens", "metadata", "stop_sequences", "stream", "system",
    "temperature", "tool_choice", "tools", "top_k", "top_p", "thinking", "output_config",
    "chat_template_kwargs", "service_tier", "container", "mcp_servers", "context_management",
    "cache_control", "diagnostics", "inference_geo", "speed", "user_profile_id", "workspace_id",
    *_SAMPLING,
})  # fmt: skip
_WARNED: set[str] = set()


def error_body(status: int, message: str) -> dict[str, Any]:
    """Anthropic's error shape."""
    kind = ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def _text(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise OpenAIError(f"{where} must be a string", param=where)
    return value


def _blocks(content: Any, where: str) -> list[dict[str, Any]]:
    """A message's (or ``system``'s) content as a list of blocks, checked."""
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise OpenAIError(f"{where} must be a string or a list of content blocks", param=where)
    if len(content) > MAX_BLOCKS:
        raise OpenAIError(
            f"{where} holds {len(content)} content blocks, more than {MAX_BLOCKS}", param=where
        )
    for j, block in enumerate(content):
        if not isinstance(block, dict) or not isinstance(block.get("type"), str):
            raise OpenAIError(f"{where}[{j}] must be an object with a 'type'", param=where)
    return content


def _system(body: dict[str, Any]) -> list[dict[str, Any]]:
    system = body.get("system")
    if system is None:
        return []
    parts = []
    for j, block in enumerate(_blocks(system, "system")):
        if block["type"] != "text":
            raise OpenAIError(f"system[{j}]: only text blocks", param="system")
        text = _text(block.get("text"), f"system[{j}].text")
        # Claude Code's attribution header: a per-request hash that defeats prefix caching
        if not text.startswith("x-anthropic-billing-header"):
            parts.append(text)
    return [{"role": "system", "content": "".join(parts)}] if parts else []


def _tool_result(block: dict[str, Any], where: str) -> dict[str, Any]:
    content = block.get("content", "")
    if isinstance(content, list):
        texts = []
        for k, item in enumerate(_blocks(content, f"{where}.content")):
            if item["type"] != "text":
                raise OpenAIError(
                    f"{where}.content[{k}]: kiln serves text: a {item['type']!r} block in a "
                    "tool result is not supported",
                    param=f"{where}.content",
                )
            texts.append(_text(item.get("text"), f"{where}.content[{k}].text"))
        content = "\n".join(texts)
    return {
        "role": "tool",
        "tool_call_id": _text(block.get("tool_use_id", ""), f"{where}.tool_use_id"),
        "content": _text(content, f"{where}.content"),
    }


def _message(i: int, message: Any) -> list[dict[str, Any]]:
    """One Anthropic message as chat messages (a user's tool results come first, each its
    own ``tool`` message, as vLLM orders them)."""
    where = f"messages[{i}]"
    if not isinstance(message, dict) or message.get("role") not in ("user", "assistant", "system"):
        raise OpenAIError(
            f"{where} must be an object with a 'role' of 'user' or 'assistant'",
            param=f"{where}.role",
        )
    role = message["role"]
    texts: list[str] = []
    thinking: list[str] = []
    calls: list[dict[str, Any]] = []
    results: list[dict[str, Any]] = []
    for j, block in enumerate(_blocks(message.get("content"), f"{where}.content")):
        at, kind = f"{where}.content[{j}]", block["type"]
        if kind == "text":
            texts.append(_text(block.get("text"), f"{at}.text"))
        elif kind == "thinking":
            thinking.append(_text(block.get("thinking", ""), f"{at}.thinking"))
        elif kind == "redacted_thinking":
            pass  # opaque: accepted so a client may send an answer back as it came
        elif kind == "tool_use" and role == "assistant":
            arguments = block.get("input", {})
            if not isinstance(arguments, dict):
                raise OpenAIError(f"{at}.input must be an object", param=f"{at}.input")
            calls.append({
                "id": _text(block.get("id", f"toolu_{uuid.uuid4().hex[:24]}"), f"{at}.id"),
                "type": "function",
                "function": {"name": _text(block.get("name"), f"{at}.name"),
                             "arguments": json.dumps(arguments)},
            })  # fmt: skip
        elif kind == "tool_result" and role == "user":
            results.append(_tool_result(block, at))
        elif kind in ("image", "document"):
            raise OpenAIError(f"{at}: kiln serves text: {kind} blocks are not supported", param=at)
        else:
            raise OpenAIError(
                f"{at}: a {kind!r} block is not supported in a {role} message", param=at
            )
    out = list(results)
    if role == "system":
        if texts:
            out.append({"role": "system", "content": "".join(texts)})
        return out
    if texts or calls or thinking or not results:
        # several text blocks stay parts, as vLLM passes them: the chat template's content
        # format joins them (with newlines) or iterates over them
        content: Any = "".join(texts)
        if len(texts) > 1:
            content = [{"type": "text", "text": t} for t in texts]
        chat: dict[str, Any] = {"role": role, "content": content}
        if calls:
            chat["tool_calls"] = calls
        if thinking:
            chat["reasoning"] = "".join(thinking)
        out.append(chat)
    return out


def _tools(body: dict[str, Any], chat: dict[str, Any]) -> None:
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list):
            raise OpenAIError("'tools' must be a list", param="tools")
        listed = []
        for i, tool in enumerate(tools):
            if not isinstance(tool, dict):
                raise OpenAIError(f"tools[{i}] must be an object", param=f"tools[{i}]")
            schema = tool.get("input_schema", {"type": "object"})
            if not isinstance(schema, dict):
                raise OpenAIError(f"tools[{i}].input_schema must be an object", param=f"tools[{i}]")
            function = {"name": _text(tool.get("name"), f"tools[{i}].name"),
                        "parameters": {"type": "object", **schema}}  # fmt: skip
            if tool.get("description") is not None:
                function["description"] = _text(tool["description"], f"tools[{i}].description")
            listed.append({"type": "function", "function": function})
        chat["tools"] = listed
        chat["tool_choice"] = "auto"
    choice = body.get("tool_choice")
    if choice is None:
        return
    if not isinstance(choice, dict) or choice.get("type") not in ("auto", "any", "tool", "none"):
        raise OpenAIError(
            "'tool_choice' must be an object with a 'type' of auto, any, tool or none",
            param="tool_choice",
        )
    kind = choice["type"]
    if kind == "tool":
        name = _text(choice.get("name"), "tool_choice.name")
        chat["tool_choice"] = {"type": "function", "function": {"name": name}}
    else:
        chat["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[kind]
    if choice.get("disable_parallel_tool_use") is True:
        chat["parallel_tool_calls"] = False


def _thinking(body: dict[str, Any], chat: dict[str, Any]) -> None:
    thinking = body.get("thinking")
    if thinking is not None:
        if not isinstance(thinking, dict) or thinking.get("type") not in (
            "enabled", "disabled", "adaptive"
        ):  # fmt: skip
            raise OpenAIError(
                "'thinking' must be an object with a 'type' of enabled, disabled or adaptive",
                param="thinking",
            )
        if thinking["type"] == "enabled":
            budget = thinking.get("budget_tokens")
            if type(budget) is not int or budget < 1024:
                raise OpenAIError(
                    "thinking.budget_tokens must be an integer of at least 1024",
                    param="thinking.budget_tokens",
                )
            limit = body.get("max_tokens")
            if type(limit) is int and budget >= limit:
                raise OpenAIError(
                    "thinking.budget_tokens must be less than max_tokens",
                    param="thinking.budget_tokens",
                )
            chat["thinking_token_budget"] = budget  # as vLLM: needs --reasoning-parser
        elif thinking["type"] == "disabled":
            chat["reasoning_effort"] = "none"
    config = body.get("output_config")
    if config is None:
        return
    if not isinstance(config, dict):
        raise OpenAIError("'output_config' must be an object", param="output_config")
    if config.get("effort") is not None:
        chat["reasoning_effort"] = config["effort"]
    form = config.get("format")
    if form is not None:
        if not isinstance(form, dict) or form.get("type") != "json_schema":
            raise OpenAIError(
                "output_config.format must be {'type': 'json_schema', 'schema': {...}}",
                param="output_config.format",
            )
        schema = form.get("schema")
        if not isinstance(schema, dict):
            raise OpenAIError(
                "output_config.format.schema must be an object",
                param="output_config.format.schema",
            )
        chat["response_format"] = {
            "type": "json_schema", "json_schema": {"name": "json_schema", "schema": schema}
        }  # fmt: skip


def chat_body(body: dict[str, Any], count_only: bool = False) -> dict[str, Any]:
    """A Messages request as a chat completions request (``count_only``: count_tokens',
    which has no ``max_tokens``)."""
    for key in body:
        if key not in _FIELDS and key not in _WARNED and len(_WARNED) < 256:
            _WARNED.add(key)
            log.warning("Messages request: field %r is unknown to kiln: ignored", key[:100])
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise OpenAIError("'messages' must be a non-empty list", param="messages")
    if len(messages) > MAX_MESSAGES:  # before any is converted
        raise OpenAIError(
            f"'messages' holds {len(messages)} messages, more than {MAX_MESSAGES}",
            param="messages",
        )
    chat_messages = _system(body)
    for i, message in enumerate(messages):
        chat_messages += _message(i, message)
    chat: dict[str, Any] = {"model": body.get("model"), "messages": chat_messages}
    if body.get("chat_template_kwargs") is not None:
        chat["chat_template_kwargs"] = body["chat_template_kwargs"]
    _tools(body, chat)
    _thinking(body, chat)
    if count_only:
        return chat
    limit = body.get("max_tokens")
    if type(limit) is not int or limit < 1:
        raise OpenAIError("'max_tokens' is required: a positive integer", param="max_tokens")
    chat["max_tokens"] = limit
    # Anthropic's sampling fields (the 2.x client sends them as extra fields), and vLLM's
    # sampling extras beside them (chat checks each)
    for key in ("temperature", "top_p", "top_k", *_SAMPLING):
        if body.get(key) is not None:
            chat[key] = body[key]
    stops = body.get("stop_sequences")
    if stops is not None:
        if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
            raise OpenAIError("'stop_sequences' must be a list of strings", param="stop_sequences")
        chat["stop"] = stops
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise OpenAIError("'stream' must be true or false", param="stream")
    if stream:
        chat["stream"] = True
        chat["stream_options"] = {"include_usage": True}
    return chat


def _usage(usage: dict[str, Any] | None) -> dict[str, int]:
    """Anthropic's usage: ``input_tokens`` not counting the ones read from the cache."""
    if usage is None:
        return {"input_tokens": 0, "output_tokens": 0}
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    out = {"input_tokens": max(0, usage.get("prompt_tokens", 0) - cached),
           "output_tokens": usage.get("completion_tokens") or 0}  # fmt: skip
    if cached:
        out["cache_read_input_tokens"] = cached
    return out


def _stop(finish: str | None, stopped_by: Any, called: bool) -> tuple[str | None, str | None]:
    """Anthropic's ``(stop_reason, stop_sequence)`` for a chat choice's finish."""
    if finish == "length":
        return "max_tokens", None
    if called or finish == "tool_calls":
        return "tool_use", None
    if isinstance(stopped_by, str):
        return "stop_sequence", stopped_by
    return "end_turn", None


def message(answer: dict[str, Any], rid: str) -> dict[str, Any]:
    """A chat completion answer as Anthropic's message."""
    choice = answer["choices"][0]
    said = choice["message"]
    content: list[dict[str, Any]] = []
    if said.get("reasoning"):
        content.append(
            {"type": "thinking", "thinking": said["reasoning"], "signature": uuid.uuid4().hex}
        )
    if said.get("content"):
        content.append({"type": "text", "text": said["content"]})
    calls = said.get("tool_calls") or []
    for call in calls:
        function = call["function"]
        try:
            arguments = json.loads(function["arguments"] or "{}")
        except ValueError:
            arguments = {}
        content.append(
            {"type": "tool_use", "id": call["id"], "name": function["name"], "input": arguments}
        )
    if not content:  # Anthropic's empty answer: one empty text block
        content.append({"type": "text", "text": ""})
    reason, sequence = _stop(choice.get("finish_reason"), choice.get("stop_reason"), bool(calls))
    return {
        "id": rid, "type": "message", "role": "assistant", "content": content,
        "model": answer["model"], "stop_reason": reason, "stop_sequence": sequence,
        "usage": _usage(answer.get("usage")),
    }  # fmt: skip


def _event(kind: str, data: dict[str, Any]) -> bytes:
    return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps({"type": kind, **data}) + b"\n\n"


class _Blocks:
    """The content block being streamed (Anthropic's blocks open, fill and close in turn)."""

    def __init__(self) -> None:
        self.index = -1
        self.kind: str | None = None
        self.tool_id: str | None = None

    def close(self) -> list[bytes]:
        if self.kind is None:
            return []
        out = []
        if self.kind == "thinking":  # the signature a client sends back with the block
            delta = {"type": "signature_delta", "signature": uuid.uuid4().hex}
            out.append(_event("content_block_delta", {"index": self.index, "delta": delta}))
        out.append(_event("content_block_stop", {"index": self.index}))
        self.kind, self.tool_id = None, None
        return out

    def open(self, block: dict[str, Any]) -> list[bytes]:
        out = self.close()
        self.index += 1
        self.kind, self.tool_id = block["type"], block.get("id")
        out.append(_event("content_block_start", {"index": self.index, "content_block": block}))
        return out

    def delta(self, delta: dict[str, Any]) -> bytes:
        return _event("content_block_delta", {"index": self.index, "delta": delta})


async def events(
    chunks: AsyncIterator[bytes], rid: str, model: str, prompt_tokens: int
) -> AsyncIterator[bytes]:
    """A chat completions stream (``data: {chunk}`` events, then ``data: [DONE]``) as
    Anthropic's events: message_start, the content blocks' start / delta / stop,
    message_delta (the stop reason and usage), message_stop."""
    try:
        async for event in _events(chunks, rid, model, prompt_tokens):
            yield event
    finally:  # the chat stream ends with these events: its engine requests with it
        close = getattr(chunks, "aclose", None)
        if close is not None:
            await close()


async def _events(
    chunks: AsyncIterator[bytes], rid: str, model: str, prompt_tokens: int
) -> AsyncIterator[bytes]:
    blocks = _Blocks()
    start: dict[str, Any] = {
        "id": rid, "type": "message", "role": "assistant", "content": [], "model": model,
        "stop_reason": None, "stop_sequence": None,
        "usage": {"input_tokens": prompt_tokens, "output_tokens": 0},
    }  # fmt: skip
    yield _event("message_start", {"message": start})
    finish: str | None = None
    stopped_by: Any = None
    called = False
    calls: dict[int, str] = {}  # a tool call's index -> its block's id
    async for raw in chunks:
        if raw.startswith(b":"):  # an SSE comment (--sse-keep-alive-interval): Anthropic's ping
            yield _event("ping", {})
            continue
        text = raw.removeprefix(b"data: ").strip()
        if text == b"[DONE]":
            for out in blocks.close():
                yield out
            yield _event("message_stop", {})
            return
        chunk = orjson.loads(text)
        if "error" in chunk:
            error = chunk["error"]
            yield _event("error", {"error": {"type": "api_error", "message": error["message"]}})
            return
        if not chunk.get("choices"):  # the usage chunk, after the last choice's
            for out in blocks.close():
                yield out
            reason, sequence = _stop(finish, stopped_by, called)
            ended = {"stop_reason": reason, "stop_sequence": sequence}
            yield _event("message_delta", {"delta": ended, "usage": _usage(chunk.get("usage"))})
            continue
        choice = chunk["choices"][0]
        if choice.get("finish_reason") is not None:
            finish, stopped_by = choice["finish_reason"], choice.get("stop_reason")
        delta: dict[str, Any] = choice.get("delta") or {}
        if delta.get("reasoning"):
            if blocks.kind != "thinking":
                for out in blocks.open({"type": "thinking", "thinking": ""}):
                    yield out
            yield blocks.delta({"type": "thinking_delta", "thinking": delta["reasoning"]})
        if delta.get("content"):
            if blocks.kind != "text":
                for out in blocks.open({"type": "text", "text": ""}):
                    yield out
            yield blocks.delta({"type": "text_delta", "text": delta["content"]})
        for call in delta.get("tool_calls") or ():
            function = call.get("function") or {}
            if call.get("id") is not None and function.get("name") is not None:
                calls[call["index"]] = call["id"]
                called = True
                block = {"type": "tool_use", "id": call["id"], "name": function["name"],
                         "input": {}}  # fmt: skip
                for out in blocks.open(block):
                    yield out
            arguments = function.get("arguments")
            if arguments and blocks.tool_id == calls.get(call["index"]):
                yield blocks.delta({"type": "input_json_delta", "partial_json": arguments})
