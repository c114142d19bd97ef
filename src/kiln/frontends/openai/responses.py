"""OpenAI's Responses API (``POST /v1/responses``, ``GET`` / ``DELETE
/v1/responses/{id}``), as vLLM serves it (gpt-oss's channels aside).

A request is read into a chat completions body (``instructions`` is the system message,
``input`` items are messages, function calls and their outputs; ``text.format`` is
``response_format``; function tools are chat's) and runs on the chat path: the same
template, tool parsers, structured outputs and sampling fields. Its answer is written back
as output items: a ``reasoning`` item (a model with a reasoning parser), a ``message``
with ``output_text``, and ``function_call`` items. Streamed,
it is the Responses API's typed events (``response.created`` ... ``response.completed``).

``store`` (default true, as OpenAI's) keeps the response, and the conversation it ends, in
memory for ``previous_response_id`` and ``GET``: a bounded store (count and bytes), oldest
out first, so a busy server forgets rather than grows.

Here: one request (:class:`ResponsesCall`), read and answered. Its parts: ``response_fields``
(the fields it reads), ``response_input`` (input items), ``response_items`` (output items),
``response_store`` (stored responses) and ``response_events`` (the stream).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from kiln.frontends.openai import response_fields
from kiln.frontends.openai.protocol import OpenAIError, check_fields, flag
from kiln.frontends.openai.response_fields import HARMLESS, PASSED, RESPONSES_FIELDS
from kiln.frontends.openai.response_input import input_messages
from kiln.frontends.openai.response_items import output_items
from kiln.frontends.openai.response_store import ResponseStore


@dataclass(slots=True)
class ResponsesCall:
    """One Responses API request: the chat body it runs as, and what its answer echoes."""

    chat_body: dict[str, Any]
    #: the conversation, instructions left out (what a later ``previous_response_id``
    #: continues from)
    conversation: list[dict[str, Any]]
    echo: dict[str, Any]
    store: bool
    created_at: int = field(default_factory=lambda: int(time.time()))
    #: the output text's logprobs are answered (``top_logprobs`` > 0 or ``include``)
    logprobs: bool = False
    #: the request's ``reasoning`` (``effort`` goes to the template), echoed
    reasoning: dict[str, Any] | None = None
    #: OpenAI's ``background``: answered at once (``queued``), run on, fetched with GET
    background: bool = False

    @classmethod
    def read(cls, body: dict[str, Any], stored: ResponseStore) -> ResponsesCall:
        for key, harmless in HARMLESS.items():
            value = body.get(key)
            if not any(value == h and type(value) is type(h) for h in harmless):
                raise OpenAIError(f"'{key}' is not supported by kiln: send no '{key}'", param=key)
        # the fields read here are not chat's (chat refuses ``store: true``, say)
        unknown = {k: v for k, v in body.items() if k not in HARMLESS and k not in RESPONSES_FIELDS}
        check_fields(unknown, RESPONSES_FIELDS, "responses")
        instructions = body.get("instructions")
        if instructions is not None and not isinstance(instructions, str):
            raise OpenAIError("'instructions' must be a string", param="instructions")
        previous = body.get("previous_response_id")
        if previous is not None and (not isinstance(previous, str) or not previous):
            raise OpenAIError(
                "'previous_response_id' must be a non-empty string", param="previous_response_id"
            )
        conversation = stored.conversation(previous) if previous else []
        conversation += input_messages(body.get("input"))
        store = flag(body, "store", True)
        background = flag(body, "background", False)
        if background and not store:
            raise OpenAIError(
                "a background response is fetched later with GET: it needs store: true",
                param="background",
            )

        metadata = response_fields.metadata(body.get("metadata"))
        chat: dict[str, Any] = {k: body[k] for k in PASSED if body.get(k) is not None}
        system = [{"role": "system", "content": instructions}] if instructions else []
        chat["messages"] = system + conversation
        if body.get("max_output_tokens") is not None:
            chat["max_completion_tokens"] = body["max_output_tokens"]
        top, logprobs = response_fields.logprobs(body)
        if logprobs:
            chat["logprobs"], chat["top_logprobs"] = True, top
        response_format = response_fields.response_format(body.get("text"))
        if response_format is not None:
            chat["response_format"] = response_format
        tools = response_fields.tools(body.get("tools"))
        if tools:
            chat["tools"] = tools
        choice = response_fields.tool_choice(body.get("tool_choice"))
        if choice is not None:
            chat["tool_choice"] = choice
        reasoning = response_fields.reasoning(body.get("reasoning"))
        if reasoning.get("effort") is not None:
            chat["reasoning_effort"] = reasoning["effort"]
        options = body.get("stream_options")
        if options is not None and not isinstance(options, dict):
            raise OpenAIError("'stream_options' must be an object", param="stream_options")
        echo = {
            "instructions": instructions,
            "max_output_tokens": body.get("max_output_tokens"),
            "metadata": metadata,
            "parallel_tool_calls": body.get("parallel_tool_calls", True),
            "previous_response_id": previous,
            "temperature": body.get("temperature", 1.0),
            "top_p": body.get("top_p", 1.0),
            "text": {"format": response_fields.response_format_echo(body.get("text"))},
            "tool_choice": body.get("tool_choice", "auto"),
            "tools": body.get("tools") or [],
            "top_logprobs": top,
            "user": body.get("user"),
        }
        echoed = {"effort": reasoning.get("effort"), "summary": None} if reasoning else None
        return cls(chat, conversation, echo, store, logprobs=logprobs, reasoning=echoed,
                   background=background)  # fmt: skip

    def skeleton(self, rid: str, model: str, status: str) -> dict[str, Any]:
        """The response object without its output (a stream's first events)."""
        return {
            "id": rid,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "background": self.background,
            "error": None,
            "incomplete_details": None,
            "model": model,
            "output": [],
            "reasoning": self.reasoning,
            "store": self.store,
            "truncation": "disabled",
            "usage": None,
            **self.echo,
        }

    def finish(
        self,
        rid: str,
        answer: dict[str, Any],
        stored: ResponseStore,
        ids: list[str] | None = None,
    ) -> dict[str, Any]:
        """The response object of a chat completion ``answer``; stored when asked.
        ``ids``: the output items' ids (a stream's, which its events named)."""
        choice = answer["choices"][0]
        message, reason = choice["message"], choice.get("finish_reason")
        logprobs = (choice.get("logprobs") or {}).get("content") or []
        items = output_items(message, ids, logprobs)
        usage = answer.get("usage") or {}
        response = self.skeleton(rid, answer["model"], "completed")
        response["output"] = items
        if reason == "length":
            response["status"] = "incomplete"
            response["incomplete_details"] = {"reason": "max_output_tokens"}
        response["usage"] = {
            "input_tokens": usage.get("prompt_tokens", 0),
            "input_tokens_details": {
                "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
            },
            "output_tokens": usage.get("completion_tokens", 0),
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage.get("total_tokens", 0),
        }
        if self.store:
            turn: dict[str, Any] = {"role": "assistant", "content": message.get("content") or ""}
            if message.get("tool_calls"):
                turn["tool_calls"] = message["tool_calls"]
            stored.put(response, [*self.conversation, turn])
        return response
