"""The reasoning parsers: a whole answer's split, and the same split from any streaming of
it (a tag cut between pieces waits for the rest)."""

from __future__ import annotations

import random

import pytest

from kiln.frontends.openai.reasoning import ReasoningParser

QWEN3, R1 = ReasoningParser("qwen3"), ReasoningParser("deepseek_r1")
MISTRAL = ReasoningParser("mistral")  # Magistral's [THINK] ... [/THINK]


@pytest.mark.parametrize(
    ("parser", "text", "split"),
    [
        (QWEN3, "<think>\nhmm</think>\n\nthe answer", ("\nhmm", "\n\nthe answer")),
        (QWEN3, "\n<think>a</think>b", ("a", "b")),  # whitespace before the tag
        (QWEN3, "no thinking", (None, "no thinking")),
        (QWEN3, "<think>cut short", ("cut short", None)),
        (QWEN3, "<thinker>", (None, "<thinker>")),
        (QWEN3, "<think></think>", ("", None)),
        (R1, "thinking</think>answer", ("thinking", "answer")),
        (R1, "<think>a</think>b", ("a", "b")),  # R1-0528 writes the tag itself
        (R1, "all thought", ("all thought", None)),
        (R1, "a</think>", ("a", None)),
        (MISTRAL, "[THINK]hmm[/THINK]the answer", ("hmm", "the answer")),
        (MISTRAL, "no thinking", (None, "no thinking")),
        (MISTRAL, "<think>a</think>b", (None, "<think>a</think>b")),  # not its markers
        (MISTRAL, "[THINK]cut short", ("cut short", None)),
    ],
)
def test_whole_answers(
    parser: ReasoningParser, text: str, split: tuple[str | None, str | None]
) -> None:
    assert parser.split(text) == split


@pytest.mark.parametrize("parser", [QWEN3, R1, MISTRAL], ids=["qwen3", "deepseek_r1", "mistral"])
def test_any_streaming_gives_the_whole_answers_split(parser: ReasoningParser) -> None:
    rng = random.Random(0)
    texts = ["<think>\nlet me see</think>\n\nthe answer", "plain <think> later", "<think>cut",
             "< think", "x</think>y</think>z", "<", "<think", "</think>",
             "[THINK]a[/THINK]b", "[THI", "[THINK]x[/TH"]  # fmt: skip
    for text in texts:
        for _ in range(200):
            cuts = sorted(rng.sample(range(1, len(text)), rng.randint(0, len(text) - 1)))
            bounds = [0, *cuts, len(text)]
            stream = parser.stream()
            reasoning = content = ""
            for i in range(len(bounds) - 1):
                r, c = stream.feed(text[bounds[i] : bounds[i + 1]], final=i == len(bounds) - 2)
                reasoning, content = reasoning + r, content + c
            got = (reasoning if stream.reasoned else None, content or None)
            assert got == parser.split(text), (text, cuts)


def test_unknown_parsers_are_refused() -> None:
    with pytest.raises(ValueError):
        ReasoningParser("granite")


def test_the_parameter() -> None:
    from google.protobuf import text_format

    from kiln.config.model_config_pb2 import ModelConfig
    from kiln.core.errors import KilnError
    from kiln.llm.backend import reasoning_parser

    def config(**parameters: str) -> ModelConfig:
        text = 'name: "m" backend: "llm"\n' + "".join(
            f'parameters {{ key: "{k}" value {{ string_value: "{v}" }} }}\n'
            for k, v in parameters.items()
        )
        return text_format.Parse(text, ModelConfig())

    assert reasoning_parser(config()) is None
    assert reasoning_parser(config(reasoning_parser=" qwen3 ")) == "qwen3"
    with pytest.raises(KilnError, match="'granite' is not one kiln has"):
        reasoning_parser(config(reasoning_parser="granite"))
