"""Beam search (kiln.llm.beam_search): the search against exhaustive enumeration and
against itself run to the end, its stop rules, and ``LLM.beam_search`` on a real (tiny)
model against a beam search over ``transformers``' logits."""

from __future__ import annotations

import itertools
import math
import random
from pathlib import Path

import pytest

from kiln.llm.beam_search import BeamSearch
from kiln.llm.sampler import TokenLogprobs

EOS = 0
VOCAB = 4


def _dist(prefix: list[int], seed: int, vocab: int = VOCAB) -> TokenLogprobs:
    """A fixed pseudo-random next-token distribution of ``prefix`` (the whole vocabulary as
    ``top``, best first), as the engine returns one."""
    rng = random.Random(hash((seed, *prefix)))
    logits = [rng.uniform(-3, 3) for _ in range(vocab)]
    norm = math.log(sum(math.exp(v) for v in logits))
    top = sorted(((t, v - norm) for t, v in enumerate(logits)), key=lambda p: -p[1])
    return TokenLogprobs(top[0][0], top[0][1], tuple(top))


def _run(search: BeamSearch, prompt: list[int], seed: int) -> BeamSearch:
    while not search.done():
        search.advance([_dist(ids, seed) for ids in search.prompts(prompt)])
    return search


def _score(cum: float, length: int, penalty: float) -> float:
    return cum / max(length, 1) ** penalty


@pytest.mark.parametrize("penalty", [0.0, 1.0, -0.5])
@pytest.mark.parametrize("seed", range(4))
def test_a_beam_wide_enough_to_keep_every_sequence_ranks_them_all(
    seed: int, penalty: float
) -> None:
    """With more beams than sequences, nothing is pruned: the answer is every sequence of
    up to 3 tokens (ended by EOS or by the length), ranked by score."""
    prompt, steps = [1, 2], 3
    every: list[tuple[list[int], float, int]] = []  # tokens, cum logprob, counted length
    for length in range(1, steps + 1):
        for body in itertools.product(range(1, VOCAB), repeat=length - 1):
            cum, prefix = 0.0, list(prompt)
            for t in body:
                cum += dict(_dist(prefix, seed).top)[t]
                prefix.append(t)
            eos = dict(_dist(prefix, seed).top)[EOS]
            every.append((list(body), cum + eos, len(body)))
            if length == steps:
                for t in range(1, VOCAB):
                    last = dict(_dist(prefix, seed).top)[t]
                    every.append(([*body, t], cum + last, len(body) + 1))
    every.sort(key=lambda s: _score(s[1], len(prompt) + s[2], penalty), reverse=True)
    width = len(every)
    search = BeamSearch(len(prompt), width, steps, eos_token_ids=[EOS], length_penalty=penalty)
    best = _run(search, prompt, seed).best()
    assert [b.tokens for b in best] == [s[0] for s in every]
    assert [b.cum_logprob for b in best] == pytest.approx([s[1] for s in every])
    ended = [b.finish_reason for b in best]
    assert ended == ["stop" if len(s[0]) < steps else "length" for s in every]


@pytest.mark.parametrize("penalty", [-1.0, 0.0, 0.5, 1.0, 2.0])
def test_ending_early_gives_the_answer_running_every_step_gives(
    penalty: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The search stops once no live beam can reach the answer; the answer is the one of a
    search that runs all of max_tokens (vLLM's), over many distributions."""
    settled = 0
    for seed, width, steps in itertools.product(range(12), (1, 2, 3), (4, 12)):
        kwargs = {"eos_token_ids": [EOS], "length_penalty": penalty}
        early = _run(BeamSearch(3, width, steps, **kwargs), [5, 6, 7], seed)
        settled += early.steps < steps and bool(early.live)
        with monkeypatch.context() as m:
            m.setattr(BeamSearch, "_settled", lambda self: False)
            full = _run(BeamSearch(3, width, steps, **kwargs), [5, 6, 7], seed)
        assert [(b.tokens, b.cum_logprob, b.finish_reason) for b in early.best()] == [
            (b.tokens, b.cum_logprob, b.finish_reason) for b in full.best()
        ]
    if penalty <= 0:
        assert settled > 0  # the bound is tight enough to end some searches early


def test_min_tokens_stop_tokens_and_ignore_eos() -> None:
    prompt = [1]
    # min_tokens: no beam ends before it, whatever EOS's logprob
    search = _run(BeamSearch(1, 3, 6, eos_token_ids=[EOS], min_tokens=4), prompt, 1)
    assert all(len(b.logprobs) >= 5 or b.finish_reason == "length" for b in search.best())
    assert all(len(b.logprobs) > 4 for b in search.completed)
    # ignore_eos: EOS is a token like any other, every beam runs to max_tokens
    search = _run(BeamSearch(1, 3, 5, eos_token_ids=[EOS], ignore_eos=True), prompt, 2)
    assert not search.completed
    assert all(len(b.tokens) == 5 and b.finish_reason == "length" for b in search.best())
    # a stop token ends a beam as EOS does, and names itself; with include_stop_str_in_output
    # it stays in the tokens (its logprob entry is there either way)
    for include in (False, True):
        search = BeamSearch(1, 2, 5, stop_token_ids=[3], include_stop_str_in_output=include)
        _run(search, prompt, 3)
        assert search.completed
        for beam in search.completed:
            assert beam.finish_reason == "stop" and beam.stop_reason == 3
            assert beam.logprobs[-1].token_id == 3
            assert (beam.tokens[-1:] == [3]) is include
            assert len(beam.tokens) == len(beam.logprobs) - (not include)


def test_stop_strings_end_a_beam_at_the_string() -> None:
    letters = "_abc"

    def decode(ids: list[int]) -> str:
        return "".join(letters[t] for t in ids)

    for include in (False, True):
        search = BeamSearch(1, 4, 6, stops=("ab",), decode=decode,
                            include_stop_str_in_output=include)  # fmt: skip
        _run(search, [1], 7)
        stopped = [b for b in search.completed if b.stop_reason == "ab"]
        assert stopped
        for beam in stopped:
            text = decode(beam.tokens)
            assert text.endswith("ab") and "ab" not in text[:-1]
            assert beam.text == (text if include else text[:-2])
        assert all("ab" not in decode(b.tokens) for b in search.live)


def test_stop_strings_decode_only_the_outputs_end() -> None:
    """Every candidate of every step is checked for stop strings: the decoded part must
    not grow with the output (it did: the whole output each time)."""
    letters = "_abc"
    longest: list[int] = []

    def decode(ids: list[int]) -> str:
        longest.append(len(ids))
        return "".join(letters[t] for t in ids)

    search = BeamSearch(1, 3, 40, stops=("zz",), decode=decode)  # never found
    _run(search, [1], 11)
    assert max(longest) <= 4 * 2 + 1


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="beam_width"):
        BeamSearch(1, 0, 4)
    with pytest.raises(ValueError, match="decode"):
        BeamSearch(1, 2, 4, stops=("x",))
    with pytest.raises(ValueError, match="distributions"):
        BeamSearch(1, 2, 4).advance([])


# --- on a model --------------------------------------------------------------------------
pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.llm_models import build_ending_llm

    return build_ending_llm(tmp_path_factory.mktemp("beam") / "m")


def test_llm_beam_search_matches_a_search_over_transformers_logits(tiny: Path) -> None:
    from kiln.llm import LLM, BeamSearchParams
    from tests.llm_models import reference_beam_search

    llm = LLM(tiny, dtype="float32", max_model_len=128, num_gpu_blocks=128, block_size=4)
    eos = llm.tokenizer.eos_token_id
    assert eos is not None
    prompts = [[0, 5, 9, 14, 20], [0, 7, 7], [0, 12, 30, 31]]
    reasons = set()
    for width, penalty in ((3, 1.0), (2, 0.0), (4, -1.0)):
        params = BeamSearchParams(beam_width=width, max_tokens=8, length_penalty=penalty)
        outs = llm.beam_search([{"prompt_token_ids": p} for p in prompts], params)
        for prompt, out in zip(prompts, outs, strict=True):
            want = reference_beam_search(tiny, prompt, width, 8, eos, penalty)
            got = [s.tokens[len(prompt) :] for s in out.sequences]
            # vLLM's offline beams keep their EOS; the reference leaves it out
            assert [t[:-1] if t[-1:] == [eos] else t for t in got] == [t for t, _ in want]
            assert [s.cum_logprob for s in out.sequences] == pytest.approx(
                [c for _, c in want], abs=1e-4
            )
            for seq in out.sequences:
                assert seq.tokens[: len(prompt)] == prompt
                assert seq.text == llm.tokenizer.decode(seq.tokens)
                assert len(seq.logprobs) == len(seq.tokens) - len(prompt)
                assert seq.finish_reason in ("stop", "length")
                assert (seq.tokens[-1] == eos) is (seq.finish_reason == "stop")
                reasons.add(seq.finish_reason)
    assert reasons == {"stop", "length"}  # beams ended at EOS and at max_tokens
    # every engine request ended and gave its blocks back
    assert not llm.engine.has_work()


def test_llm_beam_search_refuses_what_it_cannot_run(tiny: Path) -> None:
    from kiln.llm import LLM, BeamSearchParams

    llm = LLM(tiny, dtype="float32", max_model_len=64, num_gpu_blocks=64, block_size=4)
    with pytest.raises(ValueError, match="max_logprobs"):
        llm.beam_search(["hello"], BeamSearchParams(beam_width=11, max_tokens=4))
    with pytest.raises(ValueError, match="length_penalty"):
        llm.beam_search(["hello"], BeamSearchParams(2, 4, length_penalty=1e308))
    with pytest.raises(ValueError, match="structured_outputs"):
        llm.beam_search(["hello"], BeamSearchParams(2, 4, structured_outputs={"json": {}}))
    with pytest.raises(ValueError, match="beam_width"):
        llm.beam_search(["hello"], BeamSearchParams(0, 4))
    uncached = LLM(tiny, dtype="float32", max_model_len=64, num_gpu_blocks=64, block_size=4,
                   enable_prefix_caching=False)  # fmt: skip
    with pytest.raises(ValueError, match="prefix cache"):
        uncached.beam_search(["hello"], BeamSearchParams(2, 4))
