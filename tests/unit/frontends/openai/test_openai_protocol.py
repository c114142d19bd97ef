"""The OpenAI frontend's field rules: unsupported fields and the values that ask for
nothing, unknown fields warned once, the chat template's options, and the last message
left open for ``continue_final_message``."""

from __future__ import annotations

import logging

import pytest

from kiln.core.errors import KilnError
from kiln.frontends.openai import protocol
from kiln.frontends.openai.chat_input import MAX_REQUEST_TEMPLATE_CHARS, chat_template_options
from kiln.frontends.openai.generation_request import (
    GenerationRequest,
    completion_prompts,
    completion_request,
)
from kiln.frontends.openai.protocol import CHAT_FIELDS, COMPLETION_FIELDS, OpenAIError, check_fields
from kiln.llm.tokenizer import _open_final_message


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("functions", [{"name": "f"}]),
        ("function_call", "auto"),
        ("suffix", "x"),
    ],
)
def test_unsupported_values_are_refused_naming_the_field(field: str, value: object) -> None:
    with pytest.raises(OpenAIError) as info:
        check_fields({"model": "m", field: value}, COMPLETION_FIELDS, "completions")
    assert info.value.status == 400 and info.value.param == field
    assert "not supported" in info.value.message


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("functions", []),
        ("functions", None),
        ("function_call", "none"),
        ("suffix", ""),
    ],
)
def test_values_that_ask_for_nothing_pass(field: str, value: object) -> None:
    check_fields({"model": "m", field: value}, COMPLETION_FIELDS, "completions")


def test_unknown_fields_warn_once_per_name(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(protocol, "_WARNED", set())
    with caplog.at_level(logging.WARNING, logger=protocol.log.name):
        for _ in range(3):
            check_fields({"model": "m", "zzz": 1, "yyy": 2}, COMPLETION_FIELDS, "completions")
    assert sorted(r.args[1] for r in caplog.records) == ["yyy", "zzz"]  # type: ignore[index]


@pytest.mark.parametrize(
    "field",
    ["response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice",
     "guided_grammar", "guided_whitespace_pattern", "guided_decoding_backend"],
)  # fmt: skip
@pytest.mark.parametrize("known", [COMPLETION_FIELDS, CHAT_FIELDS])
def test_structured_output_fields_are_known(
    field: str, known: frozenset[str], caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    """They are used: no "is not an OpenAI or vLLM field kiln knows" warning for them."""
    monkeypatch.setattr(protocol, "_WARNED", set())
    with caplog.at_level(logging.WARNING, logger=protocol.log.name):
        check_fields({"model": "m", field: {}}, known, "completions")
    assert caplog.records == []


def test_the_warned_names_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(protocol, "_WARNED", set())
    for i in range(protocol._MAX_WARNED + 50):
        check_fields({f"field{i}": 1}, COMPLETION_FIELDS, "completions")
    assert len(protocol._WARNED) == protocol._MAX_WARNED


def test_prompt_lists() -> None:
    assert completion_prompts({"prompt": "a"}) == ["a"]
    assert completion_prompts({"prompt": [1, 2]}) == [[1, 2]]
    assert completion_prompts({"prompt": ["a", [1, 2]]}) == ["a", [1, 2]]
    for bad in (None, [], [[]], ["a", 3], [True], "", [["a"]]):
        with pytest.raises(OpenAIError):
            completion_prompts({"prompt": bad})


def test_a_requests_chat_template_is_a_bounded_string() -> None:
    assert chat_template_options({"chat_template": "{{ x }}"})["chat_template"] == "{{ x }}"
    for bad in ("", " ", 5, ["x"], "x" * (MAX_REQUEST_TEMPLATE_CHARS + 1)):
        with pytest.raises(OpenAIError) as info:
            chat_template_options({"chat_template": bad})
        assert info.value.param == "chat_template"


def test_template_options() -> None:
    assert chat_template_options({}) == {
        "add_generation_prompt": True,
        "continue_final_message": False,
        "template_kwargs": {},
        "chat_template": None,
    }
    opened = chat_template_options({"continue_final_message": True, "documents": [{"a": "b"}]})
    assert opened["add_generation_prompt"] is False
    assert opened["template_kwargs"] == {"documents": [{"a": "b"}]}
    for bad in (
        {"continue_final_message": True, "add_generation_prompt": True},
        {"chat_template_kwargs": {"messages": []}},
        {"chat_template_kwargs": "x"},
        {"add_generation_prompt": "no"},
        {"documents": "x"},
    ):
        with pytest.raises(OpenAIError):
            chat_template_options(bad)


def test_the_final_message_is_left_open() -> None:
    assert _open_final_message("<u>hi</s><a>the quick</s>", "the quick") == "<u>hi</s><a>the quick"
    # a template that trims the message: the trimmed text ends it
    assert _open_final_message("<a>the quick</s>", "the quick  ") == "<a>the quick"
    with pytest.raises(KilnError):
        _open_final_message("<a>something else</s>", "the quick")


def _completion(**fields: object) -> GenerationRequest:
    return completion_request({"model": "m", "prompt": "hi", **fields})


@pytest.mark.parametrize(
    "stop", [5, 1.5, True, {"x": 1}, [5], ["a", None], [""], ["a"] * 5, [["a"]]]
)
def test_a_stop_that_is_not_strings_is_400_naming_it(stop: object) -> None:
    """Not a 500: a number or an object once reached ``tuple(stop)`` (a dict's keys passed)."""
    with pytest.raises(OpenAIError) as info:
        _completion(stop=stop)
    assert info.value.status == 400 and info.value.param == "stop"


def test_stop_strings() -> None:
    assert _completion().stop == ()
    assert _completion(stop=None).stop == ()
    assert _completion(stop="x").stop == ("x",)
    assert _completion(stop=["a", "b"]).stop == ("a", "b")
    assert _completion(stop=[]).stop == ()


@pytest.mark.parametrize("stream", ["no", "false", 1, 0, [], {}])
def test_stream_must_be_a_boolean(stream: object) -> None:
    """``"no"`` once streamed (any truthy value did)."""
    with pytest.raises(OpenAIError) as info:
        _completion(stream=stream)
    assert info.value.status == 400 and info.value.param == "stream"


@pytest.mark.parametrize(
    "options",
    ["x", [], {"include_usage": "x"}, {"include_usage": 1}, {"continuous_usage_stats": "yes"}],
)
def test_stream_options_are_checked(options: object) -> None:
    with pytest.raises(OpenAIError) as info:
        _completion(stream=True, stream_options=options)
    assert info.value.status == 400 and info.value.param == "stream_options"


def test_stream_options_need_stream() -> None:
    """vLLM's and OpenAI's rule: options of a stream without one are refused."""
    with pytest.raises(OpenAIError) as info:
        _completion(stream_options={"include_usage": True})
    assert info.value.status == 400 and info.value.param == "stream_options"
    assert "stream=True" in info.value.message
    for harmless in (None, {}):  # as vLLM's check: a falsy value asks for nothing
        assert not _completion(stream_options=harmless).include_usage


def test_stream_options() -> None:
    req = _completion(stream=True, stream_options={"include_usage": True})
    assert req.include_usage and not req.continuous_usage
    req = _completion(
        stream=True, stream_options={"include_usage": True, "continuous_usage_stats": True}
    )
    assert req.include_usage and req.continuous_usage
    # vLLM's: usage on every chunk only when usage was asked for at all
    req = _completion(stream=True, stream_options={"continuous_usage_stats": True})
    assert not req.include_usage and not req.continuous_usage


def test_a_bug_in_a_route_is_a_500_in_openais_shape(caplog: pytest.LogCaptureFixture) -> None:
    """Not an exception escaping to the server, which closed the client's connection: the
    next request a client sent on it was reset."""
    import asyncio
    import json

    from starlette.requests import Request

    from kiln.frontends.openai import endpoint

    async def broken(request: Request) -> object:
        raise TypeError("'int' object is not iterable")

    request = Request({"type": "http", "method": "POST", "path": "/v1/completions",
                       "headers": [], "query_string": b""})  # fmt: skip
    with caplog.at_level(logging.ERROR, logger=endpoint.log.name):
        response = asyncio.run(endpoint.answers_errors(broken)(request))  # type: ignore[arg-type]
    assert response.status_code == 500
    error = json.loads(bytes(response.body))["error"]
    assert error["type"] == "server_error" and "log" in error["message"]
    assert "not iterable" not in error["message"]  # the details stay in the log
    (record,) = caplog.records
    assert record.exc_info is not None and "/v1/completions" in record.getMessage()


def test_beam_search_fields() -> None:
    plain = _completion(use_beam_search=False, length_penalty=1)
    assert not plain.beam_search and plain.length_penalty == 1.0
    beams = _completion(use_beam_search=True, n=3, length_penalty=0.6, temperature=0.7,
                        top_p=0.9, seed=4)  # fmt: skip
    # sampling settings are accepted and change nothing: the model's logprobs rank beams
    assert beams.beam_search and beams.params.n == 3 and beams.length_penalty == 0.6


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"use_beam_search": 0}, "use_beam_search"),  # 0 is not False: a bool is asked for
        ({"use_beam_search": "true"}, "use_beam_search"),
        ({"length_penalty": 0.5}, "length_penalty"),  # it ranks beams: beam search only
        ({"use_beam_search": True, "length_penalty": True}, "length_penalty"),
        ({"use_beam_search": True, "length_penalty": 11}, "length_penalty"),
        ({"use_beam_search": True, "length_penalty": -1e300}, "length_penalty"),
        ({"use_beam_search": True, "frequency_penalty": 1}, "frequency_penalty"),
        ({"use_beam_search": True, "presence_penalty": -1}, "presence_penalty"),
        ({"use_beam_search": True, "repetition_penalty": 1.1}, "repetition_penalty"),
        ({"use_beam_search": True, "logit_bias": {"3": 1}}, "logit_bias"),
        ({"use_beam_search": True, "allowed_token_ids": [3]}, "allowed_token_ids"),
        ({"use_beam_search": True, "bad_words": ["x"]}, "bad_words"),
    ],
)
def test_bad_beam_search_fields_are_400_naming_them(fields: dict[str, object], param: str) -> None:
    with pytest.raises(OpenAIError) as info:
        _completion(**fields)
    assert info.value.status == 400 and info.value.param == param
