"""The batched sampler against independent references: ``transformers``' logits processors
and greedy ``generate`` for the penalties, its forward pass for logprobs, and the filters'
definitions for min-p / top-k / top-p, with different parameters on every row."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("transformers")

import torch

from kiln.llm.config import EngineConfig
from kiln.llm.engine import LLMEngine
from kiln.llm.sampler import apply_penalties, sample
from kiln.llm.sequence import SamplingParams, Sequence
from tests.llm_models import build_tiny_llm

VOCAB = 300


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_llm(tmp_path_factory.mktemp("llama"))


def _seq(prompt: list[int], output: list[int], **params: object) -> Sequence:
    seq = Sequence("r", list(prompt), SamplingParams(**params))  # type: ignore[arg-type]
    seq.token_ids.extend(output)
    return seq


def test_penalties_match_transformers_and_openai_definitions() -> None:
    from transformers import RepetitionPenaltyLogitsProcessor

    torch.manual_seed(0)
    logits = torch.randn(3, VOCAB) * 4
    seqs = [
        _seq([5, 6, 7], [7, 9, 9, 9], repetition_penalty=1.5),
        _seq([5, 6], [8, 8, 1], frequency_penalty=0.5, presence_penalty=-1.0),
        _seq([2], [3], temperature=0.0),  # no penalty: untouched in the same batch
    ]
    got = apply_penalties(logits.clone(), seqs)
    # Hugging Face's repetition penalty over prompt + output (what generate feeds it)
    ids = torch.tensor([seqs[0].token_ids])
    want0 = RepetitionPenaltyLogitsProcessor(1.5)(ids, logits[:1].clone())[0]
    torch.testing.assert_close(got[0], want0)
    # OpenAI's: logit - count * frequency - (count > 0) * presence, output tokens only
    want1 = logits[1].clone()
    want1[8] -= 2 * 0.5 - 1.0
    want1[1] -= 1 * 0.5 - 1.0
    torch.testing.assert_close(got[1], want1)
    torch.testing.assert_close(got[2], logits[2])


def test_greedy_with_repetition_penalty_matches_transformers_generate(llama: Path) -> None:
    import transformers

    prompt = [5, 17, 42, 99, 3]
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(llama), torch_dtype=torch.float32, attn_implementation="sdpa"
    ).eval()
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=12,
            do_sample=False,
            repetition_penalty=1.8,
            eos_token_id=None,
            pad_token_id=0,
        )
    want = [int(t) for t in out[0, len(prompt) :]]
    params = SamplingParams(max_tokens=12, temperature=0.0, repetition_penalty=1.8, ignore_eos=True)
    plain = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    engine = LLMEngine(llama, EngineConfig())
    penalised, unpenalised = engine.generate([prompt, prompt], [params, plain])
    assert penalised == want
    assert penalised != unpenalised  # the penalty changed the path, on its row only


def test_logprobs_are_the_raw_model_distribution(llama: Path) -> None:
    import transformers

    prompt = [7, 8, 9, 10, 11]
    engine = LLMEngine(llama, EngineConfig())
    # a penalty and a temperature must not change the logprobs reported (vLLM's default)
    params = SamplingParams(
        max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=5, presence_penalty=0.1
    )
    engine.add_request("lp", prompt, params)
    outputs = []
    while engine.has_work():
        outputs.extend(engine.step())
    entries = [lp for o in outputs for lp in o.logprobs or []]
    tokens = [t for o in outputs for t in o.new_token_ids]
    assert len(entries) == len(tokens) == 6
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(llama), torch_dtype=torch.float32, attn_implementation="sdpa"
    ).eval()
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0]
    ref = torch.log_softmax(logits.float(), dim=-1)[len(prompt) - 1 : -1]
    for i, (entry, token) in enumerate(zip(entries, tokens, strict=True)):
        assert entry.token_id == token
        assert entry.logprob == pytest.approx(float(ref[i, token]), abs=1e-4)
        values, ids = ref[i].topk(5)
        assert [t for t, _ in entry.top] == ids.tolist()
        assert [v for _, v in entry.top] == pytest.approx(values.tolist(), abs=1e-4)


def test_a_draw_follows_the_distribution() -> None:
    torch.manual_seed(1)
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    rows = 4000
    logits = probs.log().repeat(rows, 1)
    seqs = [_seq([0], [], temperature=1.0) for _ in range(rows)]
    drawn = torch.tensor([s.token_id for s in sample(logits, seqs)])
    freq = torch.bincount(drawn, minlength=4).float() / rows
    torch.testing.assert_close(freq, probs, atol=0.03, rtol=0)


def test_filters_apply_per_row() -> None:
    torch.manual_seed(2)
    base = torch.randn(VOCAB) * 3
    probs = torch.softmax(base, dim=-1)
    order = probs.argsort(descending=True)
    cumulative = probs[order].cumsum(0)
    nucleus = set(order[: int((cumulative < 0.6).sum()) + 1].tolist())
    allowed = {
        "min_p": set(torch.nonzero(probs >= 0.2 * probs.max()).flatten().tolist()),
        "top_k": set(order[:3].tolist()),
        "top_p": nucleus,
        "greedy": {int(order[0])},
    }
    kinds = [
        ("min_p", {"min_p": 0.2}),
        ("top_k", {"top_k": 3}),
        ("top_p", {"top_p": 0.6}),
        ("greedy", {"temperature": 0.0}),
    ]
    seen: dict[str, set[int]] = {k: set() for k in allowed}
    for _ in range(150):
        seqs = [_seq([0], [], **kw) for _, kw in kinds]
        for (kind, _), tok in zip(kinds, sample(base.repeat(4, 1), seqs), strict=True):
            seen[kind].add(tok.token_id)
    for kind, tokens in seen.items():
        assert tokens <= allowed[kind], kind
    # the filters keep more than one token where they should, so the test is not vacuous
    assert len(seen["top_k"]) > 1 and len(seen["min_p"]) >= 1


def test_seed_repeats_with_penalties_and_min_p(llama: Path) -> None:
    params = SamplingParams(
        max_tokens=10, temperature=1.0, min_p=0.05, frequency_penalty=0.7, seed=5
    )
    other = SamplingParams(max_tokens=10, temperature=1.3, top_k=20)
    alone = LLMEngine(llama, EngineConfig()).generate([[1, 2, 3]], params)[0]
    batched = LLMEngine(llama, EngineConfig()).generate([[4, 5], [1, 2, 3]], [other, params])
    assert batched[1] == alone


def test_greedy_argmax_matches_torch_on_ties_and_nan() -> None:
    from kiln.llm.sampler import _argmax

    torch.manual_seed(0)
    logits = torch.randn(6, VOCAB)
    logits[1, 7] = logits[1, 250] = 1e4  # a tie: the first index wins
    logits[2, 40] = float("nan")  # NaN is the maximum for torch
    logits[3] = 0.0  # all equal
    non_contiguous = torch.randn(VOCAB, 6).t()
    for x in (logits, non_contiguous):
        assert torch.equal(_argmax(x), x.argmax(dim=-1))
    assert _argmax(logits)[1] == 7 and _argmax(logits)[2] == 40


def test_logit_bias_is_added_per_row_before_sampling() -> None:
    logits = torch.tensor([[0.0, 3.0, 1.0, 0.5]] * 3)
    seqs = [
        _seq([0], [], temperature=0, logit_bias=((1, -100.0),)),  # bans the argmax
        _seq([0], [], temperature=0, logit_bias=((3, 100.0),)),  # all but forces token 3
        _seq([0], [], temperature=0),  # no bias: untouched by its neighbours'
    ]
    assert [s.token_id for s in sample(logits, seqs)] == [2, 3, 1]
    # a forced token wins draws too, and the logprobs stay the model's own
    drawn = sample(logits[:1], [_seq([0], [], temperature=1.0, seed=3, logit_bias=((0, 100.0),),
                                     logprobs=1)])  # fmt: skip
    assert drawn[0].token_id == 0
    raw = torch.log_softmax(logits[0], dim=-1)
    assert drawn[0].logprobs is not None
    assert drawn[0].logprobs.logprob == pytest.approx(float(raw[0]))


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ([1, 2], "'logit_bias' must be an object, got [1, 2]"),
        ({"abc": 1}, "logit_bias keys must be token ids (integers), got 'abc'"),
        ({"5": "up"}, "logit_bias[5] must be a number, got 'up'"),
        ({"5": True}, "logit_bias[5] must be a number, got True"),
        ({"5": 101}, "logit_bias[5] must be in [-100, 100], got 101"),
    ],
)
def test_malformed_logit_bias_is_refused_naming_it(value: object, message: str) -> None:
    from kiln.llm.params import InvalidField, sampling_fields

    with pytest.raises(InvalidField) as info:
        sampling_fields({"logit_bias": value})
    assert info.value.field == "logit_bias" and info.value.message == message
    assert sampling_fields({"logit_bias": {"7": -2, "3": 1.5}})["logit_bias"] == (
        (3, 1.5),
        (7, -2.0),
    )


@pytest.mark.parametrize("chunked", [False, True])
def test_prompt_logprobs_are_the_model_s_for_every_prompt_token(llama: Path, chunked: bool) -> None:
    """vLLM's ``prompt_logprobs`` (the completions API's ``echo`` with ``logprobs``): for
    each prompt token after the first, its logprob under the model given the tokens before
    it, with the top alternatives. Split into chunks of 4 tokens, and with the prefix cache
    holding the same prompt already, the answer is the same."""
    import transformers

    prompt = [3, 14, 15, 9, 26, 5, 35, 8, 9, 7]
    config = EngineConfig(block_size=4, enable_prefix_caching=True)
    if chunked:
        config.max_num_batched_tokens = 4
    engine = LLMEngine(llama, config)
    warm = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    engine.generate([prompt], warm)  # now the prefix cache holds the prompt's blocks
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True, prompt_logprobs=3, n=2)
    engine.add_request("p", prompt, params)
    firsts = []
    while engine.has_work():
        firsts += [o for o in engine.step() if o.prompt_logprobs is not None]
    assert len(firsts) == 2  # each of the n samples gets them once, on its first output
    entries = firsts[0].prompt_logprobs
    assert entries is not None and firsts[1].prompt_logprobs == entries
    assert len(entries) == len(prompt) and entries[0] is None
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(llama), torch_dtype=torch.float32, attn_implementation="sdpa"
    ).eval()
    with torch.no_grad():
        ref = torch.log_softmax(model(torch.tensor([prompt])).logits[0].float(), dim=-1)
    for position, entry in enumerate(entries[1:], start=1):
        assert entry is not None and entry.token_id == prompt[position]
        expected = float(ref[position - 1, prompt[position]])
        assert entry.logprob == pytest.approx(expected, abs=1e-4)
        assert (
            entry.rank == int((ref[position - 1] > ref[position - 1, prompt[position]]).sum()) + 1
        )
        values, ids = ref[position - 1].topk(3)
        assert [t for t, _ in entry.top] == ids.tolist()
        assert [v for _, v in entry.top] == pytest.approx(values.tolist(), abs=1e-4)


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (-0.5, "temperature must be non-negative, got -0.5."),
        (2.5, "temperature must be in [0, 2], got 2.5."),
        (float("inf"), "temperature must be a finite number, got inf."),
        (float("nan"), "temperature must be a finite number, got nan."),
    ],
)
def test_temperature_has_vllms_bounds(value: float, message: str) -> None:
    from kiln.llm.params import InvalidField, sampling_fields

    with pytest.raises(InvalidField) as info:
        sampling_fields({"temperature": value})
    assert (info.value.field, info.value.message) == ("temperature", message)


def test_a_temperature_too_small_to_divide_by_is_raised_to_vllms_floor() -> None:
    """1e-300 divided into float32 logits overflowed to inf and sampled garbage; vLLM
    raises anything in (0, 0.01) to 0.01 (greedy at 0 stays greedy)."""
    from kiln.llm.params import sampling_fields

    assert sampling_fields({"temperature": 1e-300})["temperature"] == 0.01
    assert sampling_fields({"temperature": 0})["temperature"] == 0
    assert sampling_fields({"temperature": 2})["temperature"] == 2
