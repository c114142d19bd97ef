"""Spans of JSON values in text that may end part-way through them.

A tool call's arguments are streamed as the model's own JSON text: the span of the
``arguments`` value from its first character to where the text ends (or the value does).
Finding where a value ends takes bracket depth outside strings only; whether it is valid
JSON is ``json.loads``'s job once it is whole. Strings and runs of plain characters are
matched by regular expressions, so a long argument costs C speed, not a Python loop.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from kiln.frontends.openai.tool_parsers.base import PartialCall

_WS = re.compile(r"\s*")
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"', re.DOTALL)
#: inside an object or array: a string, a bracket, or a run of anything else
_TOKEN = re.compile(r'"(?:[^"\\]|\\.)*"|[\[\]{}]|[^"\[\]{}]+|"', re.DOTALL)
_SCALAR = re.compile(r"[^\s,\]}]+")


class NotJSON(ValueError):
    """The text is not the JSON this format expects (it cannot become a call)."""


def skip_ws(text: str, pos: int) -> int:
    match = _WS.match(text, pos)
    return match.end() if match else pos


def value_end(text: str, pos: int, final: bool) -> int | None:
    """The end of the JSON value starting at ``pos`` (no whitespace before it), or None when
    the text ends inside it. A scalar at the very end is unfinished unless ``final``
    (``12`` may become ``123``)."""
    if pos >= len(text):
        return None
    first = text[pos]
    if first == '"':
        match = _STRING.match(text, pos)
        return match.end() if match else None
    if first not in "[{":
        match = _SCALAR.match(text, pos)
        if match is None:
            raise NotJSON(f"no JSON value at {pos}")
        return match.end() if match.end() < len(text) or final else None
    depth = 0
    for match in _TOKEN.finditer(text, pos):
        token = match.group()
        if token in "[{":
            depth += 1
        elif token in "]}":
            depth -= 1
            if depth == 0:
                return match.end()
        elif token == '"':  # a string the text ends inside
            return None
    return None


@dataclass(slots=True)
class Member:
    """One ``"key": value`` of an object: the value's span (``end`` None: unfinished)."""

    start: int
    end: int | None


def object_members(text: str, pos: int, final: bool) -> tuple[dict[str, Member], int | None]:
    """The members of the JSON object starting at ``pos`` as far as the text goes, and the
    object's end (None: unfinished). Raises :class:`NotJSON` where the text cannot be the
    object."""
    if text[pos : pos + 1] != "{":
        raise NotJSON("not an object")
    members: dict[str, Member] = {}
    at = skip_ws(text, pos + 1)
    if text[at : at + 1] == "}":
        return members, at + 1
    while at < len(text):
        key = _STRING.match(text, at)
        if key is None:
            if text[at] != '"':
                raise NotJSON("an object key must be a string")
            return members, None
        at = skip_ws(text, key.end())
        if at >= len(text):
            return members, None
        if text[at] != ":":
            raise NotJSON("':' expected after an object key")
        at = skip_ws(text, at + 1)
        if at >= len(text):
            return members, None
        end = value_end(text, at, final)
        members[json.loads(key.group())] = Member(at, end)
        if end is None:
            return members, None
        at = skip_ws(text, end)
        if at >= len(text):
            return members, None
        if text[at] == "}":
            return members, at + 1
        if text[at] != ",":
            raise NotJSON("',' or '}' expected in an object")
        at = skip_ws(text, at + 1)
    return members, None


def partial_span(text: str, member: Member) -> str:
    """A member's value text so far: whole, or (unfinished) up to the text's end without
    trailing whitespace, which more text may show to be inside a string."""
    if member.end is not None:
        return text[member.start : member.end]
    return text[member.start :].rstrip()


def string_value(text: str, member: Member | None) -> str | None:
    """A member's value when it is a whole JSON string."""
    if member is None or member.end is None or text[member.start] != '"':
        return None
    value = json.loads(text[member.start : member.end])
    return value if isinstance(value, str) else None


def object_call(
    text: str, pos: int, final: bool, arg_keys: tuple[str, ...] = ("arguments",)
) -> tuple[PartialCall, int | None]:
    """The call ``{"name": ..., "arguments": {...}}`` at ``pos`` and its end (None:
    unfinished). Whole, it must be an object with a string name and object arguments
    (missing arguments: ``{}``)."""
    members, end = object_members(text, pos, final)
    key = next((k for k in arg_keys if k in members), None)
    arguments = partial_span(text, members[key]) if key is not None else ""
    if end is None:
        return PartialCall(string_value(text, members.get("name")), arguments), None
    try:
        whole = json.loads(text[pos:end])
    except json.JSONDecodeError as exc:
        raise NotJSON(str(exc)) from None
    name = whole.get("name")
    if not isinstance(name, str) or (key is not None and not isinstance(whole[key], dict)):
        raise NotJSON("a call needs a string 'name' and object arguments")
    return PartialCall(name, arguments if key is not None else "{}"), end


def array_calls(
    text: str, pos: int, final: bool, arg_keys: tuple[str, ...] = ("arguments",)
) -> tuple[list[PartialCall], int | None]:
    """The calls of a JSON array of call objects at ``pos``, and the array's end."""
    if text[pos : pos + 1] != "[":
        raise NotJSON("not an array")
    calls: list[PartialCall] = []
    at = skip_ws(text, pos + 1)
    if text[at : at + 1] == "]":
        return calls, at + 1
    while at < len(text):
        call, end = object_call(text, at, final, arg_keys)
        calls.append(call)
        if end is None:
            return calls, None
        at = skip_ws(text, end)
        if at >= len(text):
            break
        if text[at] == "]":
            return calls, at + 1
        if text[at] != ",":
            raise NotJSON("',' or ']' expected between calls")
        at = skip_ws(text, at + 1)
    return calls, None
