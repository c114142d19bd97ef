"""vLLM's ``thinking_token_budget``: at most that many reasoning tokens, then the end
marker is forced; counted between the markers, opened by the prompt or by the output."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from kiln.llm.config import EngineConfig
from kiln.llm.engine import LLMEngine
from kiln.llm.params import InvalidField, sampling_fields
from kiln.llm.sequence import SamplingParams
from tests.llm_models import build_tiny_llm

START, END = (40,), (41, 42)  # "<think>", and a two-token "</think>"
FREE = {"temperature": 0.0, "ignore_eos": True, "max_tokens": 12}


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> LLMEngine:
    return LLMEngine(build_tiny_llm(tmp_path_factory.mktemp("llama")), EngineConfig())


def _run(engine: LLMEngine, prompt: list[int], **params: object) -> list[int]:
    out = engine.generate([prompt], SamplingParams(**{**FREE, **params}))  # type: ignore[arg-type]
    return out[0]


def _budget(n: int) -> dict[str, object]:
    return {"thinking_token_budget": n, "reasoning_start": START, "reasoning_end": END}


@pytest.mark.parametrize("budget", [0, 1, 3])
def test_a_reasoning_opened_by_the_prompt_ends_after_the_budget(
    engine: LLMEngine, budget: int
) -> None:
    free = _run(engine, [1, 2, *START])
    out = _run(engine, [1, 2, *START], **_budget(budget))
    # the budget's tokens are the free run's (the same greedy steps), then the marker
    assert out[:budget] == free[:budget]
    assert out[budget : budget + 2] == list(END)
    assert len(out) == 12  # after the marker the answer goes on


def test_a_closed_or_absent_reasoning_is_left_alone(engine: LLMEngine) -> None:
    for prompt in ([1, 2], [1, *START, 5, *END, 2]):
        assert _run(engine, prompt, **_budget(1)) == _run(engine, prompt)


def test_a_reasoning_the_output_opens_is_counted_from_its_marker(engine: LLMEngine) -> None:
    # the first token forced to be the start marker (a bias): the budget counts after it
    bias = {"logit_bias": ((START[0], 100.0),), "max_tokens": 1}
    assert _run(engine, [1, 2], **bias) == list(START)
    params = {**_budget(2), "logit_bias": ((START[0], 100.0),)}
    out = _run(engine, [1, 2], **params)
    assert out[0] == START[0] and out[3:5] == list(END)


def test_the_budget_and_its_markers_are_checked(engine: LLMEngine) -> None:
    assert sampling_fields({"thinking_token_budget": -1})["thinking_token_budget"] is None
    assert sampling_fields({"thinking_token_budget": 5})["thinking_token_budget"] == 5
    for bad in (-2, 1.5, True, "5"):
        with pytest.raises(InvalidField) as info:
            sampling_fields({"thinking_token_budget": bad})
        assert info.value.field == "thinking_token_budget"
    with pytest.raises(InvalidField, match="--reasoning-parser"):
        engine.check_request(3, SamplingParams(thinking_token_budget=4))
