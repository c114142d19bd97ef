"""vLLM's engine flags a command line carries over: ``--seed`` (unseeded requests repeat
from one start to the next) and ``--max-logprobs`` (the bound on a request's logprobs)."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("transformers")

from kiln.core.errors import KilnError
from kiln.llm.config import EngineConfig
from kiln.llm.engine import LLMEngine
from kiln.llm.params import InvalidField
from kiln.llm.sequence import SamplingParams
from tests.llm_models import build_tiny_llm


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_llm(tmp_path_factory.mktemp("llama"))


def _sampled(folder: Path, seed: int | None) -> list[int]:
    """Tokens of one unseeded request at temperature 1 from a fresh engine."""
    engine = LLMEngine(folder, EngineConfig(block_size=4, seed=seed))
    engine.add_request("r", [1, 2, 3], SamplingParams(max_tokens=12, ignore_eos=True))
    tokens: list[int] = []
    while engine.has_work():
        for out in engine.step():
            tokens.extend(out.new_token_ids)
    return tokens


def test_seed_makes_unseeded_requests_repeat_from_one_start_to_the_next(folder: Path) -> None:
    import torch

    first = _sampled(folder, 7)
    torch.manual_seed(12345)  # whatever drew from the generators meanwhile
    assert _sampled(folder, 7) == first
    assert _sampled(folder, 8) != first


def test_max_logprobs_bounds_a_requests_logprobs(folder: Path) -> None:
    from kiln.cli.llm_options import served_models

    engine = LLMEngine(folder, EngineConfig())  # vLLM's default: 20
    engine.check_request(3, SamplingParams(logprobs=20, prompt_logprobs=20))
    with pytest.raises(InvalidField, match=r"sample logprobs of 21, .* max allowed: 20") as info:
        engine.check_request(3, SamplingParams(logprobs=21))
    assert info.value.field == "logprobs"
    with pytest.raises(InvalidField, match="prompt logprobs of 21") as info:
        engine.check_request(3, SamplingParams(prompt_logprobs=21))
    assert info.value.field == "prompt_logprobs"
    wider = LLMEngine(folder, EngineConfig(max_logprobs=50))
    wider.check_request(3, SamplingParams(logprobs=50))
    everything = LLMEngine(folder, EngineConfig(max_logprobs=-1))
    vocab = everything.args.vocab_size
    everything.check_request(3, SamplingParams(logprobs=vocab))
    with pytest.raises(InvalidField, match=f"max allowed: {vocab} "):
        everything.check_request(3, SamplingParams(logprobs=vocab + 1))
    with pytest.raises(KilnError, match=r"max_logprobs must be -1 .* got -2"):
        EngineConfig(max_logprobs=-2).check()
    (config,) = served_models((folder,), ("tiny",), {"max_logprobs": 5, "seed": 3})
    assert config.parameters["max_logprobs"].string_value == "5"
    assert config.parameters["seed"].string_value == "3"
