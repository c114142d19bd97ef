"""What every tool-call parser shares: the parse result, and the streaming diff that turns
successive parses of a growing text into OpenAI's ``tool_calls`` deltas.

A parser reads the whole text generated so far (``final``: the text is complete). While
the text grows, a parser reports only what cannot change any more: the content before a
possible tool-call marker, each call's name once whole, and its arguments text so far
(a prefix of its final arguments). So one streamer serves every parser, and the streamed
deltas reassemble to exactly what the same text gives unstreamed.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class PartialCall:
    """One call as far as it is known: ``name`` None until it is whole; ``arguments``
    the JSON text of the arguments so far."""

    name: str | None = None
    arguments: str = ""


@dataclass(slots=True)
class Parsed:
    """``content``: the text that is not a tool call (so far, when not final)."""

    content: str
    calls: list[PartialCall] = field(default_factory=list)


class ToolParser:
    """A model family's tool-call format (vLLM's ``--tool-call-parser`` names)."""

    name = ""
    #: the markers are special tokens of the family's tokenizers (``[TOOL_CALLS]``), which
    #: ``skip_special_tokens`` would drop before the parser sees them
    needs_special_tokens = False
    #: ids as the family's chat templates accept them (Mistral's: 9 letters and digits)
    id_style = "chatcmpl-tool"

    def __init__(self, tools: list[dict[str, Any]] | None = None) -> None:
        """``tools``: the request's (OpenAI's shape), whose parameter schemas a format of
        untyped values (Qwen3-Coder's XML) types its values by."""
        self.schemas: dict[str, Any] = {}
        for tool in tools or ():
            function = tool.get("function") if isinstance(tool, dict) else None
            if isinstance(function, dict) and isinstance(function.get("name"), str):
                self.schemas[function["name"]] = function.get("parameters") or {}

    def parse(self, text: str, final: bool) -> Parsed:
        raise NotImplementedError

    def tool_call_id(self) -> str:
        if self.id_style == "mistral":
            return uuid.uuid4().hex[:9]
        return f"chatcmpl-tool-{uuid.uuid4().hex}"


def held_prefix(text: str, marker: str) -> int:
    """Where the longest end of ``text`` that could begin ``marker`` starts (``len(text)``
    when none could): text from there is held back until the marker is told apart."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            return len(text) - size
    return len(text)


def call_json(call: PartialCall, call_id: str) -> dict[str, Any]:
    return {
        "id": call_id,
        "type": "function",
        "function": {"name": call.name, "arguments": call.arguments},
    }


class ToolCallStream:
    """One choice's stream: text in (all of it so far), OpenAI ``delta`` parts out."""

    def __init__(
        self,
        parser: ToolParser,
        max_calls: int | None = None,
        record: Callable[[bool, bool], None] | None = None,
    ) -> None:
        """``max_calls``: 1 when ``parallel_tool_calls`` is false (vLLM keeps the first);
        ``record``: counts each delta the parser reads, (streaming, it carried calls)."""
        self._parser = parser
        self._max_calls = max_calls
        self._record = record
        self.text = ""
        self._content_sent = 0
        self._ids: list[str] = []
        self._args_sent: list[int] = []

    @property
    def called(self) -> bool:
        return bool(self._ids)

    @property
    def ids(self) -> list[str]:
        """The ids of the calls begun so far, by index."""
        return list(self._ids)

    def pin_ids(self, ids: list[str]) -> None:
        """The calls begun so far keep the ids they went out with (a streamed derender
        replays them: its parser would draw new ones)."""
        for index, call_id in enumerate(ids[: len(self._ids)]):
            self._ids[index] = call_id

    def feed(self, text: str, final: bool = False) -> tuple[str, list[dict[str, Any]]]:
        """The content and ``tool_calls`` delta entries that ``text`` (the next piece)
        releases."""
        self.text += text
        parsed = self._parser.parse(self.text, final)
        content = ""
        if len(parsed.content) > self._content_sent and not self._ids:
            content = parsed.content[self._content_sent :]
            self._content_sent = len(parsed.content)
        out: list[dict[str, Any]] = []
        calls = parsed.calls[: self._max_calls]
        for index, call in enumerate(calls):
            if call.name is None:
                break  # indexes go out in order: the next call waits for this one's name
            if index == len(self._ids):
                self._ids.append(self._parser.tool_call_id())
                self._args_sent.append(0)
                out.append({"index": index, **call_json(PartialCall(call.name), self._ids[index])})
            sent = self._args_sent[index]
            if len(call.arguments) > sent:
                out.append({"index": index, "function": {"arguments": call.arguments[sent:]}})
                self._args_sent[index] = len(call.arguments)
        if self._record is not None and (text or final):
            self._record(True, bool(out))
        return content, out
