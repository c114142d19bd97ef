"""Tool calling's settings and request checks: vLLM's ``--enable-auto-tool-choice`` and
``--tool-call-parser`` as flags and as config.pbtxt parameters (refused as vLLM refuses
them), the schema ``required`` constrains to, and the tool turns made ready for the
chat template."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import click
import pytest
from google.protobuf import text_format

pytest.importorskip("jsonschema")

from kiln.cli.llm_options import served_models
from kiln.config.model_config_pb2 import ModelConfig
from kiln.core.errors import KilnError
from kiln.frontends.openai.protocol import OpenAIError
from kiln.frontends.openai.tools import (
    _required_schema,
    template_messages,
    tool_message,
    tool_request,
)
from kiln.llm.backend import tool_calling


def _config(**parameters: str) -> ModelConfig:
    text = 'name: "m" backend: "llm"\n' + "".join(
        f'parameters {{ key: "{k}" value {{ string_value: "{v}" }} }}\n'
        for k, v in parameters.items()
    )
    return text_format.Parse(text, ModelConfig())


def test_parameters_as_vllm_flags() -> None:
    assert tool_calling(_config()) == (False, None)
    assert tool_calling(_config(enable_auto_tool_choice="true", tool_call_parser="hermes")) == (
        True,
        "hermes",
    )
    assert tool_calling(_config(tool_call_parser="pythonic")) == (False, "pythonic")


@pytest.mark.parametrize(
    ("parameters", "words"),
    [
        ({"enable_auto_tool_choice": "true"}, "needs tool_call_parser"),
        ({"tool_call_parser": "granite"}, "'granite' is not one kiln has"),
        ({"enable_auto_tool_choice": "maybe", "tool_call_parser": "hermes"}, "true or false"),
    ],
)
def test_bad_parameters_are_refused_at_load(parameters: dict[str, str], words: str) -> None:
    with pytest.raises(KilnError, match=words):
        tool_calling(_config(**parameters))


def test_cli_flags_become_parameters(tmp_path: Path) -> None:
    settings = {"enable_auto_tool_choice": True, "tool_call_parser": "mistral"}
    (config,) = served_models((tmp_path,), (), settings)
    assert config.parameters["enable_auto_tool_choice"].string_value == "true"
    assert config.parameters["tool_call_parser"].string_value == "mistral"
    with pytest.raises(click.BadParameter, match="--tool-call-parser"):
        served_models((), (), settings)


class _Model:
    model_name = "m"
    tool_parser_invocations = None

    def __init__(self, auto: bool, parser: str | None) -> None:
        self.enable_auto_tool_choice, self.tool_call_parser = auto, parser


TOOLS = [
    {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}},
    {"type": "function", "function": {"name": "g"}},
]


def test_choices() -> None:
    auto = _Model(True, "hermes")
    assert tool_request({}, auto) is None
    assert tool_request({"tool_choice": "none"}, auto) is None
    req = tool_request({"tools": TOOLS}, auto)
    assert req is not None and req.choice == "auto" and req.parser is not None
    assert req.parser.name == "hermes" and req.constraint is None
    req = tool_request({"tools": TOOLS, "tool_choice": "none"}, _Model(False, None))
    assert req is not None and req.parser is None and req.tools == TOOLS  # rendered, not read
    # required with no tools asks for nothing (OpenAI's rule)
    assert tool_request({"tools": [], "tool_choice": "required"}, auto) is None
    named = {"type": "function", "function": {"name": "g"}}
    req = tool_request({"tools": TOOLS, "tool_choice": named}, _Model(False, None))
    assert req is not None and req.constraint is not None
    assert req.constraint.param == "tools[1].function.parameters"
    assert json.loads(req.constraint.spec)["additionalProperties"] is False  # no parameters


def test_required_schema_is_vllms() -> None:
    schema: dict[str, Any] = _required_schema(TOOLS, parallel=True)
    assert schema["type"] == "array" and schema["minItems"] == 1 and "maxItems" not in schema
    first = schema["items"]["anyOf"][0]
    assert first["properties"]["name"] == {"type": "string", "enum": ["f"]}
    assert first["properties"]["parameters"] == {"type": "object"}
    assert first["required"] == ["name", "parameters"]
    assert _required_schema(TOOLS, parallel=False)["maxItems"] == 1


def test_required_keeps_the_structured_outputs_options() -> None:
    body = {
        "tools": TOOLS,
        "tool_choice": "required",
        "structured_outputs": {"disable_any_whitespace": True},
    }
    req = tool_request(body, _Model(False, None))
    assert req is not None and req.constraint is not None
    assert req.constraint.disable_any_whitespace and req.constraint.param == "tools"


def test_template_messages_parse_arguments_and_need_call_ids() -> None:
    messages = [
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}},
            {"id": "2", "type": "function", "function": {"name": "g", "arguments": ""}},
        ]},
        {"role": "tool", "tool_call_id": "1", "content": "ok"},
    ]  # fmt: skip
    out = template_messages(messages)
    assert [c["function"]["arguments"] for c in out[0]["tool_calls"]] == [{"a": 1}, {}]
    assert messages[0]["tool_calls"][0]["function"]["arguments"] == '{"a": 1}'  # not changed
    with pytest.raises(OpenAIError) as info:
        template_messages([{"role": "tool", "content": "ok", "tool_call_id": ""}])
    assert info.value.param == "messages[0].tool_call_id"


def test_whole_answer_message_and_finish_reason() -> None:
    req = tool_request({"tools": TOOLS}, _Model(True, "hermes"))
    assert req is not None
    text = 'hi <tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>'
    message, reason = tool_message(req, "assistant", text, "stop")
    assert reason == "tool_calls" and message["content"] == "hi "
    assert message["tool_calls"][0]["function"] == {"name": "f", "arguments": '{"a": 1}'}
    message, reason = tool_message(req, "assistant", "no call", "length")
    assert (message, reason) == ({"role": "assistant", "content": "no call"}, "length")


def test_the_number_of_tools_is_bounded() -> None:
    """Each tool is checked as JSON Schema on the event loop: OpenAI's 128 at most."""
    from kiln.frontends.openai.protocol import OpenAIError
    from kiln.frontends.openai.tools import MAX_TOOLS, check_tools

    def tool(i: int) -> dict[str, object]:
        return {"type": "function", "function": {"name": f"f{i}", "parameters": {}}}

    assert len(check_tools({"tools": [tool(i) for i in range(MAX_TOOLS)]})) == MAX_TOOLS
    with pytest.raises(OpenAIError) as err:
        check_tools({"tools": [tool(i) for i in range(MAX_TOOLS + 1)]})
    assert err.value.param == "tools" and "at most 128" in err.value.message
