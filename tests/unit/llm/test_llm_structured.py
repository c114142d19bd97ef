"""Structured outputs in the engine: a random-weight model, which never writes valid JSON by
chance, writes output that parses and validates against the schema every time (greedy and
sampled, alone, in mixed batches, across preemption, with ``n > 1``); regexes, choices and
grammars likewise; requests without a constraint are untouched by those beside them."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")

import numpy as np  # noqa: E402
import torch  # noqa: E402

from kiln.llm.config import EngineConfig  # noqa: E402
from kiln.llm.engine import LLMEngine, RequestOutput  # noqa: E402
from kiln.llm.params import InvalidField  # noqa: E402
from kiln.llm.sampler import apply_grammar_bitmask, unpack_bitmask  # noqa: E402
from kiln.llm.sequence import SamplingParams, Sequence  # noqa: E402
from kiln.llm.structured import (  # noqa: E402
    MAX_CHOICES,
    GrammarCompiler,
    StructuredOutputsParams,
    from_request,
)
from kiln.llm.tokenizer import Tokenizer  # noqa: E402
from tests.llm_models import all_blocks_returned, build_tiny_llm, drain  # noqa: E402

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "enum": ["ann", "bob"]},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {
            "type": "array",
            "items": {"type": "string", "maxLength": 5},
            "minItems": 2,
            "maxItems": 3,
        },
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 8},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "tags", "address"],
    "additionalProperties": False,
}
ITEMS = {
    "type": "array",
    "items": {
        "type": "object",
        "properties": {
            "id": {"type": "integer", "minimum": 1, "maximum": 99},
            "ok": {"type": "boolean"},
        },
        "required": ["id", "ok"],
        "additionalProperties": False,
    },
    "minItems": 3,
    "maxItems": 4,
}
REFS = {
    "type": "object",
    "properties": {
        "kind": {"const": "point"},
        "at": {"$ref": "#/$defs/point"},
        "label": {"anyOf": [{"type": "null"}, {"type": "string", "maxLength": 4}]},
    },
    "required": ["kind", "at", "label"],
    "additionalProperties": False,
    "$defs": {
        "point": {
            "type": "object",
            "properties": {
                "x": {"type": "integer", "minimum": -10, "maximum": 10},
                "y": {"type": "number", "minimum": 0, "maximum": 1},
            },
            "required": ["x", "y"],
            "additionalProperties": False,
        }
    },
}
ENUMS = {
    "type": "object",
    "properties": {
        "color": {"enum": ["red", "green", "blue"]},
        "n": {"type": "integer", "minimum": 0, "maximum": 9},
        "extra": {"type": "boolean"},
    },
    "required": ["color", "n"],
    "additionalProperties": False,
}
#: greedy, and sampled with several seeds and temperatures
SETTINGS = [(0.0, None), (1.0, 0), (1.0, 1), (1.0, 2), (0.7, 3)]


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_llm(tmp_path_factory.mktemp("llama"))


@pytest.fixture(scope="module")
def tokenizer(folder: Path) -> Tokenizer:
    TOKENIZER[:] = [Tokenizer(folder)]
    return TOKENIZER[0]


def _engine(folder: Path, tokenizer: Tokenizer, **kw: int) -> LLMEngine:
    engine = LLMEngine(folder, EngineConfig(**kw))  # type: ignore[arg-type]
    args = engine.args
    engine.grammars = GrammarCompiler(tokenizer, args.vocab_size, args.eos_token_ids)
    return engine


@pytest.fixture(scope="module")
def engine(folder: Path, tokenizer: Tokenizer) -> LLMEngine:
    return _engine(folder, tokenizer, max_num_seqs=16)


def _json(schema: object) -> StructuredOutputsParams:
    # random weights love whitespace: with it allowed, a JSON value never ends
    return StructuredOutputsParams("json", json.dumps(schema), disable_any_whitespace=True)


def _params(
    spec: StructuredOutputsParams | None,
    temperature: float = 0.0,
    seed: int | None = None,
    max_tokens: int = 120,
    **kw: object,
) -> SamplingParams:
    return SamplingParams(
        max_tokens=max_tokens, temperature=temperature, seed=seed, structured_outputs=spec, **kw
    )  # type: ignore[arg-type]


def _finished(engine: LLMEngine, prompt: list[int], params: list[SamplingParams]) -> list[str]:
    """Each request's text; every one must have ended with ``stop`` (its grammar done)."""
    seqs = [engine.add_request(f"r{i}", prompt, p) for i, p in enumerate(params)]
    drain(engine)
    assert [s.finish_reason for s in seqs] == ["stop"] * len(seqs)
    all_blocks_returned(engine)
    return [_text(s) for s in seqs]


def _text(seq: Sequence) -> str:
    return TOKENIZER[0].decode(seq.output_token_ids)


#: the module's tokenizer, for _text
TOKENIZER: list[Tokenizer] = []


@pytest.mark.parametrize(
    "schema", [PERSON, ITEMS, REFS, ENUMS], ids=["person", "items", "refs", "enums"]
)
def test_json_schema_output_always_validates(
    engine: LLMEngine, tokenizer: Tokenizer, schema: dict[str, object]
) -> None:
    prompt = tokenizer.encode("the quick brown fox")
    spec = _json(schema)
    texts = _finished(engine, prompt, [_params(spec, t, s) for t, s in SETTINGS])
    for text in texts:
        jsonschema.validate(json.loads(text), schema)
    assert len(set(texts)) > 1  # the constraint steers sampling, it does not replace it


def test_unconstrained_output_is_not_json(engine: LLMEngine, tokenizer: Tokenizer) -> None:
    """The premise of these tests: without the constraint, this model writes no JSON."""
    prompt = tokenizer.encode("the quick brown fox")
    for t, s in SETTINGS:
        out = engine.generate([prompt], _params(None, t, s, max_tokens=40, ignore_eos=True))[0]
        with pytest.raises(ValueError):
            json.loads(tokenizer.decode(out))


def test_json_object_regex_choice_grammar(engine: LLMEngine, tokenizer: Tokenizer) -> None:
    prompt = tokenizer.encode("hello world")
    cases = [
        (StructuredOutputsParams("json_object", disable_any_whitespace=True), None),
        (StructuredOutputsParams("regex", r"[a-c]{3}-[0-9]{2}"), r"[a-c]{3}-[0-9]{2}"),
        (StructuredOutputsParams("regex", r"(yes|no), [0-9]{1,3}!"), r"(yes|no), [0-9]{1,3}!"),
        (StructuredOutputsParams("choice", json.dumps(["yes", "no", "maybe"])), "yes|no|maybe"),
        # GBNF / EBNF, as vLLM's default engine (xgrammar) and llama.cpp write it
        (
            StructuredOutputsParams(
                "grammar",
                'root ::= answer " " num\nanswer ::= "yes" | "no"\nnum ::= [1-9] [0-9]? [0-9]?',
            ),
            r"(yes|no) [1-9][0-9]?[0-9]?",
        ),
        # Lark, llguidance's own syntax
        (
            StructuredOutputsParams("grammar", 'start: "(" NUM ("," NUM)* ")"\nNUM: /[0-9]{1,2}/'),
            r"\([0-9]{1,2}(,[0-9]{1,2})*\)",
        ),
    ]
    for spec, pattern in cases:
        texts = _finished(engine, prompt, [_params(spec, t, s, max_tokens=60) for t, s in SETTINGS])
        for text in texts:
            if pattern is None:
                assert isinstance(json.loads(text), dict)
            else:
                assert re.fullmatch(pattern, text), (spec.kind, text)


def test_mixed_batch_leaves_free_requests_untouched(
    engine: LLMEngine, tokenizer: Tokenizer
) -> None:
    prompts = [tokenizer.encode(p) for p in ("the lazy dog", "a sequence of", "kiln serves")]
    free = [
        _params(None, 0.0, max_tokens=20, ignore_eos=True),
        _params(None, 1.0, seed=5, max_tokens=20, ignore_eos=True),
    ]
    alone = [engine.generate([prompts[i]], free[i])[0] for i in range(2)]
    constrained = _params(_json(PERSON))
    solo = engine.generate([prompts[2]], constrained)[0]
    together = engine.generate(prompts, [*free, constrained])
    assert together[:2] == alone  # bit for bit: the mask touched only the constrained row
    assert together[2] == solo
    jsonschema.validate(json.loads(tokenizer.decode(together[2])), PERSON)
    all_blocks_returned(engine)


def test_n_samples_each_follow_the_schema(engine: LLMEngine, tokenizer: Tokenizer) -> None:
    prompt = tokenizer.encode("hello world")
    seq = engine.add_request("n", prompt, _params(_json(ITEMS), 1.0, seed=11, n=3))
    samples = [seq, *seq.forks]
    drain(engine)
    texts = [_text(s) for s in samples]
    for text in texts:
        jsonschema.validate(json.loads(text), ITEMS)
    assert len(set(texts)) == 3


def test_preemption_keeps_constrained_tokens(folder: Path, tokenizer: Tokenizer) -> None:
    prompt = tokenizer.encode("the quick brown fox jumps")
    params = [_params(_json(s)) for s in (PERSON, ITEMS, REFS)]
    roomy = _engine(folder, tokenizer).generate([prompt] * 3, params)
    # 40 blocks of 4 tokens cannot hold three ~70-token outputs: someone is preempted and
    # recomputed, its matcher keeping the state of the tokens it already has
    tight = _engine(folder, tokenizer, block_size=4, num_gpu_blocks=40)
    outputs = drain_outputs(tight, prompt, params)
    assert tight.scheduler.num_preemptions > 0
    assert outputs == roomy
    all_blocks_returned(tight)


def drain_outputs(
    engine: LLMEngine, prompt: list[int], params: list[SamplingParams]
) -> list[list[int]]:
    for i, p in enumerate(params):
        engine.add_request(f"p{i}", prompt, p)
    got = drain(engine)
    return [got[(f"p{i}", 0)] for i in range(len(params))]


def test_grammar_that_cannot_finish_ends_with_length(
    engine: LLMEngine, tokenizer: Tokenizer
) -> None:
    spec = StructuredOutputsParams("regex", "a{500}")
    seq = engine.add_request("long", tokenizer.encode("hi"), _params(spec, max_tokens=8))
    drain(engine)
    assert seq.finish_reason == "length"
    assert seq.num_output_tokens == 8
    assert set(_text(seq)) == {"a"}


def test_finished_grammar_ends_even_with_ignore_eos(
    engine: LLMEngine, tokenizer: Tokenizer
) -> None:
    spec = StructuredOutputsParams("choice", json.dumps(["yes", "no"]))
    seq = engine.add_request("c", tokenizer.encode("hi"), _params(spec, ignore_eos=True))
    drain(engine)
    assert seq.finish_reason == "stop"
    assert _text(seq) in ("yes", "no")


def test_logprobs_of_banned_tokens_are_finite(engine: LLMEngine, tokenizer: Tokenizer) -> None:
    spec = StructuredOutputsParams("choice", json.dumps(["yes", "no"]))
    engine.add_request("lp", tokenizer.encode("hi"), _params(spec, logprobs=5))
    entries = [e for r in drain_results(engine) for e in r.logprobs or ()]
    assert entries
    for e in entries:
        values = [e.logprob, *(lp for _, lp in e.top)]
        assert all(v >= -9999.0 for v in values), values
        assert e.top[-1][1] == -9999.0  # fewer than 5 tokens are allowed: the rest floor


def drain_results(engine: LLMEngine) -> list[RequestOutput]:
    out: list[RequestOutput] = []
    while engine.has_work():
        out.extend(engine.step())
    return out


def test_bitmask_rows(engine: LLMEngine, tokenizer: Tokenizer) -> None:
    """Only the constrained row changes, and only its disallowed tokens become -inf."""
    assert engine.grammars is not None
    vocab = engine.args.vocab_size
    spec = StructuredOutputsParams("choice", json.dumps(["yes", "no"]))
    free = Sequence("a", [1, 2], _params(None))
    bound = Sequence("b", [1, 2], _params(spec))
    bound.grammar = engine.grammars.matcher(spec)
    logits = torch.randn(2, vocab)
    masked = apply_grammar_bitmask(logits, [free, bound])
    assert torch.equal(masked[0], logits[0])
    allowed = torch.isfinite(masked[1]).nonzero().flatten().tolist()
    starts = {tokenizer.token_text(t) for t in allowed}
    assert allowed and all("yes".startswith(s) or "no".startswith(s) for s in starts), starts
    assert torch.equal(masked[1][allowed], logits[1][allowed])


def test_device_unpacking_matches_numpy() -> None:
    """The GPU's unpacking (torch bit shifts), run on the CPU, against numpy's."""
    rng = np.random.default_rng(0)
    words = rng.integers(-(2**31), 2**31, size=(2, 10), dtype=np.int64).astype(np.int32)
    vocab, rows = 300, [0, 2]
    got = unpack_bitmask(words, rows, 3, vocab, torch.device("cpu"))
    bits = np.unpackbits(words.view(np.uint8), axis=1, count=vocab, bitorder="little")
    assert torch.equal(got[rows], torch.from_numpy(bits).bool())
    assert bool(got[1].all())


def test_compiled_grammars_are_cached(folder: Path, tokenizer: Tokenizer) -> None:
    compiler = GrammarCompiler(tokenizer, 300, (1,), cache_size=2)
    a, b, c = (StructuredOutputsParams("regex", r) for r in ("a+", "b+", "c+"))
    first = compiler.compile(a)
    assert compiler.compile(a) is first
    # the request field does not change the key: the same constraint, the same grammar
    assert compiler.compile(StructuredOutputsParams("regex", "a+", param="guided_regex")) is first
    assert compiler.num_compiles == 1
    compiler.compile(b)
    compiler.compile(a)  # a is now the most recently used
    compiler.compile(c)  # evicts b
    assert compiler.num_compiles == 3
    compiler.compile(a)
    assert compiler.num_compiles == 3
    compiler.compile(b)
    assert compiler.num_compiles == 4
    # each sequence gets its own matcher: advancing one leaves the cached one at the start
    m1, m2 = compiler.matcher(a), compiler.matcher(a)
    assert m1.consume_token(tokenizer.encode("a")[0])
    assert m2.validate_tokens(tokenizer.encode("a")) == 1


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (StructuredOutputsParams("json", '{"type": "foo"}', param="guided_json"), "foo"),
        (
            StructuredOutputsParams(
                "json", '{"type": "object", "properties": 5}', param="response_format"
            ),
            "properties",
        ),
        (
            StructuredOutputsParams(
                "json",
                '{"type": "array", "minItems": 3, "maxItems": 1}',
                param="structured_outputs.json",
            ),
            "minItems",
        ),
        (StructuredOutputsParams("regex", "[a-z", param="guided_regex"), "unclosed"),
        (StructuredOutputsParams("regex", "(ab", param="structured_outputs.regex"), "unclosed"),
        (StructuredOutputsParams("grammar", 'root ::= "a" foo', param="guided_grammar"), "foo"),
        (
            StructuredOutputsParams("grammar", 'root := "a"', param="structured_outputs.grammar"),
            "::=",
        ),
    ],
)
def test_bad_specs_name_their_field(
    engine: LLMEngine, spec: StructuredOutputsParams, message: str
) -> None:
    assert engine.grammars is not None
    with pytest.raises(InvalidField) as err:
        engine.grammars.compile(spec)
    assert err.value.field == spec.param
    assert message in str(err.value)


def test_request_fields() -> None:
    schema = {"type": "object"}
    assert from_request({}) is None
    assert from_request({"response_format": {"type": "text"}}) is None
    got = from_request(
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": schema, "strict": True},
            }
        }
    )
    assert got == StructuredOutputsParams("json", json.dumps(schema))
    assert got is not None and got.param == "response_format"
    assert from_request({"response_format": {"type": "json_object"}}) == StructuredOutputsParams(
        "json_object"
    )
    assert from_request({"guided_json": json.dumps(schema)}) == StructuredOutputsParams(
        "json", json.dumps(schema)
    )
    assert from_request({"guided_regex": "a+", "guided_decoding_backend": "xgrammar"}) == (
        StructuredOutputsParams("regex", "a+")
    )
    assert from_request({"guided_choice": ["a", "b"]}) == StructuredOutputsParams(
        "choice", '["a", "b"]'
    )
    assert from_request({"guided_grammar": 'root ::= "a"'}) == StructuredOutputsParams(
        "grammar", 'root ::= "a"'
    )
    got = from_request(
        {
            "structured_outputs": {
                "json": schema,
                "disable_any_whitespace": True,
                "whitespace_pattern": " ?",
            }
        }
    )
    assert got == StructuredOutputsParams("json", json.dumps(schema), True, False, " ?")
    # options from structured_outputs apply to a response_format constraint too
    got = from_request(
        {
            "response_format": {"type": "json_object"},
            "structured_outputs": {"disable_any_whitespace": True},
        }
    )
    assert got == StructuredOutputsParams("json_object", disable_any_whitespace=True)
    assert from_request({"structured_outputs": {"json_object": False}}) is None


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"guided_json": {"type": "object"}, "guided_regex": "a"}, "guided_regex"),
        ({"response_format": {"type": "json_object"}, "guided_choice": ["a"]}, "guided_choice"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs.choice"),
        (
            {"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
            "structured_outputs.regex",
        ),
        ({"guided_json": "{not json"}, "guided_json"),
        ({"guided_json": [1, 2]}, "guided_json"),
        ({"guided_choice": []}, "guided_choice"),
        ({"guided_choice": ["a", 3]}, "guided_choice"),
        ({"guided_regex": 5}, "guided_regex"),
        ({"response_format": "json"}, "response_format"),
        ({"response_format": {"type": "yaml"}}, "response_format"),
        ({"response_format": {"type": "json_schema"}}, "response_format"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
            "response_format",
        ),
        ({"structured_outputs": []}, "structured_outputs"),
        ({"structured_outputs": {"regex": "a", "colour": 1}}, "structured_outputs.colour"),
        ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs.structural_tag"),
        (
            {"structured_outputs": {"regex": "a", "disable_any_whitespace": "yes"}},
            "structured_outputs.disable_any_whitespace",
        ),
        ({"guided_json": {}, "guided_whitespace_pattern": 3}, "guided_whitespace_pattern"),
    ],
)
def test_bad_request_fields_are_named(body: dict[str, object], param: str) -> None:
    with pytest.raises(InvalidField) as err:
        from_request(body)
    assert err.value.field == param


def test_thousands_of_choices_are_one_lexeme(engine: LLMEngine, tokenizer: Tokenizer) -> None:
    """As alternatives of the grammar, 2,000 choices overflowed llguidance's parser row
    (ParserTooComplex) at the first token: the matcher refused it and the request ended
    "stop" with text that was none of the choices (and 60,000 took seconds to compile, past
    65,000 a panic). As one lexeme, the choice is always one of them."""
    rng = np.random.default_rng(0)
    letters = np.array(list("abcdefghij "))
    choices = ["".join(rng.choice(letters, 6)) + str(i) for i in range(3000)]
    spec = StructuredOutputsParams("choice", json.dumps(choices))
    prompt = tokenizer.encode("pick one")
    texts = _finished(engine, prompt, [_params(spec, t, s, max_tokens=60) for t, s in SETTINGS])
    assert all(text in choices for text in texts), texts


def test_choices_are_bounded() -> None:
    too_many = ["x"] * (MAX_CHOICES + 1)
    with pytest.raises(InvalidField) as err:
        from_request({"guided_choice": too_many})
    assert err.value.field == "guided_choice" and str(MAX_CHOICES) in str(err.value)
    with pytest.raises(InvalidField) as err:
        from_request({"structured_outputs": {"choice": too_many}})
    assert err.value.field == "structured_outputs.choice"


def test_a_grammar_the_parser_gives_up_on_is_logged(
    engine: LLMEngine, tokenizer: Tokenizer, caplog: pytest.LogCaptureFixture
) -> None:
    """A grammar can outgrow llguidance's parser limits while it runs (here 3,000
    alternative rules): the matcher's error is logged with the request (vLLM logs it too),
    and the sequence stops rather than leave its grammar."""
    rules = "\n".join(f'r{i} ::= "w{i}"' for i in range(3000))
    grammar = "root ::= " + " | ".join(f"r{i}" for i in range(3000)) + "\n" + rules
    spec = StructuredOutputsParams("grammar", grammar)
    prompt = tokenizer.encode("pick one")
    with caplog.at_level(logging.WARNING, logger="kiln.llm.sequence"):
        seq = engine.add_request("too-complex", prompt, _params(spec, max_tokens=20))
        drain(engine)
    assert seq.finish_reason == "stop"
    logged = [r.getMessage() for r in caplog.records]
    assert any("too-complex" in m and "structured output" in m for m in logged), logged
    all_blocks_returned(engine)


def test_a_thinking_model_is_constrained_after_its_reasoning(
    engine: LLMEngine, tokenizer: Tokenizer
) -> None:
    """``reasoning_end`` (vLLM's rule with a reasoning parser): the tokens up to the end
    marker are free, the schema holds after it. Here the marker is a token the model is
    pushed to write first (a logit bias), which the schema alone would never allow."""
    prompt = tokenizer.encode("the quick brown fox")
    spec = _json(PERSON)
    # any token not in the prompt: the marker is whatever the frontend says ends thinking
    marker = next(t for t in tokenizer.encode("a sequence of tokens") if t not in prompt)
    bias = ((marker, 100.0),)
    for t, s in SETTINGS:
        thinking = _params(spec, t, s, logit_bias=bias, reasoning_end=(marker,))
        seq = engine.add_request(f"think-{s}", prompt, thinking)
        drain(engine)
        assert seq.finish_reason == "stop" and seq.output_token_ids[0] == marker
        jsonschema.validate(json.loads(tokenizer.decode(seq.output_token_ids[1:])), PERSON)
        # without the marker the grammar holds from the first token: the bias cannot win
        plain = engine.add_request(f"plain-{s}", prompt, _params(spec, t, s, logit_bias=bias))
        drain(engine)
        assert plain.output_token_ids[0] != marker
    # a prompt that holds the marker has done its thinking: constrained from the start
    seq = engine.add_request("closed", [*prompt, marker, 5],
                             _params(spec, logit_bias=bias, reasoning_end=(marker,)))  # fmt: skip
    drain(engine)
    assert seq.output_token_ids[0] != marker
    jsonschema.validate(json.loads(_text(seq)), PERSON)
    all_blocks_returned(engine)


WEATHER_TAG = {
    "structures": [
        {
            "begin": "<function=get_weather>",
            "schema": {
                "type": "object",
                "properties": {"city": {"type": "string", "enum": ["paris", "rome"]}},
                "required": ["city"],
            },
            "end": "</function>",
        }
    ],
    "triggers": ["<function="],
}


NUMBER_SCHEMA = {"begin": "<a", "end": "", "schema": 3}
EMPTY = {"begin": "<a", "end": ""}


def test_structural_tag_request_fields() -> None:
    """vLLM's structural tag (xgrammar's structures and triggers): as ``response_format``,
    ``structured_outputs.structural_tag`` (its JSON text) or the older top-level field."""
    canonical = json.dumps({"structures": [{**WEATHER_TAG["structures"][0]}],  # type: ignore[index]
                            "triggers": WEATHER_TAG["triggers"]})  # fmt: skip
    for body in (
        {"response_format": {"type": "structural_tag", **WEATHER_TAG}},
        {"structured_outputs": {"structural_tag": json.dumps(WEATHER_TAG)}},
        {"structural_tag": json.dumps(WEATHER_TAG)},
    ):
        got = from_request(body)
        assert got is not None and got.kind == "structural_tag" and got.spec == canonical
    bad = [
        ({"structural_tag": {**WEATHER_TAG, "format": {}}}, "format"),
        ({"structural_tag": {**WEATHER_TAG, "triggers": ["<tool"]}}, "starts with none"),
        ({"structural_tag": {"structures": [], "triggers": ["<"]}}, "non-empty list"),
        ({"structural_tag": {"structures": [{"begin": "<a"}], "triggers": ["<"]}}, "'end'"),
        ({"structural_tag": {"structures": [NUMBER_SCHEMA], "triggers": ["<"]}}, "JSON Schema"),
        ({"structural_tag": {"structures": [EMPTY] * 300, "triggers": ["<"]}}, "more than"),
        ({"response_format": {"type": "structural_tag"}}, "triggers"),
    ]
    for body, message in bad:
        with pytest.raises(InvalidField, match=message) as err:
            from_request(body)
        assert err.value.field in ("structural_tag", "response_format")


def test_structural_tag_constrains_only_what_follows_a_trigger(
    folder: Path, tokenizer: Tokenizer
) -> None:
    """Text is free until the trigger; then the structure's begin, JSON its schema allows,
    its end; then free again."""
    compiler = GrammarCompiler(tokenizer, 300, (1,))
    spec = from_request({"structural_tag": WEATHER_TAG})
    assert spec is not None
    ok = 'it rains <function=get_weather>{"city": "paris"}</function> so bring a coat'
    ids = tokenizer.encode(ok)
    assert compiler.matcher(spec).validate_tokens(ids) == len(ids)
    for bad in ('it rains <function=get_weather>{"city": "london"}',
                "it rains <function=get_time>{}</function>",
                '<function=get_weather>{"city": "rome"}x'):  # fmt: skip
        ids = tokenizer.encode(bad)
        assert compiler.matcher(spec).validate_tokens(ids) < len(ids), bad


def test_generation_follows_a_structural_tag(engine: LLMEngine, tokenizer: Tokenizer) -> None:
    """A trigger random weights write often ("e"): every one of them in the output is
    followed by its structure (``e=<digit>;``), sampled or greedy."""
    tag = {"structures": [{"begin": "e=", "schema": {"type": "integer", "minimum": 0,
                                                       "maximum": 9}, "end": ";"}],
           "triggers": ["e"]}  # fmt: skip
    spec = from_request({"structural_tag": tag})
    prompt = tokenizer.encode("the quick brown fox")
    params = [_params(spec, t, seed, max_tokens=60) for t, seed in SETTINGS]
    seqs = [engine.add_request(f"st{i}", prompt, p) for i, p in enumerate(params)]
    drain(engine)
    triggered = 0
    for seq in seqs:
        text = _text(seq)
        assert re.fullmatch(r"(?:[^e]*e=\s*\d\s*;)*[^e]*(?:e=?\s*\d?\s*)?", text, re.S), text
        triggered += text.count("e=")
    assert triggered > 0  # the constraint was exercised
