"""The Responses API's request fields: which it reads, the chat fields they become
(``text.format``, ``tools``, ``tool_choice``, ``reasoning``, ``top_logprobs`` and ``include``),
``metadata``, and the chat path's errors renamed to name them."""

from __future__ import annotations

import re
from typing import Any

from kiln.frontends.openai.chat_input import REASONING_EFFORTS
from kiln.frontends.openai.protocol import OpenAIError

#: sampling and vLLM fields passed to the chat path as they are
PASSED = (
    "model",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "stop",
    "ignore_eos",
    "logit_bias",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "min_tokens",
    "priority",
    "cache_salt",
    "stream",
    "user",
    "parallel_tool_calls",
    "chat_template_kwargs",
    "structured_outputs",
)
#: fields read here (``top_logprobs``, ``include``: the logprobs of the output text, as
#: vLLM answers them); ``background``, ``reasoning``, ``truncation``, ``max_tool_calls``,
#: ``prompt``, ``conversation`` and ``service_tier`` only with the values that ask for
#: nothing (else 400, naming them)
RESPONSES_FIELDS = frozenset(
    (
        *PASSED,
        "input",
        "instructions",
        "max_output_tokens",
        "text",
        "tools",
        "tool_choice",
        "store",
        "previous_response_id",
        "metadata",
        "stream_options",
        "safety_identifier",
        "prompt_cache_key",
        "top_logprobs",
        "include",
        "reasoning",
        "background",
    )
)
#: ``include`` values kiln answers: the output text's logprobs
INCLUDABLE = ("message.output_text.logprobs",)
#: OpenAI's bound on ``top_logprobs``
MAX_TOP_LOGPROBS = 20
HARMLESS: dict[str, tuple[Any, ...]] = {
    "truncation": (None, "disabled"),
    "max_tool_calls": (None,),
    "prompt": (None,),
    "conversation": (None,),
    "service_tier": (None, "auto", "default"),
}
#: ``reasoning.summary`` values accepted (kiln writes no summary: the reasoning text itself
#: is the reasoning item, as vLLM answers)
_SUMMARIES = (None, "auto", "concise", "detailed")
#: OpenAI's bounds on ``metadata``
MAX_METADATA, MAX_METADATA_KEY, MAX_METADATA_VALUE = 16, 64, 512


def response_format(text: Any) -> dict[str, Any] | None:
    """``text.format`` as chat's ``response_format`` (None: plain text)."""
    if text is None:
        return None
    if not isinstance(text, dict):
        raise OpenAIError("'text' must be an object", param="text")
    verbosity = text.get("verbosity")
    if verbosity not in (None, "medium"):
        raise OpenAIError("'text.verbosity' is not supported by kiln", param="text.verbosity")
    fmt = text.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise OpenAIError("'text.format' must be an object", param="text.format")
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        if "schema" not in fmt:
            raise OpenAIError(
                "'text.format' of type 'json_schema' needs 'schema'", param="text.format"
            )
        name = fmt.get("name", "response")
        return {"type": "json_schema", "json_schema": {"name": name, "schema": fmt["schema"]}}
    raise OpenAIError(
        f"text.format type must be 'text', 'json_object' or 'json_schema', got {kind!r}",
        param="text.format",
    )


def tools(raw: Any) -> list[dict[str, Any]] | None:
    """Function tools in chat's shape (the Responses API writes them flat)."""
    if raw is None:
        return None
    if not isinstance(raw, list):
        raise OpenAIError("'tools' must be a list", param="tools")
    out = []
    for i, tool in enumerate(raw):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else None
            raise OpenAIError(
                f"tools[{i}]: only function tools are supported by kiln (got {kind!r})",
                param=f"tools[{i}].type",
            )
        function = {k: tool[k] for k in ("name", "description", "parameters") if k in tool}
        out.append({"type": "function", "function": function})
    return out


def tool_choice(raw: Any) -> Any:
    if raw is None or isinstance(raw, str):
        return raw
    if isinstance(raw, dict) and raw.get("type") == "function":
        return {"type": "function", "function": {"name": raw.get("name")}}
    raise OpenAIError(
        "tool_choice must be 'none', 'auto', 'required' or {'type': 'function', 'name': ...}",
        param="tool_choice",
    )


def metadata(raw: Any) -> dict[str, str]:
    if raw is None:
        return {}
    if (
        not isinstance(raw, dict)
        or len(raw) > MAX_METADATA
        or not all(
            isinstance(k, str)
            and isinstance(v, str)
            and len(k) <= MAX_METADATA_KEY
            and len(v) <= MAX_METADATA_VALUE
            for k, v in raw.items()
        )
    ):
        raise OpenAIError(
            f"'metadata' must be up to {MAX_METADATA} string pairs (keys up to "
            f"{MAX_METADATA_KEY} characters, values up to {MAX_METADATA_VALUE})",
            param="metadata",
        )
    return dict(raw)


def reasoning(raw: Any) -> dict[str, Any]:
    """``reasoning``: ``{"effort": ...}`` becomes the template's ``reasoning_effort``, as
    vLLM passes it; ``summary`` is accepted."""
    if raw is None:
        return {}
    if not isinstance(raw, dict) or set(raw) - {"effort", "summary", "generate_summary"}:
        raise OpenAIError(
            "'reasoning' must be an object with 'effort' (and 'summary')", param="reasoning"
        )
    effort = raw.get("effort")
    if effort is not None and effort not in REASONING_EFFORTS:
        raise OpenAIError(
            f"reasoning.effort must be one of {list(REASONING_EFFORTS)}, got {effort!r}",
            param="reasoning.effort",
        )
    for key in ("summary", "generate_summary"):
        if raw.get(key) not in _SUMMARIES:
            raise OpenAIError(
                f"reasoning.{key} must be one of {list(_SUMMARIES)}", param=f"reasoning.{key}"
            )
    return raw


def logprobs(body: dict[str, Any]) -> tuple[int, bool]:
    """``top_logprobs`` (0-20) and whether the output text's logprobs are answered: asked
    by ``top_logprobs`` > 0 or by ``include``'s ``message.output_text.logprobs`` (any other
    ``include`` value is refused, naming it)."""
    top = body.get("top_logprobs")
    if top is not None and (
        isinstance(top, bool) or not isinstance(top, int) or not 0 <= top <= MAX_TOP_LOGPROBS
    ):
        raise OpenAIError(
            f"'top_logprobs' must be an integer from 0 to {MAX_TOP_LOGPROBS}, got {top!r}",
            param="top_logprobs",
        )
    include = body.get("include")
    if include is None:
        include = []
    if not isinstance(include, list) or len(include) > len(INCLUDABLE) + 8:
        raise OpenAIError("'include' must be a short list of strings", param="include")
    for value in include:
        if value not in INCLUDABLE:
            raise OpenAIError(
                f"'include' value {str(value)[:80]!r} is not supported by kiln (it answers "
                f"{', '.join(INCLUDABLE)})",
                param="include",
            )
    return top or 0, bool(top) or bool(include)


#: chat's names of the fields a Responses request sets, and the Responses API's names
_NAMES = (
    (re.compile(r"\bmax_completion_tokens\b"), "max_output_tokens"),
    (re.compile(r"\bresponse_format\b"), "text.format"),
    (re.compile(r"\btools\[(\d+)\]\.function\b"), r"tools[\1]"),
    (re.compile(r"\bmessages\b"), "input"),
)


def renamed(exc: OpenAIError) -> OpenAIError:
    """An error of the chat path, naming the Responses API's fields (its ``input`` items
    may be counted differently from chat's messages: instructions and grouped calls)."""
    message, param = exc.message, exc.param
    for pattern, name in _NAMES:
        message = pattern.sub(name, message)
        param = pattern.sub(name, param) if param is not None else None
    return OpenAIError(message, exc.status, param=param, code=exc.code, type_=exc.type)


def response_format_echo(text: Any) -> dict[str, Any]:
    fmt = text.get("format") if isinstance(text, dict) else None
    return fmt if isinstance(fmt, dict) else {"type": "text"}
