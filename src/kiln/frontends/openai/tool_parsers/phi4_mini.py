"""Phi-4-mini's JSON tool calls (vLLM's ``phi4_mini_json``): ``functools[{"name": ...,
"arguments": {...}}, ...]`` (``parameters`` read too), after any text (the content)."""

from __future__ import annotations

from kiln.frontends.openai.tool_parsers.base import Parsed, PartialCall, ToolParser, held_prefix
from kiln.frontends.openai.tool_parsers.json_scan import NotJSON, object_call, skip_ws

START = "functools["
_KEYS = ("arguments", "parameters")


class Phi4MiniJsonParser(ToolParser):
    name = "phi4_mini_json"

    def parse(self, text: str, final: bool) -> Parsed:
        first = text.find(START)
        if first < 0:
            return Parsed(text if final else text[: held_prefix(text, START)])
        calls: list[PartialCall] = []
        at = skip_ws(text, first + len(START))
        closed = False
        try:
            while at < len(text):
                if text[at] == "]":
                    closed = True
                    break
                call, end = object_call(text, at, final, _KEYS)
                calls.append(call)
                if end is None:
                    break
                at = skip_ws(text, end)
                if at < len(text) and text[at] == ",":
                    at = skip_ws(text, at + 1)
                elif at < len(text) and text[at] != "]":
                    raise NotJSON("',' or ']' expected between calls")
            if final and (not closed or not calls or calls[-1].name is None):
                raise NotJSON("unfinished tool calls")
        except NotJSON:
            if final:  # as vLLM: calls that do not parse leave the text as it is
                return Parsed(text)
        return Parsed(text[:first], calls)
