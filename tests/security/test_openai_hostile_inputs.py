"""Hostile inputs on the OpenAI routes that reached past their checks: nesting deeper than
Python's recursion in structured-output fields, a body ``request_id`` of any length, a chat
whose rendered prompt (tools, documents, template variables) was tokenized whatever its
length, bad words of any length, and a request's own chat template that could allocate
without bound or loop forever."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("transformers")

from tests.conftest import KilnProcess  # noqa: E402
from tests.llm_models import llm_config, tiny_llm_repository  # noqa: E402

CONFIG = llm_config(
    block_size="4", num_gpu_blocks="64", dtype="float32", trust_request_chat_template="true"
)
STALL = 60.0  # a reply slower than this is a stalled server
HI = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KilnProcess]:
    repo = tiny_llm_repository(tmp_path_factory.mktemp("llm"), CONFIG)
    proc = KilnProcess(repo).start(timeout=120)
    yield proc
    proc.stop()


def _post(server: KilnProcess, path: str, body: bytes | dict[str, Any]) -> httpx.Response:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(
        f"http://{server.http_url}{path}",
        content=raw,
        headers={"content-type": "application/json"},
        timeout=STALL,
    )


def _error(reply: httpx.Response) -> dict[str, Any]:
    assert reply.status_code == 400, reply.text
    err = reply.json()["error"]
    assert err["type"] == "invalid_request_error"
    return dict(err)


def _nested(depth: int) -> bytes:
    # within orjson's depth (1,024), past Python's recursion limit (1,000)
    return b'{"a":' * depth + b"1" + b"}" * depth


DEEP = _nested(1000)
DEEP_TEXT = json.dumps("[" * 100_000 + "]" * 100_000).encode()
COMPLETION = b'{"model": "tiny", "prompt": "hi", "max_tokens": 2, '
NESTED: list[tuple[str, bytes, str]] = [
    ("/v1/completions", COMPLETION + b'"guided_json": ' + DEEP_TEXT + b"}", "guided_json"),
    ("/v1/completions", COMPLETION + b'"guided_json": ' + DEEP + b"}", "guided_json"),
    (
        "/v1/completions",
        COMPLETION + b'"structured_outputs": {"json": ' + DEEP + b"}}",
        "structured_outputs.json",
    ),
    (
        "/v1/completions",
        COMPLETION + b'"response_format": {"type": "json_schema", "json_schema": {"name": "x", '
        b'"schema": ' + DEEP + b"}}}",
        "response_format",
    ),
    (
        "/v1/completions",
        COMPLETION + b'"structural_tag": {"triggers": ["<"], "structures": [{"begin": "<a", '
        b'"end": ">", "schema": ' + _nested(998) + b"}]}}",
        "structural_tag",
    ),
    (
        "/v1/completions",
        COMPLETION
        + b'"response_format": {"type": "structural_tag", "format": '
        + b'{"type": "optional", "content": ' * 998
        + b'{"type": "any_text"}'
        + b"}" * 1000,
        "response_format",
    ),
    (
        "/v1/completions",
        COMPLETION
        + b'"structural_tag": {"format": {"type": "json_schema", "json_schema": '
        + _nested(996)
        + b"}}}",
        "structural_tag",
    ),
    (
        "/v1/responses",
        b'{"model": "tiny", "input": "hi", "max_output_tokens": 2, "text": {"format": '
        b'{"type": "json_schema", "name": "x", "schema": ' + _nested(998) + b"}}}",
        "text.format",
    ),
]


@pytest.mark.parametrize(("path", "body", "param"), NESTED)
def test_a_schema_nested_past_the_recursion_limit_is_400(
    server: KilnProcess, path: str, body: bytes, param: str
) -> None:
    # was a 500 (RecursionError while reading or writing the schema's JSON)
    err = _error(_post(server, path, body))
    assert err["param"] == param, err
    assert "nested" in err["message"], err


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_request_id_past_512_characters_is_400(server: KilnProcess, path: str) -> None:
    # every chunk of a stream carried the id: 10 MB of it, once per token
    body = {"model": "tiny", "prompt": "hi", "messages": HI, "max_tokens": 2}
    err = _error(_post(server, path, {**body, "request_id": "x" * 513}))
    assert err["param"] == "request_id"
    assert "512" in err["message"]
    reply = _post(server, path, {**body, "request_id": "x" * 512})
    assert reply.status_code == 200, reply.text
    assert reply.json()["id"].endswith("-" + "x" * 512)


#: more characters than the tiny model's context (256 tokens x 64) can ever take
LONG = "word " * 400_000


@pytest.mark.parametrize(
    "extra",
    [
        {"chat_template": "{{ x }}", "chat_template_kwargs": {"x": LONG}},
        {
            "chat_template": "{{ tools | tojson }}{{ messages[0].content }}",
            "tools": [{"type": "function", "function": {"name": "f", "description": LONG}}],
            "tool_choice": "none",  # (the tiny model parses no tool calls)
        },
        {"chat_template": "{% for d in documents %}{{ d.text }}{% endfor %}",
         "documents": [{"text": LONG}]},
    ],
    ids=["kwargs", "tools", "documents"],
)  # fmt: skip
def test_a_rendered_prompt_too_long_is_400_before_it_is_tokenized(
    server: KilnProcess, extra: dict[str, Any]
) -> None:
    # the messages were short: only the rendered text's length tells; it was tokenized
    # whole (seconds of a worker thread per megabyte) before its tokens were counted
    body = {"model": "tiny", "messages": HI, "max_tokens": 2, **extra}
    err = _error(_post(server, "/v1/chat/completions", body))
    assert err["code"] == "context_length_exceeded"
    assert "characters" in err["message"], err
    assert err["param"] == "messages"


def test_bad_words_past_the_context_are_400_before_they_are_tokenized(
    server: KilnProcess,
) -> None:
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 2, "bad_words": [LONG]}
    err = _error(_post(server, "/v1/completions", body))
    assert err["param"] == "bad_words"
    assert "characters" in err["message"], err
    ok = {**body, "bad_words": ["word " * 100]}
    assert _post(server, "/v1/completions", ok).status_code == 200


TEMPLATES = [
    # printf and format widths, padding methods and filters: a gigabyte each
    "{{ '%0*d' % (800000000, 1) }}",
    "{{ '{:>800000000}'.format(1) }}",
    "{{ 'a'.ljust(800000000) }}",
    "{{ 'a' | center(800000000) }}",
    "{{ '%0800000000d' | format(1) }}",
    # what no single operation bounds: joins and concatenations in a loop
    "{% set ns = namespace(s='x' * 1000000) %}{% for i in range(12) %}"
    "{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s | length }}",
    "{{ range(100000) | join('y' * 1000000) | length }}",
]


@pytest.mark.parametrize(
    "template",
    TEMPLATES,
    ids=["printf-width", "format-width", "ljust", "center", "format-filter", "concat", "join"],
)
def test_a_request_template_that_allocates_without_bound_is_400(
    server: KilnProcess, template: str
) -> None:
    body = {"model": "tiny", "messages": HI, "max_tokens": 2, "chat_template": template}
    err = _error(_post(server, "/v1/chat/completions", body))
    assert err["param"] == "chat_template", err
    assert "memory" in err["message"], err


def test_a_request_template_that_loops_is_400(server: KilnProcess) -> None:
    template = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
    body = {"model": "tiny", "messages": HI, "max_tokens": 2, "chat_template": template}
    err = _error(_post(server, "/v1/chat/completions", body))
    assert err["param"] == "chat_template", err
    assert "seconds" in err["message"], err


def test_request_templates_still_render_and_the_server_answers(server: KilnProcess) -> None:
    template = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}{{ x }}"
    body = {"model": "tiny", "messages": HI, "chat_template": template,
            "chat_template_kwargs": {"x": "end"}}  # fmt: skip
    reply = _post(server, "/tokenize", body)
    assert reply.status_code == 200, reply.text
    plain = {"model": "tiny", "prompt": "user: hi\nend", "add_special_tokens": False}
    plain_ids = _post(server, "/tokenize", plain).json()["tokens"]
    assert reply.json()["tokens"] == plain_ids
    # an error the template raises is the request's
    raising = {**body, "chat_template": "{{ raise_exception('no system role') }}"}
    err = _error(_post(server, "/v1/chat/completions", {**raising, "max_tokens": 2}))
    assert "no system role" in err["message"]
    ok = _post(server, "/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 2})
    assert ok.status_code == 200


def test_a_lora_path_with_a_nul_byte_is_the_clients_error(tmp_path: Any) -> None:
    # Path.resolve raised ValueError (embedded null byte): a 500 on /v1/load_lora_adapter
    from kiln.core.errors import KilnError, Status
    from kiln.llm.lora import check_allowed_path

    with pytest.raises(KilnError) as info:
        check_allowed_path(f"{tmp_path}/a\x00b", (str(tmp_path),))
    assert info.value.status is Status.INVALID_ARG
    assert "lora_path" in str(info.value)
    assert check_allowed_path(f"{tmp_path}/a", (str(tmp_path),)) == tmp_path / "a"
