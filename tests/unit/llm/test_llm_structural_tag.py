"""xgrammar's structural tag ``format`` form (what vLLM 0.32 hands xgrammar): every node type
compiled for llguidance and checked on sample outputs through the real matcher and the tiny
Llama's tokenizer; the tree's bounds and the node types kiln refuses are 400s naming the
node's path, raised before anything is compiled."""

from __future__ import annotations

import json
from typing import Any

import pytest

pytest.importorskip("transformers")
pytest.importorskip("llguidance")

from kiln.llm.params import InvalidField
from kiln.llm.structural_tag_check import (
    MAX_FORMAT_COUNT,
    MAX_FORMAT_DEPTH,
    MAX_FORMAT_ITEMS,
    MAX_FORMAT_NODES,
    MAX_FORMAT_TEXT,
    MAX_FORMAT_TOKENS,
    MAX_TAG_STRING,
)
from kiln.llm.structured import GrammarCompiler, from_request
from kiln.llm.tokenizer import Tokenizer
from tests.llm_models import build_tiny_llm

CITY = {
    "type": "object",
    "properties": {"city": {"enum": ["paris", "rome"]}},
    "required": ["city"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "tag",
    "begin": "<function=get_weather>",
    "content": {"type": "json_schema", "json_schema": CITY},
    "end": "</function>",
}
TOOLS = {"type": "triggered_tags", "triggers": ["<function="], "tags": [WEATHER]}
CALL = '<function=get_weather>{"city": "paris"}</function>'
THINK = {"type": "tag", "begin": "<think>", "content": {"type": "any_text"}, "end": "</think>"}


def const(value: str) -> dict[str, Any]:
    return {"type": "const_string", "value": value}


ITEM = {"type": "tag", "begin": "<a>", "content": const("x"), "end": "</a>"}

#: (format, outputs it allows, outputs it refuses)
CASES: list[tuple[str, dict[str, Any], list[str], list[str]]] = [
    ("const_string", const("yes"), ["yes"], ["no", "yess", ""]),
    ("json_schema", {"type": "json_schema", "json_schema": CITY},
     ['{"city": "rome"}'], ['{"city": "oslo"}', "rome"]),
    ("grammar", {"type": "grammar", "grammar": 'root ::= "yes" | "no"'}, ["yes", "no"], ["maybe"]),
    ("regex", {"type": "regex", "pattern": "[A-Z]{3}-[0-9]{2}"}, ["ABC-12"], ["AB-12", "ABC-1"]),
    ("sequence", {"type": "sequence", "elements": [const("A: "),
                                                   {"type": "regex", "pattern": "[0-9]+"}]},
     ["A: 12"], ["A: ", "12"]),
    ("or", {"type": "or", "elements": [const("yes"), {"type": "json_schema", "json_schema": CITY}]},
     ["yes", '{"city":"paris"}'], ["no"]),
    ("optional", {"type": "sequence", "elements": [{"type": "optional", "content": const("x")},
                                                   const("y")]}, ["xy", "y"], ["x", "xxy"]),
    ("plus", {"type": "plus", "content": const("ab")}, ["ab", "abab"], ["", "aba"]),
    ("star", {"type": "star", "content": const("ab")}, ["", "ababab"], ["a"]),
    ("repeat", {"type": "repeat", "min": 2, "max": 3, "content": const("ab")},
     ["abab", "ababab"], ["ab", "abababab"]),
    ("repeat unbounded", {"type": "repeat", "min": 2, "max": -1, "content": const("ab")},
     ["abab", "ab" * 9], ["ab"]),
    ("tag", THINK, ["<think>a < b</think>", "<think></think>"], ["<think>a</think>b", "<think>a"]),
    ("tag with end list", {**THINK, "end": ["</think>", "</t>"]},
     ["<think>x</t>", "<think>x</think>"], ["<think>x</b>"]),
    ("any_text", {"type": "any_text", "excludes": ["zz"]}, ["", "a z b"], ["a zz b"]),
    ("any_text max_chars", {**THINK, "content": {"type": "any_text", "max_chars": 3}},
     ["<think>abc</think>"], ["<think>abcd</think>"]),
    ("any_text then const", {"type": "sequence", "elements": [{"type": "any_text"}, const("END")]},
     ["some text END", "END"], ["some text", "END x"]),
    ("triggered_tags", TOOLS, ["hi", f"a {CALL} b {CALL}", CALL],
     ['a <function=get_time>{}</function>', '<function=get_weather>{"city": "oslo"}</function>',
      '<function=get_weather>{"city": "paris"}']),
    ("triggered_tags at_least_one", {**TOOLS, "at_least_one": True},
     [CALL, f"{CALL} then {CALL}"], ["hi", f"x{CALL}"]),
    ("triggered_tags stop_after_first", {**TOOLS, "stop_after_first": True},
     ["hi", f"a {CALL}"], [f"a {CALL} b"]),
    ("triggered_tags exactly one", {**TOOLS, "at_least_one": True, "stop_after_first": True},
     [CALL], ["hi", f"{CALL} b", f"a {CALL}"]),
    ("triggered_tags excludes", {**TOOLS, "excludes": ["STOP"]}, ["go on"], ["then STOP"]),
    ("reasoning then tools", {"type": "sequence", "elements": [THINK, TOOLS]},
     ["<think>hmm</think>ok", f"<think>a<b</think>x {CALL}"],
     ["ok", "<think>a</think>x <function=f>"]),
    ("triggered_tags inside a tag",
     {"type": "tag", "begin": "<r>", "content": TOOLS, "end": "</r>"},
     [f"<r>a {CALL} b</r>", "<r></r>"], ["<r>a</r>b", "<r>a <function=x"]),
    ("tags_with_separator", {"type": "tags_with_separator", "tags": [ITEM], "separator": ","},
     ["", "<a>x</a>", "<a>x</a>,<a>x</a>"], ["<a>x</a><a>x</a>", "t", "<a>x</a>,"]),
    ("tags_with_separator at_least_one stop_after_first",
     {"type": "tags_with_separator", "tags": [ITEM], "separator": ",", "at_least_one": True,
      "stop_after_first": True}, ["<a>x</a>"], ["", "<a>x</a>,<a>x</a>"]),
    ("dispatch", {"type": "dispatch", "rules": [["<n>", {"type": "regex", "pattern": "[0-9]+;"}]]},
     ["free", "a<n>12;b<n>3;"], ["a<n>x"]),
    ("dispatch without loop",
     {"type": "dispatch", "loop": False,
      "rules": [["<n>", {"type": "regex", "pattern": "[0-9]+"}]]},
     ["a<n>12", "free"], ["a<n>1;"]),
]  # fmt: skip


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    return Tokenizer(build_tiny_llm(tmp_path_factory.mktemp("llama")))


@pytest.fixture(scope="module")
def compiler(tokenizer: Tokenizer) -> GrammarCompiler:
    return GrammarCompiler(tokenizer, 300, (1,))


def _request(fmt: dict[str, Any]) -> dict[str, Any]:
    return {"response_format": {"type": "structural_tag", "format": fmt}}


def _allows(compiler: GrammarCompiler, fmt: dict[str, Any], ids: list[int]) -> bool:
    spec = from_request(_request(fmt))
    assert spec is not None and spec.kind == "structural_tag"
    matcher = compiler.matcher(spec)
    return (
        matcher.validate_tokens(ids) == len(ids)
        and matcher.consume_tokens(ids)
        and matcher.is_accepting()
    )


@pytest.mark.parametrize(("fmt", "good", "bad"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_each_format_node_allows_what_xgrammar_allows(
    compiler: GrammarCompiler,
    tokenizer: Tokenizer,
    fmt: dict[str, Any],
    good: list[str],
    bad: list[str],
) -> None:
    for text in good:
        assert _allows(compiler, fmt, tokenizer.encode(text)), text
    for text in bad:
        assert not _allows(compiler, fmt, tokenizer.encode(text)), text


def test_token_formats(compiler: GrammarCompiler, tokenizer: Tokenizer) -> None:
    """Token begins and ends (by text or id), exclude_token, any_tokens and the token-level
    triggered tags and dispatch: the tag's end token is excluded from free tokens."""
    user, assistant = tokenizer.token_id("<|user|>"), tokenizer.token_id("<|assistant|>")
    assert user is not None and assistant is not None
    text = tokenizer.encode("abc")
    tag = {
        "type": "tag",
        "begin": {"type": "token", "token": "<|user|>"},
        "content": {"type": "any_tokens"},
        "end": {"type": "token", "token": assistant},
    }
    assert _allows(compiler, tag, [user, *text, assistant])
    assert not _allows(compiler, tag, [user, *text, assistant, *text])
    assert not _allows(compiler, tag, text)
    one = {"type": "exclude_token", "exclude_tokens": [text[0]]}
    assert _allows(compiler, one, text[1:2]) and not _allows(compiler, one, text[:1])
    counted = {"type": "any_tokens", "max_tokens": 2}
    assert _allows(compiler, counted, text[:2]) and not _allows(compiler, counted, text[:3] * 2)
    triggered = {"type": "token_triggered_tags", "trigger_tokens": [user],
                 "tags": [{**tag, "content": const("x")}]}  # fmt: skip
    x = tokenizer.encode("x")
    assert _allows(compiler, triggered, [*text, user, *x, assistant, *text])
    assert not _allows(compiler, triggered, [*text, user, *text, assistant])
    dispatch = {"type": "token_dispatch", "rules": [[user, const("x")]], "loop": False}
    assert _allows(compiler, dispatch, [*text, user, *x])
    assert not _allows(compiler, dispatch, [*text, user, *x, *text])


def test_the_request_fields_vllm_accepts() -> None:
    """``response_format``, ``structured_outputs.structural_tag`` (its JSON text) and the
    older top-level field give the same canonical tag (xgrammar's defaults filled in)."""
    tag = {"type": "structural_tag", "format": TOOLS}
    specs = [
        from_request({"response_format": tag}),
        from_request({"structured_outputs": {"structural_tag": json.dumps(tag)}}),
        from_request({"structural_tag": json.dumps(tag)}),
    ]
    assert all(s is not None and s.kind == "structural_tag" for s in specs)
    assert len({s.spec for s in specs if s is not None}) == 1
    canonical = json.loads(specs[0].spec)["format"]  # type: ignore[union-attr]
    assert canonical["at_least_one"] is False and canonical["excludes"] == []
    with pytest.raises(InvalidField, match="both 'format' and 'structures'"):
        from_request({"structural_tag": {"format": TOOLS, "structures": [], "triggers": []}})


def _nest(depth: int) -> dict[str, Any]:
    node: dict[str, Any] = const("x")
    for _ in range(depth - 1):
        node = {"type": "optional", "content": node}
    return node


LONG = "x" * (MAX_TAG_STRING + 1)
MANY = MAX_FORMAT_ITEMS + 1
#: (format, the path named, the message's words): each refused before compiling
BOUNDS: list[tuple[dict[str, Any], str, str]] = [
    (_nest(MAX_FORMAT_DEPTH + 1), "format" + ".content" * MAX_FORMAT_DEPTH, "nested more than"),
    ({"type": "sequence", "elements": [{"type": "sequence", "elements": [const("a")] * 200}] * 11},
     "format.elements[10].elements[", f"limit of {MAX_FORMAT_NODES}"),
    (const("x" * (MAX_FORMAT_TEXT + 1)), "format.value", f"more than {MAX_FORMAT_TEXT}"),
    ({**WEATHER, "begin": LONG}, "format.begin", f"more than {MAX_TAG_STRING}"),
    ({**WEATHER, "end": ["</f>", LONG]}, "format.end[1]", f"more than {MAX_TAG_STRING}"),
    ({**TOOLS, "triggers": ["<f"] * MANY}, "format.triggers", f"more than {MAX_FORMAT_ITEMS}"),
    ({**TOOLS, "tags": [WEATHER] * MANY}, "format.tags", f"more than {MAX_FORMAT_ITEMS}"),
    ({**TOOLS, "excludes": ["a"] * MANY}, "format.excludes", f"more than {MAX_FORMAT_ITEMS}"),
    ({"type": "any_text", "excludes": [LONG]}, "format.excludes[0]", "more than"),
    ({"type": "any_tokens", "exclude_tokens": [1] * (MAX_FORMAT_TOKENS + 1)},
     "format.exclude_tokens", f"more than {MAX_FORMAT_TOKENS}"),
    ({"type": "repeat", "min": 0, "max": MAX_FORMAT_COUNT + 1, "content": const("a")},
     "format.max", f"between 1 and {MAX_FORMAT_COUNT}"),
    ({"type": "repeat", "min": 3, "max": 2, "content": const("a")}, "format.max", "between 3"),
    ({"type": "repeat", "min": -1, "max": 2, "content": const("a")}, "format.min", "between 0"),
    ({"type": "any_text", "max_chars": 10**9}, "format.max_chars", "between 0"),
    ({"type": "token", "token": 2**40}, "format.token", "not a token id"),
    ({"type": "tags_with_separator", "tags": [const("a")], "separator": ","}, "format.tags[0]",
     "must be a tag"),
    ({**TOOLS, "tags": [{**WEATHER, "begin": "<tool>"}]}, "format.tags[0].begin",
     "starts with none of the triggers"),
    ({**TOOLS, "triggers": [""]}, "format.triggers[0]", "must not be empty"),
    ({**TOOLS, "at_least_one": "yes"}, "format.at_least_one", "must be a boolean"),
    ({"type": "sequence", "elements": []}, "format.elements", "non-empty list"),
    ({"type": "tag", "begin": "<a>", "end": "</a>"}, "format", "needs 'content'"),
    ({"type": "json_schema", "json_schema": 3}, "format.json_schema", "JSON Schema"),
    ({"type": "dispatch", "rules": [["<a>"]]}, "format.rules[0]", "[pattern, format] pair"),
    ({"type": "nope"}, "format.type", "not one of xgrammar's"),
    ("any_text", "format", "must be a format"),  # type: ignore[list-item]
    # what kiln does not write, refused by name
    ({"type": "json_schema", "json_schema": CITY, "style": "qwen_xml"}, "format.style",
     "'qwen_xml': kiln writes 'json' only"),
    ({"type": "json_schema", "json_schema": CITY, "any_order": True}, "format.any_order",
     "not supported"),
    ({"type": "any_text", "max_tokens": 5}, "format.max_tokens", "bound it with max_chars"),
    ({"type": "qwen_xml_parameter", "json_schema": CITY}, "format.type", "qwen_xml_parameter"),
]  # fmt: skip


@pytest.mark.parametrize(("fmt", "path", "words"), BOUNDS, ids=[b[1] for b in BOUNDS])
@pytest.mark.parametrize("field", ["response_format", "structured_outputs.structural_tag"])
def test_bounds_are_checked_before_compiling(
    fmt: dict[str, Any], path: str, words: str, field: str
) -> None:
    """``from_request`` runs on the event loop before any compile: every bound is its 400,
    naming the request field and the node's path."""
    tag = {"type": "structural_tag", "format": fmt}
    body = (
        {"response_format": tag}
        if field == "response_format"
        else {"structured_outputs": {"structural_tag": json.dumps(tag)}}
    )
    with pytest.raises(InvalidField) as err:
        from_request(body)
    assert err.value.field == field
    assert f"'{field}.{path}" in str(err.value) and words in str(err.value), str(err.value)


#: what the tree holds that llguidance cannot follow: a 400 at compile, naming the node
UNCOMPILABLE: list[tuple[dict[str, Any], str, str]] = [
    ({"type": "sequence", "elements": [{"type": "any_text"}, {"type": "regex", "pattern": "a"}]},
     "format.elements[0]", "nothing to stop it"),
    ({"type": "star", "content": TOOLS}, "format.content", "inside a star"),
    ({**THINK, "end": ""}, "format.content", "end is empty"),
    ({"type": "token", "token": "no-such-token"}, "format.token", "not a token of the model"),
    ({"type": "token", "token": 5000}, "format.token", "not a token of the model"),
    ({"type": "grammar", "grammar": "root ::= undefined"}, "format.grammar", "not a valid grammar"),
    ({"type": "regex", "pattern": "(ab"}, "response_format", "unclosed group"),
]  # fmt: skip


@pytest.mark.parametrize(("fmt", "path", "words"), UNCOMPILABLE, ids=[u[1] for u in UNCOMPILABLE])
def test_what_cannot_be_compiled_is_named(
    compiler: GrammarCompiler, fmt: dict[str, Any], path: str, words: str
) -> None:
    spec = from_request(_request(fmt))
    assert spec is not None
    with pytest.raises(InvalidField) as err:
        compiler.compile(spec)
    assert err.value.field == "response_format"
    assert f"response_format.{path}" in str(err.value) or path == "response_format"
    assert words in str(err.value), str(err.value)


def test_json_options_apply_to_the_tags_schemas(
    compiler: GrammarCompiler, tokenizer: Tokenizer
) -> None:
    """``disable_any_whitespace`` and ``max_whitespace_cnt`` bound a schema's whitespace."""
    node = {"type": "json_schema", "json_schema": CITY}
    compact = from_request(
        {**_request(node), "structured_outputs": {"disable_any_whitespace": True}}
    )
    assert compact is not None
    for spec, text, ok in (
        (compact, '{"city":"rome"}', True),
        (compact, '{"city": "rome"}', False),
        (from_request(_request({**node, "max_whitespace_cnt": 1})), '{"city": "rome"}', True),
        (from_request(_request({**node, "max_whitespace_cnt": 1})), '{"city":  "rome"}', False),
    ):
        assert spec is not None
        ids = tokenizer.encode(text)
        matcher = compiler.matcher(spec)
        got = matcher.validate_tokens(ids) == len(ids) and matcher.consume_tokens(ids)
        assert (got and matcher.is_accepting()) == ok, text


def test_old_form_still_compiles(compiler: GrammarCompiler, tokenizer: Tokenizer) -> None:
    old = {"structures": [{"begin": "<function=get_weather>", "schema": CITY,
                           "end": "</function>"}], "triggers": ["<function="]}  # fmt: skip
    spec = from_request({"structural_tag": old})
    assert spec is not None
    ids = tokenizer.encode(f"a {CALL}")
    assert compiler.matcher(spec).validate_tokens(ids) == len(ids)


def test_a_compiled_tag_is_cached_by_its_canonical_form(compiler: GrammarCompiler) -> None:
    first = from_request(_request(TOOLS))
    again = from_request(_request({**TOOLS, "at_least_one": False, "excludes": []}))
    assert first is not None and first == again
    compiler.compile(first)
    before = compiler.num_compiles
    compiler.compile(again)  # type: ignore[arg-type]
    assert compiler.num_compiles == before
