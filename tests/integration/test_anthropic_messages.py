"""Anthropic's Messages API (``/v1/messages``), as vLLM serves it, driven by the real
``anthropic`` client: answers equal the chat completions answer of the same conversation
(the same template, the same tokens), streamed events reassemble to the whole answer, tool
blocks go both ways, count_tokens counts what chat renders, and bad input is answered in
Anthropic's error shape with its status."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

anthropic = pytest.importorskip("anthropic")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("llguidance")

from tests.conftest import KilnProcess  # noqa: E402
from tests.integration.test_openai_tools import TEMPLATE, WEATHER  # noqa: E402
from tests.llm_models import tool_calling_repository  # noqa: E402

#: the client (2.x) has no sampling arguments any more: sent as extra fields, as vLLM reads
#: them (and chat's GREEDY below)
GREEDY: dict[str, Any] = {"extra_body": {"temperature": 0}}
#: random weights love whitespace: with it allowed a JSON value never ends (vLLM's option)
COMPACT: dict[str, Any] = {
    "extra_body": {"temperature": 0, "structured_outputs": {"disable_any_whitespace": True}}
}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KilnProcess]:
    repo = tool_calling_repository(tmp_path_factory.mktemp("messages"), TEMPLATE)
    proc = KilnProcess(repo).start(timeout=180)
    yield proc
    proc.stop()


@pytest.fixture
def client(server: KilnProcess) -> Any:
    return anthropic.Anthropic(
        base_url=f"http://{server.http_url}", api_key="unused", max_retries=0
    )


@pytest.fixture
def chat(server: KilnProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://{server.http_url}/v1", api_key="unused", max_retries=0)


def test_a_message_is_the_chat_answer_of_the_same_conversation(
    client: Any, chat: openai.OpenAI
) -> None:
    said = client.messages.create(
        model="plain", max_tokens=12, system="be brief",
        messages=[{"role": "user", "content": "the quick brown fox"}], **GREEDY,
    )  # fmt: skip
    same = chat.chat.completions.create(
        model="plain", max_tokens=12, temperature=0,
        messages=[{"role": "system", "content": "be brief"},
                  {"role": "user", "content": "the quick brown fox"}],
    )  # fmt: skip
    assert said.type == "message" and said.role == "assistant" and said.id.startswith("msg_")
    assert said.model == "plain"
    [block] = said.content
    assert block.type == "text" and block.text == same.choices[0].message.content
    assert said.stop_reason == "max_tokens" and said.stop_sequence is None
    assert same.usage is not None
    assert said.usage.input_tokens + (said.usage.cache_read_input_tokens or 0) == (
        same.usage.prompt_tokens
    )
    assert said.usage.output_tokens == same.usage.completion_tokens == 12
    # text blocks render as chat's text parts do (joined by newlines), a system given as
    # blocks as its string
    parts = [{"type": "text", "text": "the quick"}, {"type": "text", "text": "brown fox"}]
    blocks = client.messages.create(
        model="plain", max_tokens=12, system=[{"type": "text", "text": "be brief"}],
        messages=[{"role": "user", "content": parts}], **GREEDY,
    )  # fmt: skip
    as_parts = chat.chat.completions.create(
        model="plain", max_tokens=12, temperature=0,
        messages=[{"role": "system", "content": "be brief"},
                  {"role": "user", "content": parts}],  # type: ignore[list-item]
    )  # fmt: skip
    assert blocks.content[0].text == as_parts.choices[0].message.content


def test_a_stop_sequence_is_named(client: Any) -> None:
    free = client.messages.create(
        model="plain", max_tokens=16, messages=[{"role": "user", "content": "hi"}], **GREEDY
    )
    text = free.content[0].text
    stop = text[3:6]
    cut = client.messages.create(
        model="plain", max_tokens=16, stop_sequences=[stop],
        messages=[{"role": "user", "content": "hi"}], **GREEDY,
    )  # fmt: skip
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
    assert cut.content[0].text == text[: text.find(stop)]


def test_streamed_events_reassemble_to_the_whole_message(client: Any) -> None:
    kw: dict[str, Any] = dict(
        model="plain", max_tokens=10, messages=[{"role": "user", "content": "hello"}], **GREEDY
    )
    whole = client.messages.create(**kw)
    with client.messages.stream(**kw) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert "content_block_start" in kinds and "message_delta" in kinds
    assert [b.text for b in final.content] == [b.text for b in whole.content]
    assert final.stop_reason == whole.stop_reason == "max_tokens"
    assert final.usage.output_tokens == 10


def test_a_named_tool_is_called_and_its_result_goes_back(client: Any) -> None:
    tools = [{"name": "get_weather", "description": "weather", "input_schema": WEATHER}]
    messages: list[dict[str, Any]] = [{"role": "user", "content": "weather in paris?"}]
    called = client.messages.create(
        model="tools", max_tokens=64, tools=tools, messages=messages,
        tool_choice={"type": "tool", "name": "get_weather"}, **COMPACT,
    )  # fmt: skip
    [use] = [b for b in called.content if b.type == "tool_use"]
    assert called.stop_reason == "tool_use" and use.name == "get_weather"
    assert use.input["city"] in ("paris", "rome", "oslo") and 1 <= use.input["days"] <= 7
    with client.messages.stream(
        model="tools", max_tokens=64, tools=tools, messages=messages,
        tool_choice={"type": "tool", "name": "get_weather"}, **COMPACT,
    ) as stream:  # fmt: skip
        streamed = stream.get_final_message()
    [streamed_use] = [b for b in streamed.content if b.type == "tool_use"]
    assert streamed_use.input == use.input and streamed.stop_reason == "tool_use"
    # the call and its result, sent back, render as chat's tool turns do
    messages += [
        {"role": "assistant", "content": [use.model_dump()]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                      "content": [{"type": "text", "text": "sunny"}]}]},
    ]  # fmt: skip
    counted = client.messages.count_tokens(model="tools", tools=tools, messages=messages)
    assert counted.input_tokens > 0
    follow = client.messages.create(model="tools", max_tokens=4, tools=tools,
                                    messages=messages, **GREEDY)  # fmt: skip
    assert follow.usage.input_tokens + (follow.usage.cache_read_input_tokens or 0) == (
        counted.input_tokens
    )


def test_count_tokens_counts_what_chat_renders(
    client: Any, chat: openai.OpenAI, server: KilnProcess
) -> None:
    counted = client.messages.count_tokens(
        model="plain", system="be brief", messages=[{"role": "user", "content": "hello"}]
    )
    rendered = httpx.post(
        f"http://{server.http_url}/tokenize",
        json={"model": "plain", "messages": [{"role": "system", "content": "be brief"},
                                             {"role": "user", "content": "hello"}]},
        timeout=30,
    ).json()  # fmt: skip
    assert counted.input_tokens == rendered["count"]


@pytest.mark.parametrize(
    ("body", "status", "kind", "says"),
    [
        ({"model": "plain", "messages": [{"role": "user", "content": "hi"}]}, 400,
         "invalid_request_error", "'max_tokens' is required"),
        ({"model": "nope", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]},
         404, "not_found_error", "nope"),
        ({"model": "plain", "max_tokens": 4, "messages": []}, 400, "invalid_request_error",
         "'messages' must be a non-empty list"),
        ({"model": "plain", "max_tokens": 4, "messages": [{"role": "user", "content": [
            {"type": "image", "source": {"type": "url", "url": "http://x/y.png"}}]}]},
         400, "invalid_request_error", "messages[0].content[0]: kiln serves text"),
        ({"model": "plain", "max_tokens": 4, "messages": [{"role": "robot", "content": "x"}]},
         400, "invalid_request_error", "messages[0] must be an object with a 'role'"),
        ({"model": "plain", "max_tokens": 4000, "thinking": {"type": "enabled",
          "budget_tokens": 10}, "messages": [{"role": "user", "content": "x"}]},
         400, "invalid_request_error", "budget_tokens must be an integer of at least 1024"),
        ({"model": "plain", "max_tokens": 4, "tool_choice": {"type": "some"},
          "messages": [{"role": "user", "content": "x"}]},
         400, "invalid_request_error", "'tool_choice' must be an object"),
    ],
)  # fmt: skip
def test_bad_requests_get_anthropics_error_shape(
    server: KilnProcess, body: dict[str, Any], status: int, kind: str, says: str
) -> None:
    got = httpx.post(f"http://{server.http_url}/v1/messages", json=body, timeout=30)
    assert got.status_code == status, got.text
    error = got.json()
    assert error["type"] == "error" and error["error"]["type"] == kind
    assert says in error["error"]["message"]


def test_the_client_raises_its_own_errors(client: Any) -> None:
    with pytest.raises(anthropic.NotFoundError):
        client.messages.create(
            model="nope", max_tokens=4, messages=[{"role": "user", "content": "hi"}]
        )
    with pytest.raises(anthropic.BadRequestError) as info:
        client.messages.create(
            model="plain", max_tokens=4, messages=[{"role": "user", "content": "hi"}],
            extra_body={"temperature": -1},
        )  # fmt: skip
    assert "temperature" in json.dumps(info.value.body)
