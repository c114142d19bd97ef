"""Python call syntax (Llama 3.2 / 4, ToolACE): the answer is a list of calls with keyword
arguments, ``[get_weather(city="Paris"), get_time()]``, optionally inside Llama 4's
``<|python_start|>`` ... ``<|python_end|>``. Arguments are Python literals, given out as JSON.
While streaming, each call goes out whole once its closing parenthesis is read."""

from __future__ import annotations

import ast
import json
import re

from kiln.frontends.openai.tool_parsers.base import Parsed, PartialCall, ToolParser
from kiln.frontends.openai.tool_parsers.json_scan import NotJSON, skip_ws

START, END = "<|python_start|>", "<|python_end|>"
#: a string, a bracket, a comma, a string the text ends inside, or a run of anything else
_TOKEN = re.compile(
    r"'(?:[^'\\\n]|\\.)*'|\"(?:[^\"\\\n]|\\.)*\"|[\[\](){},]|['\"]|[^'\"\[\](){},]+"
)


def _call(source: str) -> PartialCall:
    """One element of the list as a call, its keyword arguments as a JSON object."""
    try:
        node = ast.parse(source.strip(), mode="eval").body
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
            raise NotJSON("a call with keyword arguments expected")
        arguments = {}
        for keyword in node.keywords:
            if keyword.arg is None:
                raise NotJSON("**kwargs is not a literal")
            arguments[keyword.arg] = ast.literal_eval(keyword.value)
        return PartialCall(node.func.id, json.dumps(arguments, ensure_ascii=False))
    except (SyntaxError, ValueError, TypeError, MemoryError, RecursionError) as exc:
        # literal_eval's ValueError; json's TypeError for a set or bytes
        raise NotJSON(str(exc)) from None


class PythonicParser(ToolParser):
    name = "pythonic"

    def parse(self, text: str, final: bool) -> Parsed:
        start = skip_ws(text, 0)
        head = text[start:]
        if head.startswith(START):
            start = skip_ws(text, start + len(START))
            head = text[start:]
        if not head.startswith("["):
            if not final and START.startswith(head):
                return Parsed("")  # nothing yet, or the marker's beginning
            return Parsed(text)
        calls: list[PartialCall] = []
        depth, element, closed = 0, start + 1, None
        try:
            for match in _TOKEN.finditer(text, start):
                token = match.group()
                if token in ("'", '"'):
                    break  # the text ends inside a string
                if token in "[({":
                    depth += 1
                elif token in "])}":
                    depth -= 1
                    if depth == 0:
                        closed = match.end()
                        if text[element : match.start()].strip():
                            calls.append(_call(text[element : match.start()]))
                        break
                elif token == "," and depth == 1:
                    calls.append(_call(text[element : match.start()]))
                    element = match.end()
            if final:
                rest = text[closed:].strip() if closed is not None else None
                if not calls or rest not in ("", END):
                    raise NotJSON("not a whole list of calls")
        except NotJSON:
            if final:
                return Parsed(text)
        return Parsed("", calls)
