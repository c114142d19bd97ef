"""The answers of ``tool_choice`` ``required`` and a named function, which the structured-
output engine constrains: a JSON array of ``{"name": ..., "parameters": {...}}`` (vLLM's
schema), or the named function's arguments object itself."""

from __future__ import annotations

from kiln.frontends.openai.tool_parsers.base import Parsed, PartialCall, ToolParser
from kiln.frontends.openai.tool_parsers.json_scan import NotJSON, array_calls, skip_ws


class NamedCall(ToolParser):
    """The whole answer is the arguments of the one function ``tool_choice`` names."""

    def __init__(self, function: str) -> None:
        self.function = function

    def parse(self, text: str, final: bool) -> Parsed:
        arguments = text.strip() if final else text.lstrip().rstrip()
        return Parsed("", [PartialCall(self.function, arguments)])


class RequiredCalls(ToolParser):
    """The whole answer is a JSON array of calls (``tool_choice: required``)."""

    def parse(self, text: str, final: bool) -> Parsed:
        at = skip_ws(text, 0)
        if at >= len(text):
            return Parsed(text if final else "")
        try:
            calls, end = array_calls(text, at, final, ("parameters",))
            if final and (end is None or text[end:].strip()):
                raise NotJSON("unfinished")  # cut by max_tokens
        except NotJSON:
            return Parsed(text) if final else Parsed("")
        return Parsed("", calls)
