"""The Responses API's pieces that need no server: the bounded response store, the input
items read into chat messages, and output items written from a chat message."""

from __future__ import annotations

import pytest

from kiln.frontends.openai.protocol import OpenAIError
from kiln.frontends.openai.response_items import output_items
from kiln.frontends.openai.response_store import ResponseStore
from kiln.frontends.openai.responses import ResponsesCall


def _response(rid: str, text: str = "") -> dict[str, object]:
    return {"id": rid, "output": text}


def test_the_store_forgets_the_least_recently_used_past_its_count() -> None:
    store = ResponseStore(max_count=3, max_bytes=1 << 20)
    for i in range(3):
        store.put(_response(f"r{i}"), [{"role": "user", "content": str(i)}])
    store.get("r0")  # used: r1 is now the oldest
    store.put(_response("r3"), [])
    assert len(store) == 3
    with pytest.raises(OpenAIError) as err:
        store.get("r1")
    assert err.value.status == 404
    assert store.conversation("r0") == [{"role": "user", "content": "0"}]


def test_the_store_is_bounded_in_bytes() -> None:
    store = ResponseStore(max_count=100, max_bytes=10_000)
    for i in range(10):
        store.put(_response(f"r{i}", "x" * 3000), [])
    assert len(store) == 3  # three of ~3 kB fit in 10 kB
    store.put(_response("huge", "x" * 20_000), [])  # larger than the store: not kept
    assert len(store) == 3
    with pytest.raises(OpenAIError):
        store.get("huge")
    assert store.delete("r9") == {"id": "r9", "object": "response.deleted", "deleted": True}
    with pytest.raises(OpenAIError):
        store.delete("r9")


def test_a_missing_previous_response_names_the_field() -> None:
    with pytest.raises(OpenAIError) as err:
        ResponsesCall.read({"model": "m", "input": "hi", "previous_response_id": "x"},
                           ResponseStore())  # fmt: skip
    assert err.value.status == 404 and err.value.param == "previous_response_id"


def test_items_become_chat_messages() -> None:
    call = ResponsesCall.read(
        {
            "model": "m",
            "instructions": "be brief",
            "input": [
                {"role": "user", "content": "weather?"},
                {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
                {"type": "function_call", "call_id": "c2", "name": "g", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
                {"type": "function_call_output", "call_id": "c2",
                 "output": [{"type": "input_text", "text": "12:00"}]},
            ],
            "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}}],
            "tool_choice": {"type": "function", "name": "f"},
            "max_output_tokens": 9,
            "text": {"format": {"type": "json_object"}},
        },
        ResponseStore(),
    )  # fmt: skip
    body = call.chat_body
    assert body["messages"] == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None, "tool_calls": [  # two calls, one turn
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}},
            {"id": "c2", "type": "function", "function": {"name": "g", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "c2", "content": "12:00"},
    ]  # fmt: skip
    assert body["tools"] == [
        {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    ]
    assert body["tool_choice"] == {"type": "function", "function": {"name": "f"}}
    assert body["max_completion_tokens"] == 9
    assert body["response_format"] == {"type": "json_object"}
    assert call.conversation == body["messages"][1:]  # without the instructions


def test_output_items() -> None:
    calls = [{"id": "call1", "function": {"name": "f", "arguments": "{}"}}]
    items = output_items({"content": None, "tool_calls": calls}, ["fc_1"])
    assert items == [{"type": "function_call", "id": "fc_1", "call_id": "call1", "name": "f",
                      "arguments": "{}", "status": "completed"}]  # fmt: skip
    (message,) = output_items({"content": ""})  # an empty answer is still a message
    assert message["type"] == "message" and message["content"][0]["text"] == ""
    both = output_items({"content": "ok", "tool_calls": calls})
    assert [i["type"] for i in both] == ["message", "function_call"]


def test_too_many_input_items_are_refused_before_they_are_read() -> None:
    """Counted before the loop that reads each item (chat's bound, on the Responses field)."""
    from kiln.frontends.openai.chat_input import MAX_MESSAGES

    items = [{"role": "user", "content": "x"}] * (MAX_MESSAGES + 1)
    with pytest.raises(OpenAIError) as err:
        ResponsesCall.read({"model": "m", "input": items}, ResponseStore())
    assert err.value.param == "input" and str(MAX_MESSAGES) in err.value.message


def test_reasoning_effort_goes_to_the_chat_template_and_is_echoed() -> None:
    store = ResponseStore()
    call = ResponsesCall.read(
        {"model": "m", "input": "hi", "reasoning": {"effort": "low", "summary": "auto"}}, store
    )
    assert call.chat_body["reasoning_effort"] == "low"
    assert call.skeleton("resp_1", "m", "in_progress")["reasoning"] == {
        "effort": "low",
        "summary": None,
    }
    plain = ResponsesCall.read({"model": "m", "input": "hi"}, store)
    assert "reasoning_effort" not in plain.chat_body
    assert plain.skeleton("resp_2", "m", "completed")["reasoning"] is None


def test_chat_template_options_take_reasoning_effort() -> None:
    from kiln.frontends.openai.chat_input import chat_template_options

    kw = chat_template_options({"reasoning_effort": "high"})["template_kwargs"]
    assert kw == {"reasoning_effort": "high", "enable_thinking": True}
    kw = chat_template_options({"reasoning_effort": "none"})["template_kwargs"]
    assert kw == {"reasoning_effort": "none", "enable_thinking": False}
    # the client's own enable_thinking wins, as in vLLM
    body = {"reasoning_effort": "high", "chat_template_kwargs": {"enable_thinking": False}}
    assert chat_template_options(body)["template_kwargs"]["enable_thinking"] is False
    for bad in ("extreme", 3, ["low"]):
        with pytest.raises(OpenAIError) as info:
            chat_template_options({"reasoning_effort": bad})
        assert info.value.param == "reasoning_effort"


def test_a_response_stored_again_replaces_its_bytes() -> None:
    """A background response is stored when queued and again when done: the first
    entry's bytes are given back, so the store does not fill with ghosts."""
    store = ResponseStore(max_count=100, max_bytes=10_000)
    for _ in range(50):  # far past the bound if each put added its size again
        store.put(_response("r1", "x" * 3000), [])
    store.put(_response("r2", "y" * 3000), [])
    assert len(store) == 2 and store.get("r1")["output"] == "x" * 3000
