"""Anthropic's Messages API over chat completions: the request's conversion, the answer's,
and the stream's events (thinking, text and tool blocks in turn)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import orjson
import pytest

from kiln.frontends.openai import messages
from kiln.frontends.openai.protocol import OpenAIError


def test_a_conversation_becomes_chat_messages() -> None:
    body = {
        "model": "m", "max_tokens": 8, "stop_sequences": ["##"], "stream": True,
        "system": [{"type": "text", "text": "x-anthropic-billing-header: cc=1;"},
                   {"type": "text", "text": "be brief"}],
        "messages": [
            {"role": "user", "content": "weather?"},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "look it up", "signature": "s"},
                {"type": "text", "text": "checking"},
                {"type": "tool_use", "id": "toolu_1", "name": "get", "input": {"city": "oslo"}},
            ]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1",
                 "content": [{"type": "text", "text": "sunny"}, {"type": "text", "text": "9C"}]},
                {"type": "text", "text": "thanks"},
            ]},
        ],
        "tools": [{"name": "get", "input_schema": {"properties": {"city": {"type": "string"}}}}],
        "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
        "thinking": {"type": "disabled"},
        "extra": 1,  # unknown: ignored (logged once)
    }  # fmt: skip
    chat = messages.chat_body(body)
    assert chat["messages"] == [
        {"role": "system", "content": "be brief"},  # the billing header dropped
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": "checking", "reasoning": "look it up",
         "tool_calls": [{"id": "toolu_1", "type": "function",
                         "function": {"name": "get", "arguments": '{"city": "oslo"}'}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "sunny\n9C"},
        {"role": "user", "content": "thanks"},
    ]  # fmt: skip
    assert chat["tools"] == [{"type": "function", "function": {
        "name": "get", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}
    }}]  # fmt: skip
    assert chat["tool_choice"] == "required" and chat["parallel_tool_calls"] is False
    assert chat["reasoning_effort"] == "none"
    assert (chat["max_tokens"], chat["stop"], chat["stream"]) == (8, ["##"], True)
    assert chat["stream_options"] == {"include_usage": True}
    two = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    parts = messages.chat_body({**body, "messages": [{"role": "user", "content": two}]})
    assert parts["messages"][-1]["content"] == two  # several blocks stay parts, as vLLM's
    named = messages.chat_body({**body, "tool_choice": {"type": "tool", "name": "get"}})
    assert named["tool_choice"] == {"type": "function", "function": {"name": "get"}}
    schema = {"type": "object"}
    formatted = messages.chat_body(
        {**body, "output_config": {"effort": "low", "format": {"type": "json_schema",
                                                              "schema": schema}}}
    )  # fmt: skip
    assert formatted["reasoning_effort"] == "low"
    assert formatted["response_format"]["json_schema"]["schema"] == schema
    thinking = {"type": "enabled", "budget_tokens": 1024}
    assert (
        messages.chat_body({**body, "max_tokens": 2048, "thinking": thinking})[
            "thinking_token_budget"
        ]
        == 1024
    )
    counted = messages.chat_body({"model": "m", "messages": body["messages"]}, count_only=True)
    assert "max_tokens" not in counted and len(counted["messages"]) == 4


@pytest.mark.parametrize(
    ("change", "param"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": True}, "max_tokens"),
        ({"messages": "hi"}, "messages"),
        ({"messages": [{"role": "user", "content": 3}]}, "messages[0].content"),
        ({"messages": [{"role": "user", "content": [{"text": "no type"}]}]},
         "messages[0].content"),
        ({"messages": [{"role": "user", "content": [{"type": "tool_use", "name": "x"}]}]},
         "messages[0].content[0]"),
        ({"messages": [{"role": "assistant", "content": [
            {"type": "tool_use", "name": "x", "input": [1]}]}]}, "messages[0].content[0].input"),
        ({"messages": [{"role": "user", "content": [{"type": "document"}]}]},
         "messages[0].content[0]"),
        ({"system": [{"type": "image"}]}, "system"),
        ({"tools": {"name": "x"}}, "tools"),
        ({"tools": [{"name": "x", "input_schema": "object"}]}, "tools[0]"),
        ({"tool_choice": {"type": "tool"}}, "tool_choice.name"),
        ({"thinking": {"type": "enabled", "budget_tokens": 2048}}, "thinking.budget_tokens"),
        ({"output_config": {"format": {"type": "regex"}}}, "output_config.format"),
        ({"stop_sequences": "##"}, "stop_sequences"),
        ({"stream": "yes"}, "stream"),
        ({"messages": [{"role": "user", "content": [{"type": "text"}] * 4097}]},
         "messages[0].content"),
        ({"messages": [{"role": "user", "content": "x"}] * 4097}, "messages"),
    ],
)  # fmt: skip
def test_bad_requests_name_their_field(change: dict[str, Any], param: str) -> None:
    body = {"model": "m", "max_tokens": 1024, "messages": [{"role": "user", "content": "hi"}]}
    with pytest.raises(OpenAIError) as info:
        messages.chat_body({**body, **change})
    assert info.value.param == param and info.value.status == 400


def test_an_answer_becomes_a_message() -> None:
    answer = {
        "model": "m",
        "choices": [{"finish_reason": "tool_calls", "stop_reason": None, "message": {
            "role": "assistant", "content": "ok", "reasoning": "hmm",
            "tool_calls": [{"id": "c1", "type": "function",
                            "function": {"name": "get", "arguments": '{"a": 1}'}}]}}],
        "usage": {"prompt_tokens": 10, "completion_tokens": 3,
                  "prompt_tokens_details": {"cached_tokens": 4}},
    }  # fmt: skip
    out = messages.message(answer, "msg_1")
    assert [b["type"] for b in out["content"]] == ["thinking", "text", "tool_use"]
    assert out["content"][0]["thinking"] == "hmm" and out["content"][0]["signature"]
    assert out["content"][2] == {"type": "tool_use", "id": "c1", "name": "get", "input": {"a": 1}}
    assert (out["stop_reason"], out["stop_sequence"]) == ("tool_use", None)
    assert out["usage"] == {"input_tokens": 6, "output_tokens": 3, "cache_read_input_tokens": 4}
    empty = {**answer, "choices": [{"finish_reason": "stop", "stop_reason": "##",
                                    "message": {"role": "assistant", "content": ""}}]}  # fmt: skip
    out = messages.message(empty, "msg_2")
    assert out["content"] == [{"type": "text", "text": ""}]
    assert (out["stop_reason"], out["stop_sequence"]) == ("stop_sequence", "##")
    for finish, stopped_by, reason in (("length", None, "max_tokens"), ("stop", 7, "end_turn")):
        choice = {"finish_reason": finish, "stop_reason": stopped_by,
                  "message": {"role": "assistant", "content": "x"}}  # fmt: skip
        assert messages.message({**answer, "choices": [choice]}, "m")["stop_reason"] == reason


def _chunks(*choices: dict[str, Any], usage: dict[str, Any] | None = None) -> list[bytes]:
    head = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "model": "m"}
    out = [b"data: " + orjson.dumps({**head, "choices": [c]}) + b"\n\n" for c in choices]
    out.append(b"data: " + orjson.dumps({**head, "choices": [], "usage": usage}) + b"\n\n")
    out.append(b"data: [DONE]\n\n")
    return out


def _events(raw: list[bytes]) -> list[dict[str, Any]]:
    async def feed() -> AsyncIterator[bytes]:
        for item in raw:
            yield item

    async def collect() -> list[bytes]:
        return [e async for e in messages.events(feed(), "msg_1", "m", 5)]

    out = []
    for event in asyncio.run(collect()):
        head, data = event.decode().rstrip("\n").split("\n")
        parsed = json.loads(data.removeprefix("data: "))
        assert head == f"event: {parsed['type']}"
        out.append(parsed)
    return out


def test_a_stream_becomes_blocks_in_turn() -> None:
    call = {"index": 0, "id": "c1", "type": "function",
            "function": {"name": "get", "arguments": ""}}  # fmt: skip
    raw = _chunks(
        {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None},
        {"index": 0, "delta": {"reasoning": "thin"}, "finish_reason": None},
        {"index": 0, "delta": {"reasoning": "king"}, "finish_reason": None},
        {"index": 0, "delta": {"content": "Sure"}, "finish_reason": None},
        {"index": 0, "delta": {"tool_calls": [call]}, "finish_reason": None},
        {"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {"arguments": '{"a"'}}]},
         "finish_reason": None},
        {"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {"arguments": ": 1}"}}]},
         "finish_reason": "tool_calls", "stop_reason": None},
        usage={"prompt_tokens": 5, "completion_tokens": 9},
    )  # fmt: skip
    events = _events(raw)
    kinds = [(e["type"], e.get("index"), (e.get("delta") or {}).get("type")) for e in events]
    assert kinds == [
        ("message_start", None, None),
        ("content_block_start", 0, None),
        ("content_block_delta", 0, "thinking_delta"),
        ("content_block_delta", 0, "thinking_delta"),
        ("content_block_delta", 0, "signature_delta"),
        ("content_block_stop", 0, None),
        ("content_block_start", 1, None),
        ("content_block_delta", 1, "text_delta"),
        ("content_block_stop", 1, None),
        ("content_block_start", 2, None),
        ("content_block_delta", 2, "input_json_delta"),
        ("content_block_delta", 2, "input_json_delta"),
        ("content_block_stop", 2, None),
        ("message_delta", None, None),
        ("message_stop", None, None),
    ]
    assert events[0]["message"]["usage"] == {"input_tokens": 5, "output_tokens": 0}
    assert events[1]["content_block"] == {"type": "thinking", "thinking": ""}
    assert events[9]["content_block"] == {"type": "tool_use", "id": "c1", "name": "get",
                                          "input": {}}  # fmt: skip
    assert "".join(e["delta"].get("partial_json", "") for e in events[10:12]) == '{"a": 1}'
    assert events[13]["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
    assert events[13]["usage"] == {"input_tokens": 5, "output_tokens": 9}


def test_a_keep_alive_comment_is_a_ping() -> None:
    raw = _chunks({"index": 0, "delta": {"content": "a"}, "finish_reason": "length"})
    events = _events([raw[0], b": keep-alive\n\n", *raw[1:]])
    assert [e["type"] for e in events][:4] == [
        "message_start", "content_block_start", "content_block_delta", "ping"
    ]  # fmt: skip
    assert events[3] == {"type": "ping"}


def test_a_stream_names_its_stop_sequence_and_its_errors() -> None:
    events = _events(_chunks(
        {"index": 0, "delta": {"content": "ab"}, "finish_reason": "stop", "stop_reason": "##"},
        usage={"prompt_tokens": 5, "completion_tokens": 2},
    ))  # fmt: skip
    [delta] = [e for e in events if e["type"] == "message_delta"]
    assert delta["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": "##"}
    failed = _events([b'data: {"error": {"message": "engine died", "type": "server_error"}}\n\n'])
    assert failed[-1] == {"type": "error", "error": {"type": "api_error",
                                                     "message": "engine died"}}  # fmt: skip


def test_error_types_follow_the_status() -> None:
    assert messages.error_body(404, "x")["error"]["type"] == "not_found_error"
    assert messages.error_body(503, "x")["error"]["type"] == "overloaded_error"
    assert messages.error_body(500, "x")["error"]["type"] == "api_error"
    assert messages.error_body(422, "x")["error"]["type"] == "invalid_request_error"
