"""Tool calling through ``kiln serve`` with the real ``openai`` client: ``tool_choice``
``required`` and a named function constrained by the grammar engine (random weights, so
valid calls prove the constraint), ``auto`` read by the hermes parser, whole and streamed
(the deltas reassemble to the same calls), the tools and the conversation's tool turns
rendered by the chat template exactly as ``transformers`` renders them, and bad input
answered 400 naming its field while the requests beside it go on."""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
jsonschema = pytest.importorskip("jsonschema")
transformers = pytest.importorskip("transformers")
pytest.importorskip("llguidance")

from tests.conftest import KilnProcess  # noqa: E402
from tests.llm_models import build_tiny_llm, tool_calling_repository  # noqa: E402

#: a chat template that writes the tools and the tool turns, as tool-calling models' do
TEMPLATE = (
    "{% if tools %}<|system|>tools:{% for t in tools %} {{ t.function.name }}"
    "{{ (t.function.parameters or {}) | tojson }}{% endfor %}</s>{% endif %}"
    "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}"
    '{% for c in m.tool_calls or [] %}<tool_call>{"name": "{{ c.function.name }}", '
    '"arguments": {{ c.function.arguments | tojson }}}</tool_call>{% endfor %}'
    "{% if m.tool_call_id %} [{{ m.tool_call_id }}]{% endif %}</s>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["paris", "rome", "oslo"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
        "unit": {"enum": ["c", "f"]},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"zone": {"type": "string", "pattern": "^[A-Z]{3}$"}},
    "required": ["zone"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "parameters": TIME}},
    {"type": "function", "function": {"name": "ping", "description": "no parameters"}},
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME, "ping": {"type": "object"}}
MESSAGES = [{"role": "user", "content": "the quick brown fox"}]
#: random weights love whitespace: with it allowed a JSON value never ends (vLLM's option)
COMPACT = {"structured_outputs": {"disable_any_whitespace": True}}
#: what a hermes-format model writes, forced on the random weights by a regex
HERMES_CALL = (
    r'Sure\.<tool_call>\{"name": "get_weather", "arguments": '
    r'\{"city": "(paris|rome)", "days": [1-7]\}\}</tool_call>'
)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KilnProcess]:
    """``tools``: auto tool choice with the hermes parser; ``plain``: no auto."""
    repo = tool_calling_repository(tmp_path_factory.mktemp("tools"), TEMPLATE)
    proc = KilnProcess(repo).start(timeout=180)
    yield proc
    proc.stop()


def _check_calls(calls: list[Any]) -> list[tuple[str, Any]]:
    """(name, arguments) of each call, each validated against its tool's schema."""
    out = []
    for call in calls:
        assert call.type == "function"
        assert call.id.startswith("chatcmpl-tool-")
        arguments = json.loads(call.function.arguments)
        jsonschema.validate(arguments, SCHEMAS[call.function.name])
        out.append((call.function.name, arguments))
    return out


def _streamed(client: openai.OpenAI, **kw: Any) -> tuple[str, list[tuple[str, str]], str]:
    """Content, (name, arguments) per call and finish_reason, from the stream's deltas as
    the SDK hands them out."""
    content, calls, reason = "", {}, None
    for chunk in client.chat.completions.create(stream=True, **kw):
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for d in choice.delta.tool_calls or []:
                if d.id is not None:
                    assert d.index not in calls and d.type == "function"
                    calls[d.index] = [d.id, d.function.name, ""]
                calls[d.index][2] += d.function.arguments or ""
            reason = choice.finish_reason or reason
    assert all(c[0].startswith("chatcmpl-tool-") for c in calls.values())
    return content, [(c[1], c[2]) for _, c in sorted(calls.items())], reason or ""


@pytest.mark.parametrize(("temperature", "seed"), [(0.0, None), (1.0, 1), (1.0, 2), (0.8, 3)])
def test_required_returns_calls_valid_for_their_schemas(
    client: openai.OpenAI, temperature: float, seed: int | None
) -> None:
    reply = client.chat.completions.create(
        model="tools",
        messages=MESSAGES,  # type: ignore[arg-type]
        tools=TOOLS,  # type: ignore[arg-type]
        tool_choice="required",
        max_completion_tokens=200,
        temperature=temperature,
        seed=seed,
        extra_body=COMPACT,
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls", choice.message
    assert choice.message.content is None
    assert _check_calls(choice.message.tool_calls or [])


@pytest.mark.parametrize("name", ["get_weather", "get_time", "ping"])
def test_named_function_returns_its_call(client: openai.OpenAI, name: str) -> None:
    for seed in (0, 1, 2):
        reply = client.chat.completions.create(
            model="plain",  # no auto tool choice needed
            messages=MESSAGES,  # type: ignore[arg-type]
            tools=TOOLS,  # type: ignore[arg-type]
            tool_choice={"type": "function", "function": {"name": name}},
            max_completion_tokens=100,
            temperature=1.0,
            seed=seed,
            extra_body=COMPACT,
        )
        choice = reply.choices[0]
        assert choice.finish_reason == "stop"  # OpenAI's (and vLLM's) for a named function
        calls = _check_calls(choice.message.tool_calls or [])
        assert [n for n, _ in calls] == [name]


@pytest.mark.parametrize(
    "choice", ["required", {"type": "function", "function": {"name": "get_weather"}}]
)
def test_streamed_calls_reassemble_to_the_whole_answer(client: openai.OpenAI, choice: Any) -> None:
    kw: dict[str, Any] = dict(
        model="tools",
        messages=MESSAGES,
        tools=TOOLS,
        tool_choice=choice,
        max_completion_tokens=200,
        temperature=0,
        extra_body=COMPACT,
    )
    whole = client.chat.completions.create(**kw).choices[0]
    expected = [(c.function.name, c.function.arguments) for c in whole.message.tool_calls or []]
    content, calls, reason = _streamed(client, **kw)
    assert content == ""
    assert calls == expected and calls
    assert reason == whole.finish_reason


def test_parallel_tool_calls_false_gives_one_call(client: openai.OpenAI) -> None:
    for seed in range(4):
        reply = client.chat.completions.create(
            model="tools",
            messages=MESSAGES,  # type: ignore[arg-type]
            tools=TOOLS,  # type: ignore[arg-type]
            tool_choice="required",
            parallel_tool_calls=False,
            max_completion_tokens=200,
            temperature=1.0,
            seed=seed,
            extra_body=COMPACT,
        )
        assert len(_check_calls(reply.choices[0].message.tool_calls or [])) == 1


def test_auto_reads_the_models_hermes_calls(client: openai.OpenAI) -> None:
    kw: dict[str, Any] = dict(
        model="tools",
        messages=MESSAGES,
        tools=TOOLS,
        max_completion_tokens=200,  # no tool_choice with tools: auto, OpenAI's default
        temperature=1.0,
        seed=5,
        extra_body={"structured_outputs": {"regex": HERMES_CALL}},
    )
    choice = client.chat.completions.create(**kw).choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Sure."
    calls = _check_calls(choice.message.tool_calls or [])
    assert [n for n, _ in calls] == ["get_weather"]
    content, streamed, reason = _streamed(client, **kw)
    assert (content, reason) == ("Sure.", "tool_calls")
    assert streamed == [(c.function.name, c.function.arguments) for c in choice.message.tool_calls]


#: what Qwen3-Coder writes (vLLM's qwen3_coder parser): its values are raw text
XML_CALL = (
    r"Sure\.<tool_call>\n<function=get_weather>\n<parameter=city>\n(paris|rome)\n"
    r"</parameter>\n<parameter=days>\n[1-7]\n</parameter>\n</function>\n</tool_call>"
)


def test_auto_reads_qwen3_coders_xml_calls(client: openai.OpenAI) -> None:
    """The XML call's values become the JSON types its tool's schema says (``days``: an
    integer, which the schema check below needs), whole and streamed alike."""
    kw: dict[str, Any] = dict(
        model="xml-tools", messages=MESSAGES, tools=TOOLS, max_completion_tokens=200,
        temperature=1.0, seed=5, extra_body={"structured_outputs": {"regex": XML_CALL}},
    )  # fmt: skip
    choice = client.chat.completions.create(**kw).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Sure."
    [(name, arguments)] = _check_calls(choice.message.tool_calls or [])
    assert name == "get_weather" and isinstance(arguments["days"], int)
    content, streamed, reason = _streamed(client, **kw)
    assert (content, reason) == ("Sure.", "tool_calls")
    assert streamed == [(c.function.name, c.function.arguments) for c in choice.message.tool_calls]


def test_auto_text_without_calls_is_content(client: openai.OpenAI) -> None:
    kw: dict[str, Any] = dict(
        model="tools",
        messages=MESSAGES,
        tools=TOOLS,
        tool_choice="auto",
        max_completion_tokens=30,
        temperature=0,
    )
    choice = client.chat.completions.create(**kw).choices[0]
    assert not choice.message.tool_calls
    assert choice.finish_reason in ("stop", "length")
    plain = client.chat.completions.create(
        **{**kw, "model": "plain", "tool_choice": "none"}
    ).choices[0]
    # the same weights and prompt: auto's content is the text itself
    assert choice.message.content == plain.message.content
    content, calls, reason = _streamed(client, **kw)
    assert (content, calls, reason) == (choice.message.content, [], choice.finish_reason)


def test_tools_and_tool_turns_render_as_transformers_renders_them(
    client: openai.OpenAI, server: KilnProcess
) -> None:
    messages: list[dict[str, Any]] = [
        {"role": "user", "content": "weather in paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {
                        "name": "get_weather",
                        "arguments": '{"city": "paris", "days": 2}',
                    },
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny <&> 'warm'"},
    ]
    raw = json.loads(json.dumps(messages))
    reply = client.chat.completions.create(
        model="plain",
        messages=messages,  # type: ignore[arg-type]
        tools=TOOLS,  # type: ignore[arg-type]
        tool_choice="none",
        max_completion_tokens=1,
    )
    tok = transformers.PreTrainedTokenizerFast(
        tokenizer_file=str(server.repository / "plain" / "1" / "tokenizer.json")
    )
    for m in messages:  # transformers' templates take the arguments as an object
        for c in m.get("tool_calls") or []:
            c["function"]["arguments"] = json.loads(c["function"]["arguments"])
    text = tok.apply_chat_template(
        messages, tools=TOOLS, chat_template=TEMPLATE, tokenize=False, add_generation_prompt=True
    )
    assert '"enum": ["paris", "rome", "oslo"]' in text and "<&>" in text
    assert reply.usage is not None
    assert reply.usage.prompt_tokens == len(tok.encode(text, add_special_tokens=False))
    # vLLM's /tokenize renders the same prompt
    body = {"model": "plain", "messages": raw, "tools": TOOLS}
    counted = httpx.post(f"http://{server.http_url}/tokenize", json=body, timeout=60)
    assert counted.json()["count"] == reply.usage.prompt_tokens


def test_auto_needs_enable_auto_tool_choice(server: KilnProcess) -> None:
    url = f"http://{server.http_url}/v1/chat/completions"
    base = {"model": "plain", "messages": MESSAGES, "tools": TOOLS, "max_tokens": 4}
    for extra in ({"tool_choice": "auto"}, {}):  # tools alone mean auto
        r = httpx.post(url, json={**base, **extra}, timeout=60)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == "tool_choice"
        assert "--enable-auto-tool-choice" in error["message"] and "plain" in error["message"]
    r = httpx.post(url, json={**base, "tool_choice": "none"}, timeout=60)
    assert r.status_code == 200, r.text
    assert "tool_calls" not in r.json()["choices"][0]["message"]


def _tool(name: Any = "f", **function: Any) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, **function}}


BAD: list[tuple[dict[str, Any], str]] = [
    ({"tools": [{"type": "function", "function": {"description": "x"}}]}, "tools[0].function.name"),
    ({"tools": [_tool(""), _tool("g")]}, "tools[0].function.name"),
    ({"tools": [_tool("g"), {"type": "retrieval", "function": {"name": "f"}}]}, "tools[1].type"),
    ({"tools": [_tool(), _tool()]}, "tools[1].function.name"),
    ({"tools": "f"}, "tools"),
    (
        {"tools": [_tool(parameters={"type": "object", "properties": 5})]},
        "tools[0].function.parameters",
    ),
    ({"tools": [_tool(parameters={"type": "foo"})]}, "tools[0].function.parameters"),
    ({"tools": [_tool(parameters=[1])]}, "tools[0].function.parameters"),
    (
        {"tools": [_tool()], "tool_choice": {"type": "function", "function": {"name": "g"}}},
        "tool_choice",
    ),
    ({"tools": [_tool()], "tool_choice": {"type": "function"}}, "tool_choice"),
    ({"tools": [_tool()], "tool_choice": "sometimes"}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tool_choice": {"type": "function", "function": {"name": "f"}}}, "tool_choice"),
    (
        {"tools": [_tool()], "tool_choice": "required", "parallel_tool_calls": "no"},
        "parallel_tool_calls",
    ),
    (
        {"tools": [_tool()], "tool_choice": "required", "response_format": {"type": "json_object"}},
        "tool_choice",
    ),
    (
        {"messages": [*MESSAGES, {"role": "tool", "content": "42"}]},
        "messages[1].tool_call_id",
    ),
    (
        {
            "messages": [
                *MESSAGES,
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [{"id": "1", "function": {"name": "f", "arguments": "{oops"}}],
                },
            ]
        },
        "messages[1].tool_calls[0].function.arguments",
    ),
    ({"functions": [{"name": "f"}]}, "functions"),
]


@pytest.mark.parametrize(("extra", "param"), BAD)
def test_bad_tool_input_is_400_naming_the_field(
    server: KilnProcess, extra: dict[str, Any], param: str
) -> None:
    url = f"http://{server.http_url}/v1/chat/completions"
    body = {"model": "tools", "messages": MESSAGES, "max_tokens": 4, **extra}
    r = httpx.post(url, json=body, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param, error
    assert error["type"] == "invalid_request_error" and error["message"]


def test_bad_tool_requests_leave_the_others_alone(
    client: openai.OpenAI, server: KilnProcess
) -> None:
    kw: dict[str, Any] = dict(
        model="tools",
        messages=MESSAGES,
        tools=TOOLS,
        tool_choice="required",
        max_completion_tokens=200,
        temperature=0,
        extra_body=COMPACT,
    )
    alone = client.chat.completions.create(**kw).choices[0].message.tool_calls or []
    url = f"http://{server.http_url}/v1/chat/completions"

    def bad(i: int) -> int:
        body = {"model": "tools", "messages": MESSAGES, **BAD[i][0]}
        return httpx.post(url, json=body, timeout=60).status_code

    with ThreadPoolExecutor(6) as pool:
        goods = [pool.submit(client.chat.completions.create, **kw) for _ in range(3)]
        bads = [pool.submit(bad, i) for i in range(3)]
        assert [b.result() for b in bads] == [400, 400, 400]
        for g in goods:
            calls = g.result().choices[0].message.tool_calls or []
            assert [(c.function.name, c.function.arguments) for c in calls] == [
                (c.function.name, c.function.arguments) for c in alone
            ]


def test_cli_flags_serve_auto_tool_choice(tmp_path: Path) -> None:
    """``kiln serve --model FOLDER --enable-auto-tool-choice --tool-call-parser hermes``."""
    folder = build_tiny_llm(tmp_path / "ckpt", max_position_embeddings=1024)
    args = ["--model", str(folder), "--served-model-name", "cli", "--max-model-len", "1024",
            "--kv-cache-memory", "16M", "--enable-auto-tool-choice", "--tool-call-parser",
            "hermes"]  # fmt: skip
    proc = KilnProcess(tmp_path / "repo", args=args, with_repository=False).start(timeout=180)
    try:
        client = openai.OpenAI(
            base_url=f"http://{proc.http_url}/v1", api_key="unused", max_retries=0
        )
        reply = client.chat.completions.create(
            model="cli",
            messages=MESSAGES,  # type: ignore[arg-type]
            tools=TOOLS,  # type: ignore[arg-type]
            max_completion_tokens=100,
            extra_body={"structured_outputs": {"regex": HERMES_CALL}},
        )
        assert reply.choices[0].finish_reason == "tool_calls"
        assert _check_calls(reply.choices[0].message.tool_calls or [])
    finally:
        proc.stop()


def test_a_round_trip_with_the_sdks_own_message(client: openai.OpenAI) -> None:
    """The answer's message goes back into the conversation as the SDK hands it out, with
    the tool's result: the next request renders it and answers."""
    messages: list[Any] = list(MESSAGES)
    reply = client.chat.completions.create(
        model="tools",
        messages=messages,
        tools=TOOLS,  # type: ignore[arg-type]
        tool_choice={"type": "function", "function": {"name": "get_time"}},
        max_completion_tokens=100,
        temperature=0,
        extra_body=COMPACT,
    )
    call = (reply.choices[0].message.tool_calls or [])[0]
    messages += [
        reply.choices[0].message,
        {"role": "tool", "tool_call_id": call.id, "content": "12:00"},
    ]
    final = client.chat.completions.create(
        model="tools", messages=messages, tools=TOOLS, tool_choice="none", max_tokens=5
    )
    assert final.choices[0].message.content is not None
    assert final.usage is not None and final.usage.prompt_tokens > reply.usage.prompt_tokens  # type: ignore[union-attr]


def test_deep_tool_input_is_400_not_a_crash(server: KilnProcess) -> None:
    """Nesting that orjson reads but Python's recursion cannot check: a 400 naming the
    field; deep arguments of a previous call are rendered or refused, never a 500."""
    schema: dict[str, Any] = {"type": "object"}
    for _ in range(150):
        schema = {"type": "object", "properties": {"a": schema}}
    url = f"http://{server.http_url}/v1/chat/completions"
    base = {"model": "plain", "messages": MESSAGES, "max_tokens": 2}
    r = httpx.post(url, json={**base, "tools": [_tool(parameters=schema)]}, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "tools[0].function.parameters"
    arguments: Any = 1
    for _ in range(900):
        arguments = [arguments]
    call = {"id": "1", "type": "function", "function": {"name": "f", "arguments": ""}}
    call["function"]["arguments"] = json.dumps(arguments)
    turn = {"role": "assistant", "content": None, "tool_calls": [call]}
    r = httpx.post(url, json={**base, "messages": [*MESSAGES, turn]}, timeout=60)
    assert r.status_code in (200, 400), r.text
    assert httpx.post(url, json=base, timeout=60).status_code == 200
