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
"""

from __future__ import annotations

import asyncio
import itertools
import re
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import orjson

from kiln.core.errors import KilnError
from kiln.frontends.openai.protocol import (
    MAX_MESSAGES,
    REASONING_EFFORTS,
    OpenAIError,
    check_fields,
    flag,
)

if TYPE_CHECKING:
    from kiln.frontends.openai.generation import Delta
    from kiln.frontends.openai.protocol import GenerationRequest
    from kiln.llm.sampler import TokenLogprobs

#: sampling and vLLM fields passed to the chat path as they are
_PASSED = (
    "model",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "stop",
    "ignore_eos",
    "logit_bias",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "min_tokens",
    "priority",
    "cache_salt",
    "stream",
    "user",
    "parallel_tool_calls",
    "chat_template_kwargs",
    "structured_outputs",
)
#: fields read here (``top_logprobs``, ``include``: the logprobs of the output text, as
#: vLLM answers them); ``background``, ``reasoning``, ``truncation``, ``max_tool_calls``,
#: ``prompt``, ``conversation`` and ``service_tier`` only with the values that ask for
#: nothing (else 400, naming them)
RESPONSES_FIELDS = frozenset(
    (
        *_PASSED,
        "input",
        "instructions",
        "max_output_tokens",
        "text",
        "tools",
        "tool_choice",
        "store",
        "previous_response_id",
        "metadata",
        "stream_options",
        "safety_identifier",
        "prompt_cache_key",
        "top_logprobs",
        "include",
        "reasoning",
        "background",
    )
)
#: ``include`` values kiln answers: the output text's logprobs
INCLUDABLE = ("message.output_text.logprobs",)
#: OpenAI's bound on ``top_logprobs``
MAX_TOP_LOGPROBS = 20
_HARMLESS: dict[str, tuple[Any, ...]] = {
    "truncation": (None, "disabled"),
    "max_tool_calls": (None,),
    "prompt": (None,),
    "conversation": (None,),
    "service_tier": (None, "auto", "default"),
}
_ROLES = ("user", "system", "developer", "assistant")
#: ``reasoning.summary`` values accepted (kiln writes no summary: the reasoning text itself
#: is the reasoning item, as vLLM answers)
_SUMMARIES = (None, "auto", "concise", "detailed")
_TEXT_PARTS = ("input_text", "output_text", "text")
#: OpenAI's bounds on ``metadata``
MAX_METADATA, MAX_METADATA_KEY, MAX_METADATA_VALUE = 16, 64, 512
#: the store's bounds: responses kept, and their conversations' JSON bytes in all
MAX_STORED = 1024
MAX_STORED_BYTES = 64 * 1024 * 1024


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _not_found(response_id: str, what: str = "Response") -> OpenAIError:
    return OpenAIError(f"{what} with id '{response_id[:100]}' not found.", 404, code="not_found")


@dataclass(slots=True)
class _Stored:
    response: dict[str, Any]
    #: the chat messages the response ended (its instructions left out, as OpenAI's
    #: ``previous_response_id`` does), its answer last
    messages: list[dict[str, Any]]
    size: int


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


class ResponseStore:
    """Stored responses, least recently used out first past :data:`MAX_STORED` or
    :data:`MAX_STORED_BYTES`. The event loop's only: no lock."""

    def __init__(self, max_count: int = MAX_STORED, max_bytes: int = MAX_STORED_BYTES) -> None:
        self._items: OrderedDict[str, _Stored] = OrderedDict()
        self._bytes = 0
        self._max_count, self._max_bytes = max_count, max_bytes

    def __len__(self) -> int:
        return len(self._items)

    def put(self, response: dict[str, Any], messages: list[dict[str, Any]]) -> None:
        size = len(orjson.dumps(response)) + len(orjson.dumps(messages))
        old = self._items.pop(response["id"], None)  # a background response, finished
        if old is not None:
            self._bytes -= old.size
        if size > self._max_bytes:
            return  # larger than the whole store: kept nowhere (GET answers 404)
        self._items[response["id"]] = _Stored(response, messages, size)
        self._bytes += size
        while len(self._items) > self._max_count or self._bytes > self._max_bytes:
            _, old = self._items.popitem(last=False)
            self._bytes -= old.size

    def _entry(self, response_id: str) -> _Stored:
        entry = self._items.get(response_id)
        if entry is None:
            raise _not_found(response_id)
        self._items.move_to_end(response_id)
        return entry

    def get(self, response_id: str) -> dict[str, Any]:
        return self._entry(response_id).response

    def conversation(self, response_id: str) -> list[dict[str, Any]]:
        try:
            return list(self._entry(response_id).messages)
        except OpenAIError:
            raise OpenAIError(
                f"Previous response with id '{response_id[:100]}' not found.",
                404,
                param="previous_response_id",
                code="previous_response_not_found",
            ) from None

    def delete(self, response_id: str) -> dict[str, Any]:
        entry = self._items.pop(response_id, None)
        if entry is None:
            raise _not_found(response_id)
        self._bytes -= entry.size
        return {"id": response_id, "object": "response.deleted", "deleted": True}


def _text_of(content: Any, where: str) -> str:
    """A message item's ``content``: a string, or a list of text parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for i, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") not in _TEXT_PARTS:
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise OpenAIError(
                    f"{where}.content[{i}]: only text parts are supported (got {kind!r})",
                    param=f"{where}.content",
                )
            text = part.get("text")
            if not isinstance(text, str):
                raise OpenAIError(
                    f"{where}.content[{i}].text must be a string", param=f"{where}.content"
                )
            texts.append(text)
        return "".join(texts)
    raise OpenAIError(
        f"{where}.content must be a string or a list of text parts", param=f"{where}.content"
    )


def _string(item: dict[str, Any], key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str) or not value:
        raise OpenAIError(f"{where}.{key} must be a non-empty string", param=f"{where}.{key}")
    return value


def _messages(raw: Any) -> list[dict[str, Any]]:
    """``input`` as chat messages: a string is one user message; a list holds message
    items, ``function_call`` items (consecutive ones are one assistant turn's calls) and
    ``function_call_output`` items (tool messages)."""
    if isinstance(raw, str):
        if not raw:
            raise OpenAIError("'input' must not be empty", param="input")
        return [{"role": "user", "content": raw}]
    if not isinstance(raw, list) or not raw:
        raise OpenAIError("'input' must be a string or a non-empty list of items", param="input")
    if len(raw) > MAX_MESSAGES:  # before each item is read
        raise OpenAIError(
            f"'input' holds {len(raw)} items, more than {MAX_MESSAGES}", param="input"
        )
    out: list[dict[str, Any]] = []
    for i, item in enumerate(raw):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise OpenAIError(f"{where} must be an object", param=where)
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in _ROLES:
                raise OpenAIError(
                    f"{where}.role must be one of {list(_ROLES)}, got {role!r}",
                    param=f"{where}.role",
                )
            out.append({"role": role, "content": _text_of(item.get("content"), where)})
        elif kind == "function_call":
            call = {
                "id": _string(item, "call_id", where),
                "type": "function",
                "function": {
                    "name": _string(item, "name", where),
                    "arguments": item.get("arguments") or "{}",
                },
            }
            if not isinstance(call["function"]["arguments"], str):  # type: ignore[index]
                raise OpenAIError(
                    f"{where}.arguments must be a string (JSON)", param=f"{where}.arguments"
                )
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant" and last.get("tool_calls"):
                last["tool_calls"].append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            out.append(
                {
                    "role": "tool",
                    "tool_call_id": _string(item, "call_id", where),
                    "content": _text_of(output, where) if isinstance(output, list) else output,
                }
            )
            if not isinstance(out[-1]["content"], str):
                raise OpenAIError(
                    f"{where}.output must be a string or a list of text parts",
                    param=f"{where}.output",
                )
        else:
            raise OpenAIError(
                f"{where}: items of type {kind!r} are not supported by kiln (message, "
                "function_call and function_call_output are)",
                param=f"{where}.type",
            )
    return out


def _response_format(text: Any) -> dict[str, Any] | None:
    """``text.format`` as chat's ``response_format`` (None: plain text)."""
    if text is None:
        return None
    if not isinstance(text, dict):
        raise OpenAIError("'text' must be an object", param="text")
    verbosity = text.get("verbosity")
    if verbosity not in (None, "medium"):
        raise OpenAIError("'text.verbosity' is not supported by kiln", param="text.verbosity")
    fmt = text.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise OpenAIError("'text.format' must be an object", param="text.format")
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        if "schema" not in fmt:
            raise OpenAIError(
                "'text.format' of type 'json_schema' needs 'schema'", param="text.format"
            )
        name = fmt.get("name", "response")
        return {"type": "json_schema", "json_schema": {"name": name, "schema": fmt["schema"]}}
    raise OpenAIError(
        f"text.format type must be 'text', 'json_object' or 'json_schema', got {kind!r}",
        param="text.format",
    )


def _tools(raw: Any) -> list[dict[str, Any]] | None:
    """Function tools in chat's shape (the Responses API writes them flat)."""
    if raw is None:
        return None
    if not isinstance(raw, list):
        raise OpenAIError("'tools' must be a list", param="tools")
    out = []
    for i, tool in enumerate(raw):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else None
            raise OpenAIError(
                f"tools[{i}]: only function tools are supported by kiln (got {kind!r})",
                param=f"tools[{i}].type",
            )
        function = {k: tool[k] for k in ("name", "description", "parameters") if k in tool}
        out.append({"type": "function", "function": function})
    return out


def _tool_choice(raw: Any) -> Any:
    if raw is None or isinstance(raw, str):
        return raw
    if isinstance(raw, dict) and raw.get("type") == "function":
        return {"type": "function", "function": {"name": raw.get("name")}}
    raise OpenAIError(
        "tool_choice must be 'none', 'auto', 'required' or {'type': 'function', 'name': ...}",
        param="tool_choice",
    )


def _metadata(raw: Any) -> dict[str, str]:
    if raw is None:
        return {}
    if (
        not isinstance(raw, dict)
        or len(raw) > MAX_METADATA
        or not all(
            isinstance(k, str)
            and isinstance(v, str)
            and len(k) <= MAX_METADATA_KEY
            and len(v) <= MAX_METADATA_VALUE
            for k, v in raw.items()
        )
    ):
        raise OpenAIError(
            f"'metadata' must be up to {MAX_METADATA} string pairs (keys up to "
            f"{MAX_METADATA_KEY} characters, values up to {MAX_METADATA_VALUE})",
            param="metadata",
        )
    return dict(raw)


def _reasoning(raw: Any) -> dict[str, Any]:
    """``reasoning``: ``{"effort": ...}`` becomes the template's ``reasoning_effort``, as
    vLLM passes it; ``summary`` is accepted."""
    if raw is None:
        return {}
    if not isinstance(raw, dict) or set(raw) - {"effort", "summary", "generate_summary"}:
        raise OpenAIError(
            "'reasoning' must be an object with 'effort' (and 'summary')", param="reasoning"
        )
    effort = raw.get("effort")
    if effort is not None and effort not in REASONING_EFFORTS:
        raise OpenAIError(
            f"reasoning.effort must be one of {list(REASONING_EFFORTS)}, got {effort!r}",
            param="reasoning.effort",
        )
    for key in ("summary", "generate_summary"):
        if raw.get(key) not in _SUMMARIES:
            raise OpenAIError(
                f"reasoning.{key} must be one of {list(_SUMMARIES)}", param=f"reasoning.{key}"
            )
    return raw


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
        for key, harmless in _HARMLESS.items():
            value = body.get(key)
            if not any(value == h and type(value) is type(h) for h in harmless):
                raise OpenAIError(f"'{key}' is not supported by kiln: send no '{key}'", param=key)
        # the fields read here are not chat's (chat refuses ``store: true``, say)
        unknown = {
            k: v for k, v in body.items() if k not in _HARMLESS and k not in RESPONSES_FIELDS
        }
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
        conversation += _messages(body.get("input"))
        store = flag(body, "store", True)
        background = flag(body, "background", False)
        if background and not store:
            raise OpenAIError(
                "a background response is fetched later with GET: it needs store: true",
                param="background",
            )

        metadata = _metadata(body.get("metadata"))
        chat: dict[str, Any] = {k: body[k] for k in _PASSED if body.get(k) is not None}
        system = [{"role": "system", "content": instructions}] if instructions else []
        chat["messages"] = system + conversation
        if body.get("max_output_tokens") is not None:
            chat["max_completion_tokens"] = body["max_output_tokens"]
        top, logprobs = _logprobs(body)
        if logprobs:
            chat["logprobs"], chat["top_logprobs"] = True, top
        response_format = _response_format(body.get("text"))
        if response_format is not None:
            chat["response_format"] = response_format
        tools = _tools(body.get("tools"))
        if tools:
            chat["tools"] = tools
        choice = _tool_choice(body.get("tool_choice"))
        if choice is not None:
            chat["tool_choice"] = choice
        reasoning = _reasoning(body.get("reasoning"))
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
            "text": {"format": response_format_echo(body.get("text"))},
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


#: chat's names of the fields a Responses request sets, and the Responses API's names
_NAMES = (
    (re.compile(r"\bmax_completion_tokens\b"), "max_output_tokens"),
    (re.compile(r"\bresponse_format\b"), "text.format"),
    (re.compile(r"\btools\[(\d+)\]\.function\b"), r"tools[\1]"),
    (re.compile(r"\bmessages\b"), "input"),
)


def renamed(exc: OpenAIError) -> OpenAIError:
    """An error of the chat path, naming the Responses API's fields (its ``input`` items
    may be counted differently from chat's messages: instructions and grouped calls)."""
    message, param = exc.message, exc.param
    for pattern, name in _NAMES:
        message = pattern.sub(name, message)
        param = pattern.sub(name, param) if param is not None else None
    return OpenAIError(message, exc.status, param=param, code=exc.code, type_=exc.type)


def response_format_echo(text: Any) -> dict[str, Any]:
    fmt = text.get("format") if isinstance(text, dict) else None
    return fmt if isinstance(fmt, dict) else {"type": "text"}


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
        return next(fresh) if fresh is not None else _id(prefix)

    items: list[dict[str, Any]] = []
    if message.get("reasoning"):  # a thinking model's <think> part, first
        items.append(_reasoning_item(next_id("rs"), message["reasoning"], "completed"))
    content = message.get("content")
    if content or not calls:
        items.append(_message_item(next_id("msg"), content or "", "completed", logprobs))
    for call in calls:
        items.append(
            _call_item(
                next_id("fc"),
                call["id"],
                call["function"]["name"],
                call["function"]["arguments"],
                "completed",
            )
        )
    return items


def _reasoning_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    content = [{"type": "reasoning_text", "text": text}] if status == "completed" else []
    return {"type": "reasoning", "id": item_id, "summary": [], "content": content,
            "status": status}  # fmt: skip


def _message_item(
    item_id: str, text: str, status: str, logprobs: list[dict[str, Any]] | None = None
) -> dict[str, Any]:
    content = [_text_part(text, logprobs)]
    return {
        "type": "message",
        "id": item_id,
        "status": status,
        "role": "assistant",
        "content": content if status == "completed" else [],
    }


def _text_part(text: str, logprobs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}


def _logprobs(body: dict[str, Any]) -> tuple[int, bool]:
    """``top_logprobs`` (0-20) and whether the output text's logprobs are answered: asked
    by ``top_logprobs`` > 0 or by ``include``'s ``message.output_text.logprobs`` (any other
    ``include`` value is refused, naming it)."""
    top = body.get("top_logprobs")
    if top is not None and (
        isinstance(top, bool) or not isinstance(top, int) or not 0 <= top <= MAX_TOP_LOGPROBS
    ):
        raise OpenAIError(
            f"'top_logprobs' must be an integer from 0 to {MAX_TOP_LOGPROBS}, got {top!r}",
            param="top_logprobs",
        )
    include = body.get("include")
    if include is None:
        include = []
    if not isinstance(include, list) or len(include) > len(INCLUDABLE) + 8:
        raise OpenAIError("'include' must be a short list of strings", param="include")
    for value in include:
        if value not in INCLUDABLE:
            raise OpenAIError(
                f"'include' value {str(value)[:80]!r} is not supported by kiln (it answers "
                f"{', '.join(INCLUDABLE)})",
                param="include",
            )
    return top or 0, bool(top) or bool(include)


def _call_item(
    item_id: str, call_id: str, name: str, arguments: str, status: str
) -> dict[str, Any]:
    return {
        "type": "function_call",
        "id": item_id,
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }


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
                  item=_reasoning_item(ids[at], thought, "completed")),
        ]  # fmt: skip

    def open_message() -> list[bytes]:
        nonlocal message_at
        message_at = len(ids)
        ids.append(_id("msg"))
        item = _message_item(ids[message_at], "", "in_progress")
        part = _text_part("")
        return [
            event("response.output_item.added", output_index=message_at, item=item),
            event("response.content_part.added", item_id=ids[message_at],
                  output_index=message_at, content_index=0, part=part),
        ]  # fmt: skip

    def close_message() -> list[bytes]:
        assert message_at is not None
        item_id = ids[message_at]
        part = _text_part(text, scored)
        return [
            event("response.output_text.done", item_id=item_id, output_index=message_at,
                  content_index=0, text=text, logprobs=scored),
            event("response.content_part.done", item_id=item_id, output_index=message_at,
                  content_index=0, part=part),
            event("response.output_item.done", output_index=message_at,
                  item=_message_item(item_id, text, "completed", scored)),
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
                        ids.append(_id("rs"))
                        item = _reasoning_item(ids[-1], "", "in_progress")
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
                    ids.append(_id("fc"))
                    item = _call_item(ids[-1], part["id"], part["function"]["name"], "",
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
                    item=_call_item(ids[at], c["id"], name, arguments, "completed"))  # fmt: skip
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
