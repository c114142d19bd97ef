"""Structured outputs through ``kiln serve`` with the real ``openai`` client: OpenAI's
``response_format`` (and the SDK's ``parse`` with a Pydantic model), vLLM's ``guided_*``
fields and ``structured_outputs`` object, on completions and chat, whole and streamed. The
model has random weights, so valid output proves the constraint; bad constraints are 400s
naming their field, and the requests beside them are unaffected."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Literal

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("transformers")
pytest.importorskip("llguidance")

from pydantic import BaseModel, Field  # noqa: E402

from tests.conftest import KilnProcess  # noqa: E402
from tests.llm_models import llm_config, tiny_llm_repository  # noqa: E402
from tests.unit.llm.test_llm_structured import ENUMS, ITEMS, PERSON  # noqa: E402

CONFIG = llm_config(max_num_seqs="8", num_gpu_blocks="128")
#: random weights love whitespace: with it allowed a JSON value never ends (vLLM's option)
COMPACT = {"structured_outputs": {"disable_any_whitespace": True}}
MESSAGES = [{"role": "user", "content": "the quick brown fox"}]


class Address(BaseModel):
    city: Literal["paris", "rome", "oslo"]
    zip: str = Field(pattern=r"^[0-9]{5}$")


class Person(BaseModel):
    name: Literal["ann", "bob"]
    age: int = Field(ge=0, le=120)
    tags: list[Literal["a", "b", "c"]] = Field(min_length=2, max_length=3)
    address: Address


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KilnProcess]:
    repo = tiny_llm_repository(tmp_path_factory.mktemp("llm"), CONFIG)
    proc = KilnProcess(repo).start(timeout=120)
    yield proc
    proc.stop()


@pytest.fixture
def client(server: KilnProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://{server.http_url}/v1", api_key="unused", max_retries=0)


def _schema_format(schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}}


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_chat_response_format_json_schema(client: openai.OpenAI, temperature: float) -> None:
    for schema in (PERSON, ITEMS):
        reply = client.chat.completions.create(
            model="tiny",
            messages=MESSAGES,  # type: ignore[arg-type]
            response_format=_schema_format(schema),  # type: ignore[arg-type]
            max_completion_tokens=150,
            temperature=temperature,
            seed=3,
            extra_body=COMPACT,
        )
        choice = reply.choices[0]
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content or ""), schema)


def test_chat_response_format_json_object(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(
        model="tiny",
        messages=MESSAGES,  # type: ignore[arg-type]
        response_format={"type": "json_object"},
        max_completion_tokens=100,
        temperature=0,
        extra_body=COMPACT,
    )
    assert isinstance(json.loads(reply.choices[0].message.content or ""), dict)


def _valid(schema: dict[str, Any]) -> Any:
    def check(text: str) -> bool:
        jsonschema.validate(json.loads(text), schema)
        return True

    return check


def _matches(pattern: str) -> Any:
    return lambda text: re.fullmatch(pattern, text) is not None


@pytest.mark.parametrize(
    ("extra", "check"),
    [
        ({"guided_json": ENUMS, **COMPACT}, _valid(ENUMS)),
        ({"response_format": _schema_format(ITEMS), **COMPACT}, _valid(ITEMS)),
        ({"response_format": {"type": "json_object"}, **COMPACT}, _valid({"type": "object"})),
        ({"guided_regex": r"[a-c]{3}-[0-9]{2}"}, _matches(r"[a-c]{3}-[0-9]{2}")),
        ({"guided_choice": ["red", "green", "blue"]}, _matches("red|green|blue")),
        (
            {"guided_grammar": 'root ::= ("yes" | "no") " " [1-9] [0-9]?'},
            _matches(r"(yes|no) [1-9][0-9]?"),
        ),
        ({"structured_outputs": {"json": PERSON, "disable_any_whitespace": True}}, _valid(PERSON)),
        ({"structured_outputs": {"regex": r"(ab|cd)+!"}}, _matches(r"(ab|cd)+!")),
        ({"structured_outputs": {"choice": ["x", "y"]}}, _matches("x|y")),
        (
            {"structured_outputs": {"grammar": 'root ::= "(" [0-9] ("," [0-9])? ")"'}},
            _matches(r"\([0-9](,[0-9])?\)"),
        ),
    ],
)
def test_completions_fields(client: openai.OpenAI, extra: dict[str, Any], check: Any) -> None:
    for temperature, seed in ((0.0, None), (1.0, 1), (1.0, 2)):
        reply = client.completions.create(
            model="tiny",
            prompt="hello world",
            max_tokens=150,
            temperature=temperature,
            seed=seed,
            extra_body=extra,
        )
        text = reply.choices[0].text
        assert reply.choices[0].finish_reason == "stop", text
        assert check(text), text


def test_streaming_equals_whole(client: openai.OpenAI) -> None:
    kw: dict[str, Any] = dict(
        model="tiny",
        messages=MESSAGES,
        response_format=_schema_format(PERSON),
        max_completion_tokens=150,
        temperature=0,
        extra_body=COMPACT,
    )
    whole = client.chat.completions.create(**kw).choices[0].message.content
    parts, reasons = [], []
    for chunk in client.chat.completions.create(stream=True, **kw):
        for c in chunk.choices:
            parts.append(c.delta.content or "")
            reasons.append(c.finish_reason)
    assert "".join(parts) == whole
    assert reasons[-1] == "stop"
    assert len([p for p in parts if p]) > 3  # it did stream
    jsonschema.validate(json.loads(whole or ""), PERSON)
    stream = client.completions.create(
        model="tiny",
        prompt="hi",
        max_tokens=60,
        temperature=1.0,
        seed=4,
        stream=True,
        extra_body={"guided_regex": r"[0-9]{2}(-[a-z]{2}){2,3}"},
    )
    text = "".join(c.choices[0].text for c in stream if c.choices)
    assert re.fullmatch(r"[0-9]{2}(-[a-z]{2}){2,3}", text), text


@pytest.mark.parametrize("beta", [False, True])
def test_sdk_parse_with_a_pydantic_model(client: openai.OpenAI, beta: bool) -> None:
    completions = client.beta.chat.completions if beta else client.chat.completions
    for seed in (0, 1, 2):
        reply = completions.parse(
            model="tiny",
            messages=MESSAGES,  # type: ignore[arg-type]
            response_format=Person,
            max_completion_tokens=150,
            temperature=1.0,
            seed=seed,
            extra_body=COMPACT,
        )
        parsed = reply.choices[0].message.parsed
        assert isinstance(parsed, Person), reply.choices[0].message.content
        assert parsed.name in ("ann", "bob") and 2 <= len(parsed.tags) <= 3


def test_n_choices_each_follow_the_schema(client: openai.OpenAI) -> None:
    reply = client.completions.create(
        model="tiny",
        prompt="a sequence of",
        n=3,
        max_tokens=150,
        temperature=1.0,
        seed=7,
        extra_body={"guided_json": ITEMS, **COMPACT},
    )
    for c in reply.choices:
        jsonschema.validate(json.loads(c.text), ITEMS)


def test_grammar_that_cannot_finish_ends_with_length(client: openai.OpenAI) -> None:
    reply = client.completions.create(
        model="tiny", prompt="hi", max_tokens=6, extra_body={"guided_regex": "a{400}"}
    )
    assert reply.choices[0].finish_reason == "length"
    assert set(reply.choices[0].text) == {"a"}


BAD = [
    ({"guided_json": {"type": "foo"}}, "guided_json"),
    ({"response_format": _schema_format({"type": "object", "properties": 5})}, "response_format"),
    (
        {"structured_outputs": {"json": {"type": "array", "minItems": 4, "maxItems": 1}}},
        "structured_outputs.json",
    ),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"guided_regex": "[a-z"}, "guided_regex"),
    ({"structured_outputs": {"regex": "(ab"}}, "structured_outputs.regex"),
    ({"guided_grammar": 'root ::= "a" undefined_rule'}, "guided_grammar"),
    ({"structured_outputs": {"grammar": 'root := "a"'}}, "structured_outputs.grammar"),
    ({"guided_json": ENUMS, "guided_regex": "a+"}, "guided_regex"),
    ({"response_format": {"type": "json_object"}, "guided_choice": ["a"]}, "guided_choice"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs.choice"),
    ({"guided_choice": []}, "guided_choice"),
    ({"response_format": {"type": "yaml"}}, "response_format"),
    ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs.structural_tag"),
    ({"response_format": {"type": "structural_tag", "format": {"type": "any_text",
                                                                "max_tokens": 5}}},
     "response_format"),
    ({"structured_outputs": {"structural_tag": json.dumps(
        {"type": "structural_tag", "format": {"type": "star", "content": {"type": "any_text"}}})}},
     "structured_outputs.structural_tag"),
    ({"structural_tag": {"structures": [{"begin": "<f>", "end": ""}], "triggers": ["<g"]}},
     "structural_tag"),
]  # fmt: skip


#: a trigger random weights write often: every "e" of the output starts ``e=<digit>;``
DIGIT = {"type": "integer", "minimum": 0, "maximum": 9}
DIGIT_TAG = {"type": "structural_tag", "triggers": ["e"],
             "structures": [{"begin": "e=", "end": ";", "schema": DIGIT}]}  # fmt: skip


def _tagged_texts(client: openai.OpenAI, extra: dict[str, Any]) -> list[str]:
    """Completions of "hello world" with ``extra``, greedy and two seeded samples; each
    streamed one is the same text."""
    texts = []
    for temperature, seed in ((0.0, None), (1.0, 1), (1.0, 2)):
        kw: dict[str, Any] = dict(model="tiny", prompt="hello world", max_tokens=60,
                                  temperature=temperature, seed=seed, extra_body=extra)  # fmt: skip
        text = client.completions.create(**kw).choices[0].text
        streamed = "".join(c.choices[0].text for c in client.completions.create(stream=True, **kw))
        assert streamed == text
        texts.append(text)
    return texts


@pytest.mark.parametrize("field", ["response_format", "structured_outputs"])
def test_structural_tag_constrains_after_each_trigger(client: openai.OpenAI, field: str) -> None:
    """vLLM's structural tags (xgrammar's structures and triggers): free text, and after a
    trigger its structure, whole and streamed."""
    extra: dict[str, Any] = (
        {"response_format": DIGIT_TAG}
        if field == "response_format"
        else {"structured_outputs": {"structural_tag": json.dumps(DIGIT_TAG)}}
    )
    pattern = r"(?:[^e]*e=\s*\d\s*;)*[^e]*(?:e=?\s*\d?\s*)?"
    seen = 0
    for text in _tagged_texts(client, extra):
        assert re.fullmatch(pattern, text, re.S), text
        seen += text.count("e=")
    assert seen > 0


#: xgrammar's ``format`` form: a JSON "tool call" after every "e" (random weights write it
#: often), compact JSON as vLLM's option asks
CALL_SCHEMA = {"type": "object", "properties": {"n": DIGIT}, "required": ["n"],
               "additionalProperties": False}  # fmt: skip
E_CALLS = {"type": "structural_tag", "format": {
    "type": "triggered_tags", "triggers": ["e"],
    "tags": [{"type": "tag", "begin": "e=", "end": ";",
              "content": {"type": "json_schema", "json_schema": CALL_SCHEMA}}]}}  # fmt: skip


@pytest.mark.parametrize("field", ["response_format", "structured_outputs"])
def test_format_tag_calls_follow_each_trigger(client: openai.OpenAI, field: str) -> None:
    """xgrammar's newer ``format`` tags (vLLM 0.32 passes them to xgrammar): free text, and
    after each trigger a JSON call its schema allows, whole and streamed."""
    options = {"disable_any_whitespace": True}
    extra: dict[str, Any] = (
        {"response_format": E_CALLS, "structured_outputs": options}
        if field == "response_format"
        else {"structured_outputs": {"structural_tag": json.dumps(E_CALLS), **options}}
    )
    partial = r'(?:e(?:=(?:\{(?:"(?:n(?:"(?::(?:\d\}?)?)?)?)?)?)?)?)?'
    pattern = r'(?:[^e]*e=\{"n":\d\};)*[^e]*' + partial
    calls = 0
    for text in _tagged_texts(client, extra):
        assert re.fullmatch(pattern, text, re.S), text
        for call in re.findall(r"e=(\{.*?\});", text):
            jsonschema.validate(json.loads(call), CALL_SCHEMA)
            calls += 1
    assert calls > 0


def test_format_tag_forces_exactly_one_tool_call(client: openai.OpenAI) -> None:
    """``at_least_one`` and ``stop_after_first``: the chat answer is one tool call, its
    arguments JSON the schema allows, and nothing else."""
    tool = {"type": "tag", "begin": "<tool_call>get_digit", "end": "</tool_call>",
            "content": {"type": "json_schema", "json_schema": CALL_SCHEMA}}  # fmt: skip
    tag = {"type": "structural_tag", "format": {
        "type": "triggered_tags", "triggers": ["<tool_call>"], "tags": [tool],
        "at_least_one": True, "stop_after_first": True}}  # fmt: skip
    for seed in (0, 1):
        reply = client.chat.completions.create(
            model="tiny", messages=MESSAGES, max_tokens=60, temperature=1.0, seed=seed,
            extra_body={"response_format": tag, **COMPACT},
        )  # fmt: skip
        choice = reply.choices[0]
        found = re.fullmatch(r"<tool_call>get_digit(\{.*\})</tool_call>", choice.message.content)
        assert found, choice.message.content
        jsonschema.validate(json.loads(found.group(1)), CALL_SCHEMA)
        assert choice.finish_reason == "stop"


@pytest.mark.parametrize("chat", [False, True])
def test_bad_constraints_are_400_naming_the_field(server: KilnProcess, chat: bool) -> None:
    url = f"http://{server.http_url}/v1/{'chat/completions' if chat else 'completions'}"
    base: dict[str, Any] = {"model": "tiny", "max_tokens": 8}
    base.update({"messages": MESSAGES} if chat else {"prompt": "hi"})
    with httpx.Client(timeout=60) as http:
        for extra, param in BAD:
            r = http.post(url, json={**base, **extra})
            assert r.status_code == 400, (extra, r.text)
            error = r.json()["error"]
            assert error["param"] == param, (extra, error)
            assert error["type"] == "invalid_request_error"
            assert error["message"]


def test_bad_and_constrained_requests_leave_the_others_alone(
    client: openai.OpenAI, server: KilnProcess
) -> None:
    free: dict[str, Any] = dict(
        model="tiny",
        prompt="the lazy dog",
        max_tokens=40,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    alone = client.completions.create(**free).choices[0].text
    url = f"http://{server.http_url}/v1/completions"

    def bad(i: int) -> int:
        body = {"model": "tiny", "prompt": "hi", "guided_regex": "(" * (i + 1)}
        return httpx.post(url, json=body, timeout=60).status_code

    def constrained(i: int) -> str:
        reply = client.completions.create(
            model="tiny",
            prompt="kiln serves",
            max_tokens=150,
            temperature=1.0,
            seed=i,
            extra_body={"guided_json": PERSON, **COMPACT},
        )
        return reply.choices[0].text

    with ThreadPoolExecutor(8) as pool:
        frees = [pool.submit(lambda: client.completions.create(**free)) for _ in range(2)]
        bads = [pool.submit(bad, i) for i in range(3)]
        good = [pool.submit(constrained, i) for i in range(3)]
        assert [f.result().choices[0].text for f in frees] == [alone, alone]
        assert [b.result() for b in bads] == [400, 400, 400]
        for g in good:
            jsonschema.validate(json.loads(g.result()), PERSON)
