"""Qwen3-Coder's XML tool calls (vLLM's ``qwen3_coder`` and ``qwen3_xml``)::

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    <parameter=days>
    3
    </parameter>
    </function>
    </tool_call>

after any text (the content). A parameter's value is raw text: it becomes the JSON value
its tool's schema types it as (integer, number, boolean, null, object, array, else the
string), as vLLM coerces it. Streamed, a call's arguments grow one whole parameter at a
time (``{"city": "Paris"``, then ``, "days": 3``, then ``}``), so the deltas reassemble to
the whole answer's arguments.
"""

from __future__ import annotations

import json
import math
from typing import Any

from kiln.frontends.openai.tool_parsers.base import Parsed, PartialCall, ToolParser, held_prefix

START, END = "<tool_call>", "</tool_call>"
FUNCTION, FUNCTION_END = "<function=", "</function>"
PARAMETER, PARAMETER_END = "<parameter=", "</parameter>"
#: a value's type tried in this order (a value both ``"1"`` and an integer is the integer)
_ORDER = ("null", "integer", "number", "boolean", "object", "array", "string")
_ALIASES = {"int": "integer", "float": "number", "double": "number", "bool": "boolean",
            "str": "string", "text": "string", "dict": "object", "list": "array"}  # fmt: skip


class Qwen3XmlParser(ToolParser):
    name = "qwen3_xml"
    needs_special_tokens = True  # <tool_call> is an added token of Qwen3's tokenizers

    def parse(self, text: str, final: bool) -> Parsed:
        first = _first_marker(text, 0)
        if first < 0:
            if final:
                return Parsed(text)
            return Parsed(text[: min(held_prefix(text, START), held_prefix(text, FUNCTION))])
        calls: list[PartialCall] = []
        at = first
        while at >= 0:
            call, end = self._call(text, at, final)
            if call is None:
                break
            calls.append(call)
            if end is None:
                break
            at = _first_marker(text, end)
        if final and (not calls or any(c.name is None or not c.arguments.endswith("}")
                                       for c in calls)):  # fmt: skip
            return Parsed(text)  # as vLLM: calls that do not parse leave the text as it is
        return Parsed(text[:first], calls)

    def _call(self, text: str, at: int, final: bool) -> tuple[PartialCall | None, int | None]:
        """The call whose block begins at ``at`` (``<tool_call>`` or ``<function=``) and
        where it ends (None: the text ends inside it)."""
        head = text.find(FUNCTION, at)
        if head < 0:
            return None, None
        close = text.find(">", head)
        if close < 0:
            return PartialCall(), None
        name = text[head + len(FUNCTION) : close].strip()
        schema = self.schemas.get(name, {})
        properties = schema.get("properties") if isinstance(schema, dict) else None
        parts: list[str] = []
        pos = close + 1
        while True:
            param = text.find(PARAMETER, pos)
            done = text.find(FUNCTION_END, pos)
            if done >= 0 and (param < 0 or done < param):
                arguments = "{" + ", ".join(parts) + "}"
                end = done + len(FUNCTION_END)
                rest = text[end:].lstrip()
                if rest.startswith(END):
                    end = len(text) - len(rest) + len(END)
                return PartialCall(name, arguments), end
            if param < 0:
                break
            key_end = text.find(">", param)
            value_end = text.find(PARAMETER_END, key_end) if key_end >= 0 else -1
            if value_end < 0:
                break
            key = text[param + len(PARAMETER) : key_end].strip()
            raw = text[key_end + 1 : value_end]
            raw = raw.removeprefix("\n").removesuffix("\n")
            prop = properties.get(key) if isinstance(properties, dict) else None
            value = coerce(raw, prop)
            parts.append(json.dumps(key, ensure_ascii=False) + ": "
                         + json.dumps(value, ensure_ascii=False))  # fmt: skip
            pos = value_end + len(PARAMETER_END)
        return PartialCall(name, "{" + ", ".join(parts)), None


def _first_marker(text: str, at: int) -> int:
    found = [i for i in (text.find(START, at), text.find(FUNCTION, at)) if i >= 0]
    return min(found) if found else -1


def types_of(schema: Any) -> set[str]:
    """The JSON types a schema allows: ``type`` (one or a list), an ``enum``'s values'
    types, and those of ``anyOf`` / ``oneOf`` / ``allOf`` branches; string when none."""
    return _types(schema) or {"string"}


def _types(schema: Any) -> set[str]:
    if not isinstance(schema, dict):
        return set()
    found: set[str] = set()
    kind = schema.get("type")
    names = [kind] if isinstance(kind, str) else kind if isinstance(kind, list) else []
    for name in names:
        if isinstance(name, str):
            name = name.strip().lower()
            found.add(_ALIASES.get(name, name))
    enum = schema.get("enum")
    if isinstance(enum, list):
        found |= {_json_type(value) for value in enum}
    for key in ("anyOf", "oneOf", "allOf"):
        branches = schema.get(key)
        if isinstance(branches, list):
            for branch in branches:
                found |= _types(branch)
    return found


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, dict):
        return "object"
    if isinstance(value, list):
        return "array"
    return "string"


def coerce(raw: str, schema: Any) -> Any:
    """``raw`` as the value the schema types it as (vLLM's order: null, integer, number,
    boolean, object, array, string); without a type that fits, JSON if it parses to a
    finite value, else the text."""
    types = types_of(schema) if schema is not None else set()
    for kind in _ORDER:
        if kind not in types:
            continue
        if kind == "null" and raw.strip().lower() == "null":
            return None
        if kind == "string":
            return raw
        if kind == "integer":
            try:
                return int(raw.strip())
            except ValueError:
                continue
        if kind == "number":
            try:
                number = float(raw.strip())
            except ValueError:
                continue
            if math.isfinite(number):
                return int(number) if number == int(number) else number
        if kind == "boolean" and raw.strip().lower() in ("true", "1", "false", "0"):
            return raw.strip().lower() in ("true", "1")
        if kind in ("object", "array"):
            parsed = _finite_json(raw)
            if parsed is not _NOTHING:
                return parsed
    parsed = _finite_json(raw)
    return raw if parsed is _NOTHING else parsed


_NOTHING = object()


def _finite_json(raw: str) -> Any:
    try:
        value = json.loads(raw)
    except ValueError:
        return _NOTHING
    try:
        json.dumps(value, allow_nan=False)
    except ValueError:  # inf / nan: no JSON value
        return _NOTHING
    return value
