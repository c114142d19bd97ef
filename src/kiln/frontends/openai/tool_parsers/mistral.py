"""Mistral: ``[TOOL_CALLS]`` then a JSON array of ``{"name": ..., "arguments": {...}}``
(tokenizers before v11), or ``[TOOL_CALLS]name[ARGS]{...}`` once per call (v11 on). The
text before the first marker is the content."""

from __future__ import annotations

import json

from kiln.frontends.openai.tool_parsers.base import Parsed, PartialCall, ToolParser, held_prefix
from kiln.frontends.openai.tool_parsers.json_scan import (
    NotJSON,
    array_calls,
    object_call,
    skip_ws,
    value_end,
)


def _loads(text: str) -> object:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return None


BOT, ARGS = "[TOOL_CALLS]", "[ARGS]"


class MistralParser(ToolParser):
    name = "mistral"
    needs_special_tokens = True  # [TOOL_CALLS] is a control token
    id_style = "mistral"  # Mistral's templates take 9-character ids only

    def parse(self, text: str, final: bool) -> Parsed:
        first = text.find(BOT)
        if first < 0:
            return Parsed(text if final else text[: held_prefix(text, BOT)])
        try:
            calls = self._calls(text, skip_ws(text, first + len(BOT)), final)
        except NotJSON:
            # as vLLM: what does not parse stays text (while streaming: nothing more yet)
            return Parsed(text) if final else Parsed(text[:first])
        return Parsed(text[:first], calls)

    def _calls(self, text: str, at: int, final: bool) -> list[PartialCall]:
        if at >= len(text):
            if final:
                raise NotJSON("no call after [TOOL_CALLS]")
            return []
        end: int | None
        if text[at] == "[":
            calls, end = array_calls(text, at, final)
        elif text[at] == "{":
            call, end = object_call(text, at, final)
            calls = [call]
        else:
            return self._v11_calls(text, at, final)
        if end is None and final:
            raise NotJSON("unfinished tool calls")
        return calls

    @staticmethod
    def _v11_calls(text: str, at: int, final: bool) -> list[PartialCall]:
        calls: list[PartialCall] = []
        while at < len(text):
            marker = text.find(ARGS, at)
            if marker < 0:
                if final:
                    raise NotJSON("[ARGS] expected after a function name")
                break
            name = text[at:marker].strip()
            start = marker + len(ARGS)
            end = value_end(text, start, final)
            if end is None:
                if final:
                    raise NotJSON("unfinished arguments")
                calls.append(PartialCall(name, text[start:].rstrip()))
                break
            arguments = text[start:end]
            if final and not (name and isinstance(_loads(arguments), dict)):
                raise NotJSON("a call needs a name and object arguments")
            calls.append(PartialCall(name, arguments))
            nxt = text.find(BOT, end)
            if nxt < 0:
                break
            at = nxt + len(BOT)
        return calls
