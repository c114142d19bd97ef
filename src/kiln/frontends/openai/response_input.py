"""The Responses API's ``input``: its items read into chat messages."""

from __future__ import annotations

from typing import Any

from kiln.frontends.openai.chat_input import MAX_MESSAGES
from kiln.frontends.openai.protocol import OpenAIError

_ROLES = ("user", "system", "developer", "assistant")
_TEXT_PARTS = ("input_text", "output_text", "text")


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


def input_messages(raw: Any) -> list[dict[str, Any]]:
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
