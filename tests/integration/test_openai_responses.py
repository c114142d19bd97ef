"""OpenAI's Responses API on ``kiln serve``, driven by the real ``openai`` client's
``client.responses``: the answer is the chat completion of the same conversation (token
for token, greedy), whole and streamed (the SDK's typed events reassemble to the whole
answer), ``instructions``, item lists, ``text.format`` (structured outputs), function tools
(named, required and auto with the hermes parser), ``store`` with ``previous_response_id``,
``GET`` and ``DELETE``, and bad input answered 400 naming its field."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("transformers")
pytest.importorskip("llguidance")

from tests.conftest import KilnProcess  # noqa: E402
from tests.integration.test_openai_tools import HERMES_CALL, SCHEMAS, TEMPLATE, TOOLS  # noqa: E402
from tests.llm_models import tool_calling_repository  # noqa: E402

#: the Responses API writes function tools flat
FLAT_TOOLS = [{"type": "function", **t["function"]} for t in TOOLS]
GREEDY: dict[str, Any] = {"temperature": 0, "extra_body": {"ignore_eos": True}}
GREEDY_BODY: dict[str, Any] = {"temperature": 0, "ignore_eos": True}
COMPACT = {"structured_outputs": {"disable_any_whitespace": True}}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KilnProcess]:
    repo = tool_calling_repository(tmp_path_factory.mktemp("responses"), TEMPLATE)
    proc = KilnProcess(repo).start(timeout=180)
    yield proc
    proc.stop()


def _chat(client: openai.OpenAI, messages: list[dict[str, Any]], **kw: Any) -> Any:
    return client.chat.completions.create(model="plain", messages=messages, **kw)  # type: ignore[arg-type]


def test_a_response_is_the_chat_completion_of_its_input(client: openai.OpenAI) -> None:
    reply = client.responses.create(model="plain", input="hello world", max_output_tokens=8,
                                    **GREEDY)  # fmt: skip
    chat = _chat(client, [{"role": "user", "content": "hello world"}], max_tokens=8, **GREEDY)
    assert reply.id.startswith("resp_") and reply.object == "response"
    assert reply.output_text == chat.choices[0].message.content
    (item,) = reply.output
    assert item.type == "message" and item.role == "assistant" and item.id.startswith("msg_")
    # 8 tokens of ignore_eos: cut by max_output_tokens
    assert reply.status == "incomplete"
    assert reply.incomplete_details and reply.incomplete_details.reason == "max_output_tokens"
    assert reply.usage and chat.usage
    assert reply.usage.input_tokens == chat.usage.prompt_tokens
    assert reply.usage.output_tokens == 8
    assert reply.usage.total_tokens == chat.usage.prompt_tokens + 8
    assert reply.max_output_tokens == 8 and reply.temperature == 0
    # a conversation seen before: the prefix cache holds its prompt's full blocks
    long = "kiln serves models with a paged kv cache " * 4
    kw: dict[str, Any] = {"model": "plain", "input": long, "max_output_tokens": 2}
    first = client.responses.create(**kw)
    again = client.responses.create(**kw)
    assert first.usage and first.usage.input_tokens_details.cached_tokens == 0
    assert again.usage and again.usage.input_tokens_details.cached_tokens > 0
    assert again.usage.input_tokens_details.cached_tokens < again.usage.input_tokens


def test_instructions_and_item_lists(client: openai.OpenAI) -> None:
    items = [
        {"role": "user", "content": "the quick brown fox"},
        {"type": "message", "role": "assistant",
         "content": [{"type": "output_text", "text": "jumps over"}]},
        {"role": "user", "content": [{"type": "input_text", "text": "the lazy "},
                                     {"type": "input_text", "text": "dog"}]},
    ]  # fmt: skip
    reply = client.responses.create(
        model="plain", instructions="be brief", input=items, max_output_tokens=6, **GREEDY
    )
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "the quick brown fox"},
        {"role": "assistant", "content": "jumps over"},
        {"role": "user", "content": "the lazy dog"},
    ]
    chat = _chat(client, messages, max_tokens=6, **GREEDY)
    assert reply.output_text == chat.choices[0].message.content
    assert reply.instructions == "be brief"


def test_streamed_events_reassemble_to_the_whole_response(client: openai.OpenAI) -> None:
    kw: dict[str, Any] = dict(model="plain", input="kiln serves", max_output_tokens=10, **GREEDY)
    whole = client.responses.create(**kw)
    events = list(client.responses.create(stream=True, **kw))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]  # fmt: skip
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.incomplete"]  # fmt: skip
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert deltas and "".join(e.delta for e in deltas) == whole.output_text
    item_id = events[2].item.id  # type: ignore[union-attr]
    assert all(e.item_id == item_id for e in deltas)
    final = events[-1].response  # type: ignore[union-attr]
    assert final.output_text == whole.output_text and final.output[0].id == item_id
    assert final.usage and final.usage.output_tokens == 10


def test_previous_response_id_continues_the_conversation(
    client: openai.OpenAI, http: httpx.Client
) -> None:
    first = client.responses.create(
        model="plain", instructions="be brief", input="the quick brown fox",
        max_output_tokens=5, **GREEDY,
    )  # fmt: skip
    second = client.responses.create(
        model="plain", previous_response_id=first.id, input="and the dog?",
        max_output_tokens=5, **GREEDY,
    )  # fmt: skip
    # as OpenAI's: the earlier turns, not the earlier instructions
    messages = [
        {"role": "user", "content": "the quick brown fox"},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "and the dog?"},
    ]
    chat = _chat(client, messages, max_tokens=5, **GREEDY)
    assert second.output_text == chat.choices[0].message.content
    assert second.previous_response_id == first.id
    fetched = client.responses.retrieve(first.id)
    assert fetched.output_text == first.output_text and fetched.id == first.id
    deleted = http.delete(f"/v1/responses/{first.id}").json()
    assert deleted == {"id": first.id, "object": "response.deleted", "deleted": True}
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError) as err:
        client.responses.create(model="plain", previous_response_id=first.id, input="hi")
    assert "previous_response_id" in str(err.value.body)
    # store: true said out loud is the default (chat's rule refusing it does not apply)
    kept = client.responses.create(model="plain", input="hi", max_output_tokens=2, store=True)
    assert client.responses.retrieve(kept.id).id == kept.id
    # store: false keeps nothing
    unkept = client.responses.create(model="plain", input="hi", max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unkept.id)


def test_text_format_json_schema(client: openai.OpenAI) -> None:
    schema = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}},
              "required": ["answer"], "additionalProperties": False}  # fmt: skip
    for seed in (0, 1, 2):
        reply = client.responses.create(
            model="plain", input="is it raining?", max_output_tokens=40, temperature=1.0,
            text={"format": {"type": "json_schema", "name": "answer", "schema": schema}},
            extra_body={"seed": seed, **COMPACT},
        )  # fmt: skip
        assert reply.status == "completed"
        jsonschema.validate(json.loads(reply.output_text), schema)
        assert reply.text and reply.text.format and reply.text.format.type == "json_schema"


def test_a_named_function_is_a_function_call_item(client: openai.OpenAI) -> None:
    reply = client.responses.create(
        model="plain", input="the quick brown fox", tools=FLAT_TOOLS,  # type: ignore[arg-type]
        tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=100,
        temperature=1.0, extra_body={"seed": 3, **COMPACT},
    )  # fmt: skip
    (call,) = reply.output
    assert call.type == "function_call" and call.name == "get_weather"
    assert call.id.startswith("fc_") and call.call_id.startswith("chatcmpl-tool-")
    jsonschema.validate(json.loads(call.arguments), SCHEMAS["get_weather"])
    # the call's output goes back as an item; the conversation renders as chat renders it
    follow = client.responses.create(
        model="plain", previous_response_id=reply.id, max_output_tokens=5,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}],
        **GREEDY,
    )  # fmt: skip
    messages = [
        {"role": "user", "content": "the quick brown fox"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": call.call_id, "type": "function",
             "function": {"name": "get_weather", "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": "sunny"},
    ]  # fmt: skip
    chat = _chat(client, messages, max_tokens=5, **GREEDY)
    assert follow.output_text == chat.choices[0].message.content


def test_auto_tool_calls_whole_and_streamed(client: openai.OpenAI) -> None:
    """The hermes parser reads the model's text (forced by a regex on random weights): a
    message item with the text before the call, then the function_call item."""
    kw: dict[str, Any] = dict(
        model="tools", input="the quick brown fox", tools=FLAT_TOOLS, max_output_tokens=200,
        temperature=1.0, extra_body={"seed": 5, "structured_outputs": {"regex": HERMES_CALL}},
    )  # fmt: skip
    whole = client.responses.create(**kw)
    message, call = whole.output
    assert message.type == "message" and whole.output_text == "Sure."
    assert call.type == "function_call" and call.name == "get_weather"
    jsonschema.validate(json.loads(call.arguments), SCHEMAS["get_weather"])
    events = list(client.responses.create(stream=True, **kw))
    added = [e.item for e in events if e.type == "response.output_item.added"]  # type: ignore[union-attr]
    assert [i.type for i in added] == ["message", "function_call"]
    arguments = "".join(
        e.delta for e in events if e.type == "response.function_call_arguments.delta"
    )
    assert arguments == call.arguments
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert [(e.name, e.arguments) for e in done] == [("get_weather", call.arguments)]
    final = events[-1]
    assert final.type == "response.completed"
    assert [i.type for i in final.response.output] == ["message", "function_call"]
    assert [i.id for i in final.response.output] == [i.id for i in added]


def test_output_text_logprobs_are_the_chat_completions(client: openai.OpenAI) -> None:
    kw: dict[str, Any] = dict(model="plain", input="kiln serves", max_output_tokens=6, **GREEDY)
    reply = client.responses.create(top_logprobs=2, **kw)
    assert reply.top_logprobs == 2
    chat = _chat(client, [{"role": "user", "content": "kiln serves"}], max_tokens=6,
                 logprobs=True, top_logprobs=2, **GREEDY)  # fmt: skip
    want = [e.model_dump() for e in chat.choices[0].logprobs.content]  # type: ignore[union-attr]
    part = reply.output[0].content[0]  # type: ignore[union-attr]
    got = [e.model_dump() for e in part.logprobs]  # type: ignore[union-attr]
    assert len(got) == 6 and [len(e["top_logprobs"]) for e in got] == [2] * 6
    assert [(e["token"], e["bytes"]) for e in got] == [(e["token"], e["bytes"]) for e in want]
    assert [e["logprob"] for e in got] == pytest.approx([e["logprob"] for e in want], abs=1e-4)
    # include: the chosen tokens' logprobs alone; without either, none
    only = client.responses.create(include=["message.output_text.logprobs"], **kw)
    entries = only.output[0].content[0].logprobs  # type: ignore[union-attr]
    assert len(entries) == 6 and all(e.top_logprobs == [] for e in entries)
    assert client.responses.create(**kw).output[0].content[0].logprobs == []  # type: ignore[union-attr]
    # streamed: each text delta carries its tokens' entries, the done event all of them
    events = list(client.responses.create(stream=True, top_logprobs=2, **kw))
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    streamed = [x.model_dump() for e in deltas for x in e.logprobs]  # type: ignore[union-attr]
    assert [x["token"] for x in streamed] == [e["token"] for e in got]
    done = next(e for e in events if e.type == "response.output_text.done")
    assert [x.token for x in done.logprobs] == [e["token"] for e in got]  # type: ignore[union-attr]
    final = events[-1].response  # type: ignore[union-attr]
    assert len(final.output[0].content[0].logprobs) == 6


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"background": True, "store": False}, "background"),
        ({"background": "yes"}, "background"),
        ({"reasoning": "high"}, "reasoning"),
        ({"reasoning": {"effort": "extreme"}}, "reasoning.effort"),
        ({"reasoning": {"summary": "verbose"}}, "reasoning.summary"),
        ({"reasoning": {"effort": "low", "budget": 5}}, "reasoning"),
        ({"input": [{"type": "input_image", "image_url": "file:///etc/passwd"}]}, "input[0].type"),
        ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "x"}]}]},
         "input[0].content"),
        ({"input": [{"role": "wizard", "content": "x"}]}, "input[0].role"),
        ({"input": ""}, "input"),
        ({"input": 5}, "input"),
        ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"metadata": {str(i): "v" for i in range(17)}}, "metadata"),
        ({"metadata": {"k": "v" * 513}}, "metadata"),
        ({"text": {"format": {"type": "xml"}}}, "text.format"),
        ({"store": "yes"}, "store"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
        ({"text": {"format": {"type": "json_schema", "schema": 5}}}, "text.format"),
        ({"tools": [{"type": "function", "name": 5}]}, "tools[0].name"),
        ({"input": [{"role": "user", "content": "x"}] * 5000}, "input"),
        ({"previous_response_id": 5}, "previous_response_id"),
        ({"previous_response_id": ""}, "previous_response_id"),
        ({"stream": "yes"}, "stream"),
        ({"top_logprobs": 21}, "top_logprobs"),
        ({"top_logprobs": -1}, "top_logprobs"),
        ({"top_logprobs": True}, "top_logprobs"),
        ({"include": ["reasoning.encrypted_content"]}, "include"),
        ({"include": "message.output_text.logprobs"}, "include"),
        ({"include": ["message.output_text.logprobs"] * 100}, "include"),
    ],
)  # fmt: skip
def test_bad_requests_are_400_naming_the_field(
    http: httpx.Client, fields: dict[str, Any], param: str
) -> None:
    reply = http.post("/v1/responses", json={"model": "plain", "input": "hi", **fields})
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == param and error["message"], error


def test_unknown_ids_are_404(http: httpx.Client) -> None:
    for method in ("GET", "DELETE"):
        reply = http.request(method, "/v1/responses/resp_nothing")
        assert reply.status_code == 404 and "not found" in reply.json()["error"]["message"]


def test_leaving_a_stream_early_aborts_its_request(
    client: openai.OpenAI, server: KilnProcess
) -> None:
    abort = 'finished_reason="abort"'
    aborted = server.metric("vllm:request_success_total", "plain", abort)
    stream = client.responses.create(model="plain", input="a long story", max_output_tokens=250,
                                     stream=True, **GREEDY)  # fmt: skip
    for i, _ in enumerate(stream):
        if i == 5:
            break
    stream.close()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and server.metric("vllm:num_requests_running", "plain"):
        time.sleep(0.1)
    assert server.metric("vllm:num_requests_running", "plain") == 0
    # aborted, not run to its 250 tokens
    assert server.metric("vllm:request_success_total", "plain", abort) == aborted + 1


def test_reasoning_effort_is_taken_and_echoed(client: openai.OpenAI) -> None:
    reply = client.responses.create(model="plain", input="hi", max_output_tokens=2,
                                    reasoning={"effort": "low"}, **GREEDY)  # fmt: skip
    assert reply.reasoning is not None and reply.reasoning.effort == "low"
    plain = client.responses.create(model="plain", input="hi", max_output_tokens=2, **GREEDY)
    # this model's template reads no reasoning_effort: the same prompt either way
    assert reply.usage and plain.usage and reply.usage.input_tokens == plain.usage.input_tokens


def _until(client: openai.OpenAI, rid: str, statuses: tuple[str, ...]) -> Any:
    deadline = time.monotonic() + 60
    while True:
        got = client.responses.retrieve(rid)
        if got.status in statuses or time.monotonic() > deadline:
            return got
        time.sleep(0.05)


def test_a_background_response_is_fetched_when_done(client: openai.OpenAI) -> None:
    """OpenAI's ``background``: answered at once (queued), run on the server, its result
    read with GET: the same as the response of the same request in the foreground."""
    kw: dict[str, Any] = dict(model="plain", input="hello world", max_output_tokens=8, **GREEDY)
    queued = client.responses.create(background=True, **kw)
    assert queued.background is True and queued.status in ("queued", "in_progress")
    assert queued.output == []
    done = _until(client, queued.id, ("completed", "incomplete", "failed"))
    foreground = client.responses.create(**kw)
    assert done.status == foreground.status == "incomplete"  # cut by max_output_tokens
    assert done.output_text == foreground.output_text
    assert done.usage is not None and done.usage.output_tokens == 8
    # it continues a conversation like any stored response
    follow = client.responses.create(model="plain", input="and?", max_output_tokens=2,
                                     previous_response_id=done.id, **GREEDY)  # fmt: skip
    assert follow.usage and foreground.usage
    assert follow.usage.input_tokens > foreground.usage.input_tokens


def test_cancelling_a_background_response_aborts_it(
    client: openai.OpenAI, server: KilnProcess, http: httpx.Client
) -> None:
    abort = 'finished_reason="abort"'
    aborted = server.metric("vllm:request_success_total", "plain", abort)
    queued = client.responses.create(model="plain", input="a long story", background=True,
                                     max_output_tokens=250, **GREEDY)  # fmt: skip
    _until(client, queued.id, ("in_progress",))
    cancelled = client.responses.cancel(queued.id)
    assert cancelled.status == "cancelled"
    assert client.responses.retrieve(queued.id).status == "cancelled"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and server.metric("vllm:num_requests_running", "plain"):
        time.sleep(0.1)
    assert server.metric("vllm:request_success_total", "plain", abort) == aborted + 1
    # only a response still queued or running can be cancelled
    again = http.post(f"/v1/responses/{queued.id}/cancel")
    assert again.status_code == 400 and again.json()["error"]["param"] == "response_id"
    missing = http.post("/v1/responses/resp_none/cancel")
    assert missing.status_code == 404


def _sse(lines: Any) -> list[dict[str, Any]]:
    return [json.loads(line[6:]) for line in lines if line.startswith("data: ")]


def test_a_streamed_background_response_can_be_read_again(
    http: httpx.Client, client: openai.OpenAI
) -> None:
    """``background`` with ``stream``: the events come to the request that made it, and
    ``GET /v1/responses/{id}?stream=true&starting_after=N`` reads them again from N + 1."""
    body = {"model": "plain", "input": "hello world", "max_output_tokens": 8,
            "background": True, "stream": True, **GREEDY_BODY}  # fmt: skip
    with http.stream("POST", "/v1/responses", json=body) as first:
        assert first.status_code == 200
        events = _sse(first.iter_lines())
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert events[0]["type"] == "response.created" and events[0]["response"]["background"]
    assert events[-1]["type"] in ("response.completed", "response.incomplete")
    rid = events[0]["response"]["id"]
    with http.stream("GET", f"/v1/responses/{rid}?stream=true&starting_after=2") as again:
        assert _sse(again.iter_lines()) == events[3:]
    done = client.responses.retrieve(rid)
    assert done.output_text == events[-1]["response"]["output"][0]["content"][0]["text"]
    for query, param in (("stream=true&starting_after=x", "starting_after"),):
        bad = http.get(f"/v1/responses/{rid}?{query}")
        assert bad.status_code == 400 and bad.json()["error"]["param"] == param
    plain = client.responses.create(model="plain", input="hi", max_output_tokens=2, **GREEDY)
    unstreamed = http.get(f"/v1/responses/{plain.id}?stream=true")
    assert unstreamed.status_code == 400 and unstreamed.json()["error"]["param"] == "stream"
