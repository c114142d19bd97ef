"""Llama 3.1 / 3.2 JSON tool calls: the answer is ``{"name": ..., "parameters": {...}}``
(``arguments`` read too), after an optional ``<|python_tag|>``; several calls are
separated by ``;``. An answer that does not start so is plain content."""

from __future__ import annotations

from kiln.frontends.openai.tool_parsers.base import Parsed, PartialCall, ToolParser
from kiln.frontends.openai.tool_parsers.json_scan import NotJSON, object_call, skip_ws

TAG = "<|python_tag|>"
_KEYS = ("parameters", "arguments")


class Llama3JsonParser(ToolParser):
    name = "llama3_json"

    def parse(self, text: str, final: bool) -> Parsed:
        start = skip_ws(text, 0)
        head = text[start:]
        if head.startswith(TAG):
            at = skip_ws(text, start + len(TAG))
        elif head.startswith("{"):
            at = start
        elif not final and TAG.startswith(head):
            return Parsed("")  # nothing yet, or the tag's beginning
        else:
            return Parsed(text)
        calls: list[PartialCall] = []
        try:
            while at < len(text):
                call, end = object_call(text, at, final, _KEYS)
                calls.append(call)
                if end is None:
                    break
                at = skip_ws(text, end)
                if at < len(text):
                    if text[at] != ";":
                        raise NotJSON("';' expected between calls")
                    at = skip_ws(text, at + 1)
            if final and (not calls or calls[-1].name is None or at < len(text)):
                raise NotJSON("unfinished tool calls")
        except NotJSON:
            if final:
                return Parsed(text)
        return Parsed("", calls)
