"""The tool-call parsers (vLLM's ``--tool-call-parser`` formats): each family's text gives
its calls and content; the same text fed in pieces cut anywhere (one character at a time,
inside markers, escapes and names) streams deltas that reassemble to exactly the whole
text's answer; text that is not a valid call stays content."""

from __future__ import annotations

import json
from typing import Any

import pytest

from kiln.frontends.openai.tool_parsers import (
    PARSERS,
    NamedCall,
    RequiredCalls,
    ToolCallStream,
    ToolParser,
)
from kiln.llm.config import TOOL_CALL_PARSERS

HERMES = (
    "Let me check.\n<tool_call>\n"
    '{"name": "get_weather", "arguments": {"city": "Paris \\"FR\\"", "days": [1, 2]}}\n'
    "</tool_call>\n<tool_call>\n"
    '{"arguments": {"tz": "CET", "nested": {"a": "}]"}}, "name": "get_time"}\n</tool_call>'
)
MISTRAL = (
    'Sure. [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris \\"FR\\"", '
    '"days": [1, 2]}}, {"name": "get_time", "arguments": {"tz": "CET", "nested": {"a": "}]"}}}]'
)
MISTRAL_V11 = (
    '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris \\"FR\\"", "days": [1, 2]}'
    '[TOOL_CALLS]get_time[ARGS]{"tz": "CET", "nested": {"a": "}]"}}'
)
LLAMA3 = (
    '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris \\"FR\\"", '
    '"days": [1, 2]}}; {"name": "get_time", "arguments": {"tz": "CET", "nested": {"a": "}]"}}}'
)
PYTHONIC = (
    "[get_weather(city='Paris \"FR\"', days=[1, 2]), get_time(tz=\"CET\", nested={'a': '}]'})]"
)
QWEN3_XML = (
    'Let me check.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis "FR"\n'
    "</parameter>\n<parameter=days>\n[1, 2]\n</parameter>\n</function>\n</tool_call>\n"
    "<tool_call>\n<function=get_time>\n<parameter=tz>\nCET\n</parameter>\n"
    '<parameter=nested>\n{"a": "}]"}\n</parameter>\n</function>\n</tool_call>'
)
PHI4 = (
    'functools[{"name": "get_weather", "arguments": {"city": "Paris \\"FR\\"", "days": [1, 2]}}, '
    '{"name": "get_time", "parameters": {"tz": "CET", "nested": {"a": "}]"}}}]'
)
WEATHER = {"city": 'Paris "FR"', "days": [1, 2]}
TIME = {"tz": "CET", "nested": {"a": "}]"}}
CASES = [
    ("hermes", HERMES, "Let me check.\n"),
    ("mistral", MISTRAL, "Sure. "),
    ("mistral", MISTRAL_V11, ""),
    ("llama3_json", LLAMA3, ""),
    ("pythonic", PYTHONIC, ""),
    ("pythonic", f"<|python_start|>{PYTHONIC}<|python_end|>", ""),
    ("qwen3_xml", QWEN3_XML, "Let me check.\n"),
    ("qwen3_coder", QWEN3_XML, "Let me check.\n"),
    ("qwen3_json", HERMES, "Let me check.\n"),
    ("phi4_mini_json", PHI4, ""),
    ("phi4_mini_json", "Sure: " + PHI4, "Sure: "),
]


def _whole(parser: ToolParser, text: str) -> tuple[str, list[tuple[str | None, Any]]]:
    parsed = parser.parse(text, final=True)
    return parsed.content, [(c.name, json.loads(c.arguments)) for c in parsed.calls]


def _streamed(
    parser: ToolParser, text: str, step: int, max_calls: int | None = None
) -> tuple[str, list[dict[str, Any]]]:
    """Content and calls reassembled from the deltas of ``text`` fed ``step`` characters
    at a time, as a client (the ``openai`` SDK) accumulates them."""
    stream = ToolCallStream(parser, max_calls)
    content, calls = "", {}
    pieces = [text[i : i + step] for i in range(0, len(text), step)]
    for i, piece in enumerate([*pieces, ""]):
        part, deltas = stream.feed(piece, final=i == len(pieces))
        content += part
        for d in deltas:
            call = calls.setdefault(d["index"], {"id": None, "name": None, "arguments": ""})
            if "id" in d:
                assert call["id"] is None, "a call's header goes out once"
                assert d["type"] == "function" and d["function"]["arguments"] == ""
                call["id"], call["name"] = d["id"], d["function"]["name"]
            else:
                assert call["id"] is not None, "arguments come after the call's header"
            call["arguments"] += d["function"]["arguments"]
    return content, [calls[i] for i in sorted(calls)]


def test_every_parser_name_the_engine_accepts_has_a_parser() -> None:
    assert set(PARSERS) == set(TOOL_CALL_PARSERS)


@pytest.mark.parametrize(("name", "text", "content"), CASES)
def test_whole_text(name: str, text: str, content: str) -> None:
    assert _whole(PARSERS[name](), text) == (
        content,
        [("get_weather", WEATHER), ("get_time", TIME)],
    )


@pytest.mark.parametrize(("name", "text", "content"), CASES)
@pytest.mark.parametrize("step", [1, 2, 3, 5, 11])
def test_streamed_deltas_reassemble_to_the_whole_answer(
    name: str, text: str, content: str, step: int
) -> None:
    parser = PARSERS[name]()
    whole = parser.parse(text, final=True)
    got_content, calls = _streamed(parser, text, step)
    assert got_content == whole.content == content
    assert [(c["name"], c["arguments"]) for c in calls] == [
        (c.name, c.arguments) for c in whole.calls
    ]
    assert all(c["id"].startswith("chatcmpl-tool-") or len(c["id"]) == 9 for c in calls)


@pytest.mark.parametrize(("name", "text", "content"), CASES)
def test_parallel_tool_calls_false_keeps_the_first(name: str, text: str, content: str) -> None:
    _, calls = _streamed(PARSERS[name](), text, 4, max_calls=1)
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [("get_weather", WEATHER)]


def test_mistral_ids_are_nine_characters() -> None:
    _, calls = _streamed(PARSERS["mistral"](), MISTRAL, 7)
    assert all(len(c["id"]) == 9 and c["id"].isalnum() for c in calls)


@pytest.mark.parametrize("name", sorted(PARSERS))
@pytest.mark.parametrize(
    "text",
    [
        "The weather in Paris is sunny.",
        "",
        "a < b and [x] {y}",
        '<tool_call>{"nam": "f"}</tool_call>',
        '[TOOL_CALLS] [{"name": 3, "arguments": {}}]',
        "[f(1, 2)]",  # positional arguments
        "[f(a=x)]",  # not a literal
        "[print('hi')",
    ],
)
def test_text_that_is_not_a_call_stays_content(name: str, text: str) -> None:
    """As vLLM: what does not parse as this family's calls is returned as it is, and the
    stream releases all of it by the end."""
    parser = PARSERS[name]()
    parsed = parser.parse(text, final=True)
    if parsed.calls:  # only text in this family's own valid format may be calls
        return
    assert parsed.content == text
    for step in (1, 4):
        assert _streamed(parser, text, step) == (text, [])


def test_a_call_cut_short_is_content_whole_and_started_streamed() -> None:
    """Text cut inside a call (max_tokens): unstreamed, it stays content (vLLM's rule);
    streamed, the call's start has gone out already (vLLM's too) and the choice's
    ``finish_reason: length`` says it is cut."""
    text = '<tool_call>{"name": "f", "arguments": {"a": 1}'
    parser = PARSERS["hermes"]()
    assert parser.parse(text, final=True).calls == []
    words = '{"name": "f", "parameters": {"a": 1}} trailing words'
    assert PARSERS["llama3_json"]().parse(words, final=True).content == words
    content, calls = _streamed(parser, text, 3)
    assert content == ""
    assert [(c["name"], c["arguments"]) for c in calls] == [("f", '{"a": 1}')]


def test_hermes_content_streams_before_the_call_and_holds_a_partial_marker() -> None:
    stream = ToolCallStream(PARSERS["hermes"]())
    assert stream.feed("Hello <tool") == ("Hello ", [])
    assert stream.feed("s are nice") == ("<tools are nice", [])
    content, deltas = stream.feed(' <tool_call>{"name": "f", "arguments": {"a"')
    assert content == " "
    assert deltas[0]["function"] == {"name": "f", "arguments": ""}
    assert deltas[1]["function"] == {"arguments": '{"a"'}
    assert stream.feed(": 1}}</tool_call> ignored", final=True)[1] == [
        {"index": 0, "function": {"arguments": ": 1}"}}
    ]


def test_arguments_stream_as_the_model_writes_them() -> None:
    """Fragments go out while the value is unfinished; trailing whitespace waits (it may be
    inside a string that goes on)."""
    stream = ToolCallStream(PARSERS["hermes"]())
    stream.feed('<tool_call>{"name": "f", "arguments": {"q": "a ')
    _, deltas = stream.feed("b")
    assert deltas == [{"index": 0, "function": {"arguments": " b"}}]


def test_named_call_is_the_answer_itself() -> None:
    parser = NamedCall("get_weather")
    text = ' {"city": "Paris", "days": [1]} '
    assert _whole(parser, text) == ("", [("get_weather", {"city": "Paris", "days": [1]})])
    for step in (1, 3):
        content, calls = _streamed(parser, text, step)
        assert content == ""
        assert [(c["name"], c["arguments"]) for c in calls] == [
            ("get_weather", '{"city": "Paris", "days": [1]}')
        ]


def test_required_calls_array() -> None:
    parser = RequiredCalls()
    text = (
        '[{"name": "get_weather", "parameters": {"city": "Paris"}}, '
        '{"name": "g", "parameters": {}}]'
    )
    assert _whole(parser, text) == ("", [("get_weather", {"city": "Paris"}), ("g", {})])
    for step in (1, 6):
        content, calls = _streamed(parser, text, step)
        assert content == ""
        assert [c["name"] for c in calls] == ["get_weather", "g"]
        assert [json.loads(c["arguments"]) for c in calls] == [{"city": "Paris"}, {}]
    # cut by max_tokens: no calls, the text as content
    assert parser.parse(text[:30], final=True).calls == []


def test_qwen3_xml_values_take_their_schemas_types() -> None:
    """A parameter's raw text becomes what its tool's schema types it as (vLLM's order:
    null, integer, number, boolean, object, array, string); untyped, JSON if it parses."""
    schema = {"type": "object", "properties": {
        "n": {"type": "integer"}, "x": {"type": "number"}, "ok": {"type": "boolean"},
        "code": {"type": "string"}, "maybe": {"type": ["integer", "null"]},
        "pick": {"enum": [1, 2, 3]}, "either": {"anyOf": [{"type": "integer"},
                                                          {"type": "string"}]},
        "obj": {"type": "object"}, "bad_int": {"type": "integer"},
    }}  # fmt: skip
    tools = [{"type": "function", "function": {"name": "f", "parameters": schema}}]
    params = {"n": "3", "x": "2.50", "ok": "True", "code": "007", "maybe": "null",
              "pick": "2", "either": "abc", "obj": '{"k": [1]}', "bad_int": "three",
              "free": "[1, 2]", "inf": "1e999"}  # fmt: skip
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params.items())
    text = f"<tool_call>\n<function=f>\n{body}</function>\n</tool_call>"
    (call,) = PARSERS["qwen3_coder"](tools).parse(text, final=True).calls
    assert json.loads(call.arguments) == {
        "n": 3, "x": 2.5, "ok": True, "code": "007", "maybe": None, "pick": 2,
        "either": "abc", "obj": {"k": [1]}, "bad_int": "three", "free": [1, 2],
        "inf": "1e999",
    }  # fmt: skip
    # a multi-line value keeps its inner newlines; only the framing ones go
    text = "<function=f>\n<parameter=code>\nline 1\nline 2\n</parameter>\n</function>"
    (call,) = PARSERS["qwen3_xml"](tools).parse(text, final=True).calls
    assert json.loads(call.arguments) == {"code": "line 1\nline 2"}
