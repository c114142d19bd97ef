"""Hermes 2 Pro / Qwen 2.5 and 3: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``,
one block per call, after any text (which is the content)."""

from __future__ import annotations

from kiln.frontends.openai.tool_parsers.base import Parsed, PartialCall, ToolParser, held_prefix
from kiln.frontends.openai.tool_parsers.json_scan import NotJSON, object_call, skip_ws

START, END = "<tool_call>", "</tool_call>"


class HermesParser(ToolParser):
    name = "hermes"
    needs_special_tokens = True  # <tool_call> is an added token of these tokenizers

    def parse(self, text: str, final: bool) -> Parsed:
        first = text.find(START)
        if first < 0:
            return Parsed(text if final else text[: held_prefix(text, START)])
        calls: list[PartialCall] = []
        at = first
        try:
            while at >= 0:
                at = skip_ws(text, at + len(START))
                if at >= len(text):
                    if final:
                        raise NotJSON("an empty tool call")
                    break
                call, end = object_call(text, at, final)
                calls.append(call)
                if end is None:
                    if final:
                        raise NotJSON("an unfinished tool call")
                    break
                # the text between blocks (a newline, the closing tag) is neither
                at = text.find(START, end)
        except NotJSON:
            if final:  # as vLLM: a call that does not parse leaves the text as it is
                return Parsed(text)
        return Parsed(text[:first], calls)
