"""Tool calling on ``/v1/chat/completions``: ``tools``, ``tool_choice`` and
``parallel_tool_calls`` checked (vLLM's rules), the conversation's tool messages made ready
for the chat template, and the answer's text turned into ``tool_calls``.

``auto`` reads the model's own tool-call format with the model's ``tool_call_parser``;
``required`` and a named function constrain the answer with the structured-output engine
(a JSON array of ``{"name", "parameters"}`` as vLLM asks for, or the function's
arguments object), so the calls are valid JSON for their schemas whatever the weights.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial
from typing import TYPE_CHECKING, Any

from kiln.frontends.openai.generation_request import GenerationRequest
from kiln.frontends.openai.protocol import OpenAIError
from kiln.frontends.openai.tool_parsers import (
    PARSERS,
    NamedCall,
    RequiredCalls,
    ToolCallStream,
    ToolParser,
)
from kiln.frontends.openai.tool_parsers.base import call_json
from kiln.llm.params import InvalidField
from kiln.llm.parser_metrics import request_type
from kiln.llm.structured import KINDS, StructuredOutputsParams
from kiln.llm.structured import from_request as structured_outputs

if TYPE_CHECKING:
    from kiln.llm.engine_client import EngineClient

#: a function with no ``parameters`` takes none (OpenAI's rule)
_NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}, "additionalProperties": False}
_NAMED_USAGE = 'send {"type": "function", "function": {"name": "my_function"}}'


@dataclass(frozen=True, slots=True)
class ToolRequest:
    #: the request's tools as sent, for the chat template (``transformers``' ``tools=``)
    tools: list[dict[str, Any]]
    #: ``none``, ``auto``, ``required`` or ``named``
    choice: str
    #: the answer's reader (None: the answer is plain content)
    parser: ToolParser | None
    #: ``parallel_tool_calls``: false keeps the first call only (vLLM's rule)
    parallel: bool = True
    #: ``required`` and named: the answer's JSON schema, for the structured-output engine
    constraint: StructuredOutputsParams | None = None
    #: ``auto``: counts a run of the model's parser, (streaming, found calls)
    #: (``vllm:tool_call_parser_invocations``; None: not counted)
    record: Callable[[bool, bool], None] | None = None

    @property
    def max_calls(self) -> int | None:
        return None if self.parallel else 1

    def stream(self) -> ToolCallStream | None:
        if self.parser is None:
            return None
        return ToolCallStream(self.parser, self.max_calls, self.record)

    def finish_reason(self, called: bool, reason: str | None) -> str | None:
        """vLLM's: ``tool_calls`` when ``auto`` found calls, or ``required``'s calls ended
        normally; a named function's answer keeps the engine's reason (as OpenAI's). A
        streamed choice not yet ended keeps None."""
        if (
            reason is not None
            and called
            and (self.choice == "auto" or (self.choice == "required" and reason == "stop"))
        ):
            return "tool_calls"
        return reason


def _schema_error(schema: Any) -> str | None:
    """Why ``schema`` is not a JSON Schema (its draft's meta-schema says), or None."""
    if not isinstance(schema, dict):
        return "must be a JSON Schema object"
    import jsonschema

    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as exc:
        return f"is not a valid JSON Schema: {exc.message}"
    except RecursionError:  # the meta-schema check recurses with the schema's depth
        return "is nested too deeply"
    return None


#: OpenAI's bound on a request's tools
MAX_TOOLS = 128


def check_tools(body: dict[str, Any]) -> list[dict[str, Any]]:
    """The request's ``tools``, each checked (an empty list when none)."""
    tools = body.get("tools")
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise OpenAIError("'tools' must be a list of tools", param="tools")
    if len(tools) > MAX_TOOLS:
        # each is checked as JSON Schema here, and rendered into the prompt
        raise OpenAIError(
            f"'tools' holds {len(tools)} tools, at most {MAX_TOOLS} (OpenAI's limit)",
            param="tools",
        )
    names: set[str] = set()
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise OpenAIError(
                f"{where}.type must be 'function' (the only tool type)", param=f"{where}.type"
            )
        function = tool.get("function")
        if not isinstance(function, dict):
            raise OpenAIError(f"{where}.function must be an object", param=f"{where}.function")
        name = function.get("name")
        if not isinstance(name, str) or not name:
            raise OpenAIError(
                f"{where}.function.name is required (a non-empty string)",
                param=f"{where}.function.name",
            )
        if name in names:
            raise OpenAIError(
                f"{where}.function.name: two tools are named '{name}'",
                param=f"{where}.function.name",
            )
        names.add(name)
        parameters = function.get("parameters")
        error = None if parameters is None else _schema_error(parameters)
        if error:
            param = f"{where}.function.parameters"
            raise OpenAIError(f"{param} {error}", param=param)
    return tools


def _named(choice: dict[str, Any], tools: list[dict[str, Any]]) -> int:
    """The index of the tool a named ``tool_choice`` picks."""
    function = choice.get("function")
    name = function.get("name") if isinstance(function, dict) else None
    if choice.get("type") != "function" or not isinstance(name, str) or not name:
        raise OpenAIError(f"invalid 'tool_choice': {_NAMED_USAGE}", param="tool_choice")
    for i, tool in enumerate(tools):
        if tool["function"]["name"] == name:
            return i
    known = ", ".join(t["function"]["name"] for t in tools)
    raise OpenAIError(
        f"tool_choice names the function '{name}', which is not one of 'tools' ({known})",
        param="tool_choice",
    )


def _constraint(
    body: dict[str, Any], schema: dict[str, Any], param: str
) -> StructuredOutputsParams:
    """The JSON-schema constraint of ``required`` or a named function, with the request's
    ``structured_outputs`` options (``disable_any_whitespace``...)."""
    try:
        if structured_outputs(body) is not None:
            raise OpenAIError(
                "tool_choice 'required' or a named function constrains the answer to its "
                "tool calls: send no other structured-output constraint (response_format, "
                "guided_*, structured_outputs)",
                param="tool_choice",
            )
        options = body.get("structured_outputs") or {}
        merged: dict[str, Any] = {
            "structured_outputs": {
                **{k: v for k, v in options.items() if k not in KINDS},
                "json": schema,
            },
            "guided_whitespace_pattern": body.get("guided_whitespace_pattern"),
        }
        spec = structured_outputs(merged)
    except InvalidField as exc:
        raise OpenAIError(exc.message, param=exc.field) from None
    assert spec is not None
    return replace(spec, param=param)


def _required_schema(tools: list[dict[str, Any]], parallel: bool) -> dict[str, Any]:
    """vLLM's schema for ``required``: an array of at least one call, each one of the tools'
    names with that tool's parameters."""
    calls = [
        {
            "type": "object",
            "properties": {
                "name": {"type": "string", "enum": [t["function"]["name"]]},
                "parameters": t["function"].get("parameters") or _NO_PARAMETERS,
            },
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }
        for t in tools
    ]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def tool_request(
    body: dict[str, Any], llm: EngineClient, api: str = "Chat Completions"
) -> ToolRequest | None:
    """The request's tool calling (None: no tools and no ``tool_choice``), its checks done;
    ``llm``: the model, whose ``tool_call_parser`` reads ``auto``'s answers; ``api``: the
    API the request came through (its parser runs are counted by it)."""
    tools = check_tools(body)
    parallel = body.get("parallel_tool_calls")
    if parallel is None:
        parallel = True
    if not isinstance(parallel, bool):
        raise OpenAIError("'parallel_tool_calls' must be a boolean", param="parallel_tool_calls")
    choice = body.get("tool_choice")
    if choice is None:
        choice = "auto" if tools else "none"  # OpenAI's default
    elif choice != "none" and body.get("tools") is None:
        raise OpenAIError("When using 'tool_choice', 'tools' must be set", param="tool_choice")
    if choice == "required" and not tools:
        choice = "none"  # OpenAI's rule for an empty list: nothing to call
    if choice == "none":
        return ToolRequest(tools, "none", None, parallel) if tools else None
    if choice == "auto":
        if not llm.enable_auto_tool_choice or llm.tool_call_parser is None:
            raise OpenAIError(
                f"model '{llm.model_name}': \"auto\" tool choice requires "
                "--enable-auto-tool-choice and --tool-call-parser to be set (parameters "
                "enable_auto_tool_choice and tool_call_parser in a config.pbtxt)",
                param="tool_choice",
            )
        counter = llm.tool_parser_invocations
        record = None if counter is None else partial(counter.record, request_type(api))
        parser = PARSERS[llm.tool_call_parser](tools)
        return ToolRequest(tools, "auto", parser, parallel, record=record)
    if choice == "required":
        schema = _required_schema(tools, parallel)
        spec = _constraint(body, schema, "tools")
        return ToolRequest(tools, "required", RequiredCalls(), parallel, spec)
    if not isinstance(choice, dict):
        raise OpenAIError(
            f"'tool_choice' must be 'none', 'auto', 'required' or a function: {_NAMED_USAGE}",
            param="tool_choice",
        )
    index = _named(choice, tools)
    function = tools[index]["function"]
    schema = function.get("parameters") or _NO_PARAMETERS
    spec = _constraint(body, schema, f"tools[{index}].function.parameters")
    return ToolRequest(tools, "named", NamedCall(function["name"]), parallel, spec)


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The conversation as chat templates take it: a ``tool`` message needs its
    ``tool_call_id``; an assistant's ``tool_calls`` have their ``arguments`` (OpenAI's JSON
    text) as objects, as ``transformers``' templates expect them (vLLM does the same)."""
    out = []
    for i, message in enumerate(messages):
        if message["role"] == "tool":
            call_id = message.get("tool_call_id")
            if not isinstance(call_id, str) or not call_id:
                raise OpenAIError(
                    f"messages[{i}]: a 'tool' message needs 'tool_call_id' (the id of the call "
                    "it answers)",
                    param=f"messages[{i}].tool_call_id",
                )
        calls = message.get("tool_calls")
        if calls is None or message["role"] != "assistant":
            out.append(message)
            continue
        if not isinstance(calls, list):
            raise OpenAIError(
                f"messages[{i}].tool_calls must be a list", param=f"messages[{i}].tool_calls"
            )
        parsed = []
        for j, call in enumerate(calls):
            where = f"messages[{i}].tool_calls[{j}]"
            function = call.get("function") if isinstance(call, dict) else None
            if not isinstance(function, dict) or not isinstance(function.get("name"), str):
                raise OpenAIError(
                    f"{where} must be {{'id', 'type': 'function', 'function': {{'name', "
                    "'arguments'}}}",
                    param=f"{where}.function",
                )
            arguments = function.get("arguments") or {}
            if isinstance(arguments, str):
                try:
                    arguments = json.loads(arguments)
                except (json.JSONDecodeError, RecursionError) as exc:
                    raise OpenAIError(
                        f"{where}.function.arguments is not valid JSON: {exc}",
                        param=f"{where}.function.arguments",
                    ) from None
            parsed.append({**call, "function": {**function, "arguments": arguments}})
        out.append({**message, "tool_calls": parsed})
    return out


def apply(req: GenerationRequest, tools: ToolRequest | None) -> None:
    """The request's sampling made ready for its tools: the constraint of ``required`` or
    a named function; the special tokens a parser reads kept in the text."""
    req.tools = tools
    if tools is None:
        return
    if tools.constraint is not None:
        req.params = replace(req.params, structured_outputs=tools.constraint)
    if tools.parser is not None and tools.parser.needs_special_tokens:
        req.skip_special_tokens = False


def tool_message(
    tools: ToolRequest, role: str, text: str, reason: str | None
) -> tuple[dict[str, Any], str | None]:
    """A whole answer's ``message`` and ``finish_reason``."""
    assert tools.parser is not None
    parsed = tools.parser.parse(text, final=True)
    calls = parsed.calls[: tools.max_calls]
    if tools.record is not None:  # vLLM counts a whole answer's run once per choice
        tools.record(False, bool(calls))
    if not calls:
        return {"role": role, "content": parsed.content}, reason
    message = {
        "role": role,
        "content": parsed.content or None,
        "tool_calls": [call_json(c, tools.parser.tool_call_id()) for c in calls],
    }
    return message, tools.finish_reason(True, reason)
