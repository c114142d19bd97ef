"""``min_tokens``, ``bad_words`` and ``allowed_token_ids``: the tokens the sampler bans, by
vLLM's rules, and what the engine then generates on a tiny random Llama."""

from __future__ import annotations

import itertools

import pytest

pytest.importorskip("transformers")

from kiln.llm.config import EngineConfig
from kiln.llm.engine import LLMEngine
from kiln.llm.params import MAX_ALLOWED_TOKEN_IDS, InvalidField, sampling_fields
from kiln.llm.sampler import banned_tokens
from kiln.llm.sequence import SamplingParams, Sequence
from tests.llm_models import build_tiny_llm

EOS = (7,)


def _seq(output: list[int], **params: object) -> Sequence:
    seq = Sequence("r", [1, 2, 3], SamplingParams(**params), EOS)  # type: ignore[arg-type]
    seq.token_ids.extend(output)
    return seq


def test_min_tokens_bans_eos_and_stop_tokens_until_reached() -> None:
    assert sorted(banned_tokens(_seq([], min_tokens=2, stop_token_ids=(9,)))) == [7, 9]
    assert sorted(banned_tokens(_seq([4], min_tokens=2, stop_token_ids=(9,)))) == [7, 9]
    assert banned_tokens(_seq([4, 5], min_tokens=2, stop_token_ids=(9,))) == []
    # ignore_eos: EOS stops nothing, so nothing to ban but the stop tokens
    assert banned_tokens(_seq([], min_tokens=2, ignore_eos=True, stop_token_ids=(9,))) == [9]


def test_bad_words_ban_the_last_token_after_the_rest() -> None:
    words = ((11,), (20, 21, 22))
    assert banned_tokens(_seq([], bad_words_token_ids=words)) == [11]
    assert banned_tokens(_seq([20], bad_words_token_ids=words)) == [11]
    assert banned_tokens(_seq([20, 21], bad_words_token_ids=words)) == [11, 22]
    assert banned_tokens(_seq([21, 20, 21], bad_words_token_ids=words)) == [11, 22]
    # the prompt does not count: vLLM looks at the output only
    seq = Sequence("r", [20, 21], SamplingParams(bad_words_token_ids=words), EOS)
    assert banned_tokens(seq) == [11]


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> LLMEngine:
    return LLMEngine(build_tiny_llm(tmp_path_factory.mktemp("llama")), EngineConfig())


def test_min_tokens_holds_off_a_forced_eos(engine: LLMEngine) -> None:
    (eos,) = engine.args.eos_token_ids
    forced = {"temperature": 0.0, "max_tokens": 10, "logit_bias": ((eos, 100.0),)}
    assert engine.generate([[1, 2, 3]], SamplingParams(**forced)) == [[eos]]  # type: ignore[arg-type]
    out = engine.generate([[1, 2, 3]], SamplingParams(min_tokens=4, **forced))[0]  # type: ignore[arg-type]
    assert len(out) == 5 and eos not in out[:4] and out[4] == eos


def test_bad_words_never_appear(engine: LLMEngine) -> None:
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    free = engine.generate([[5, 6, 7, 8]], greedy)[0]
    one, (a, b) = free[3], free[5:7]
    banned = SamplingParams(
        temperature=0.0, max_tokens=12, ignore_eos=True, bad_words_token_ids=((one,), (a, b))
    )
    out = engine.generate([[5, 6, 7, 8]], banned)[0]
    assert one not in out
    assert all((x, y) != (a, b) for x, y in itertools.pairwise(out))
    assert out[:3] == free[:3] and out != free


def test_allowed_token_ids_keep_only_those(engine: LLMEngine) -> None:
    """vLLM's ``allowed_token_ids``: every other token is masked out, greedy and sampled;
    a request beside it in the batch is untouched."""
    free_params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    alone = engine.generate([[5, 6, 7, 8]], free_params)[0]
    allowed = (3, 10, 11, 40)
    for temperature, seed in ((0.0, None), (1.0, 0), (1.0, 1), (0.8, 2)):
        kept = SamplingParams(
            temperature=temperature, seed=seed, max_tokens=12, ignore_eos=True,
            allowed_token_ids=allowed,
        )  # fmt: skip
        out, beside = engine.generate([[5, 6, 7, 8], [5, 6, 7, 8]], [kept, free_params])
        assert set(out) <= set(allowed) and len(out) == 12, out
        assert beside == alone
    # one id: it is the whole output, whatever the model prefers
    only = SamplingParams(temperature=1.0, max_tokens=5, ignore_eos=True, allowed_token_ids=(9,))
    assert engine.generate([[5, 6, 7, 8]], only) == [[9] * 5]


def test_allowed_token_ids_outside_the_vocabulary_are_refused(engine: LLMEngine) -> None:
    vocab = engine.args.vocab_size
    with pytest.raises(InvalidField) as err:
        engine.check_request(3, SamplingParams(allowed_token_ids=(1, vocab)))
    assert err.value.field == "allowed_token_ids" and str(vocab) in str(err.value)


@pytest.mark.parametrize(
    "value", [[], "1,2", [1.5], [True], [-1], {"1": 1}, list(range(MAX_ALLOWED_TOKEN_IDS + 1))]
)
def test_bad_allowed_token_ids_name_the_field(value: object) -> None:
    with pytest.raises(InvalidField) as err:
        sampling_fields({"allowed_token_ids": value})
    assert err.value.field == "allowed_token_ids"


def test_allowed_token_ids_field() -> None:
    assert sampling_fields({})["allowed_token_ids"] == ()
    assert sampling_fields({"allowed_token_ids": None})["allowed_token_ids"] == ()
    assert sampling_fields({"allowed_token_ids": [4, 2, 4]})["allowed_token_ids"] == (4, 2, 4)
