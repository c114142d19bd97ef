"""Speculative decoding (vLLM's ``--speculative-config``): greedy tokens identical with and
without it (n-gram and draft model; batched, prefix-cached, chunked, preempted), stops
inside an accepted run, the rejection sampler's distribution, the counters, bad configs."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from kiln.core.errors import KilnError
from kiln.llm.config import EngineConfig
from kiln.llm.engine import LLMEngine
from kiln.llm.sequence import SamplingParams
from kiln.llm.spec_config import SpeculativeConfig
from tests.llm_models import all_blocks_returned, build_tiny_llm, drain

GREEDY = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
#: prompts that repeat themselves (n-gram lookup finds drafts) and ones that do not
PROMPTS = [
    [5, 17, 42, 99, 3] * 4,
    list(range(30, 70)),
    [250],
    [7, 8, 9, 10, 11, 12] * 3,
    [100, 101, 102, 100, 101, 102, 100],
]
NGRAM = (
    '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4,'
    ' "prompt_lookup_min": 1}'
)


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_llm(tmp_path_factory.mktemp("llama"))


@pytest.fixture(scope="module")
def expected(llama: Path) -> list[list[int]]:
    return LLMEngine(llama, EngineConfig()).generate(PROMPTS, GREEDY)


def _engine(folder: Path, spec: str | None = NGRAM, **kw: object) -> LLMEngine:
    config = EngineConfig(**kw)  # type: ignore[arg-type]
    config.speculative_config = SpeculativeConfig.from_json(spec) if spec else None
    return LLMEngine(folder, config)


def _run(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, params)
    out = drain(engine)  # checks the block manager's invariants after every step
    all_blocks_returned(engine)
    return [out[(f"r{i}", 0)] for i in range(len(prompts))]


def test_ngram_greedy_is_identical_batched_with_prefix_caching(
    llama: Path, expected: list[list[int]]
) -> None:
    engine = _engine(llama, enable_prefix_caching=True)
    # twice: the second round's prompts hit the prefix cache the first one filled
    assert _run(engine, PROMPTS, GREEDY) == expected
    assert _run(engine, PROMPTS, GREEDY) == expected
    assert engine.block_manager.stats.hits > 0
    stats = engine.spec_stats
    assert stats is not None and stats.num_accepted_tokens > 0
    # drafts saved steps: fewer target steps than tokens of the longest-running request
    assert stats.num_drafts > 0


def test_ngram_greedy_is_identical_one_request_at_a_time(
    llama: Path, expected: list[list[int]]
) -> None:
    for prompt, want in zip(PROMPTS, expected, strict=True):
        engine = _engine(llama, enable_prefix_caching=False)
        assert _run(engine, [prompt], GREEDY) == [want]
        if prompt == PROMPTS[0]:
            # its output repeats: 40 tokens (one from the prefill step) in far fewer steps
            assert engine.stats.num_steps < GREEDY.max_tokens // 2


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_ngram_greedy_is_identical_across_preemption_and_chunked_prefill(
    llama: Path, expected: list[list[int]], backend: str
) -> None:
    # 20 blocks of 4 tokens for 5 requests growing to ~60 tokens: preemptions; a budget of
    # 9 tokens a step splits the prompts and limits the drafts
    engine = _engine(
        llama,
        block_size=4,
        num_gpu_blocks=20,
        max_num_batched_tokens=9,
        attention_backend=backend,
    )
    assert engine.runner.attention_backend == backend
    assert _run(engine, PROMPTS, GREEDY) == expected
    assert engine.scheduler.num_preemptions > 0
    assert engine.spec_stats is not None and engine.spec_stats.num_accepted_tokens > 0


@pytest.mark.parametrize("max_tokens", [1, 2, 5, 7])
def test_accepted_run_stops_at_max_tokens(
    llama: Path, expected: list[list[int]], max_tokens: int
) -> None:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    engine = _engine(llama)
    assert _run(engine, PROMPTS, params) == [w[:max_tokens] for w in expected]


def test_accepted_run_stops_at_a_stop_token(llama: Path, expected: list[list[int]]) -> None:
    # the first prompt's greedy output repeats one token: drafts of it are accepted in runs,
    # and a stop token inside a run ends the output there
    want = expected[1]
    stop = want[9]
    params = SamplingParams(max_tokens=40, temperature=0.0, stop_token_ids=(stop,))
    engine = _engine(llama)
    seq = engine.add_request("r", PROMPTS[1], params)
    out = drain(engine)
    assert out[("r", 0)] == want[: want.index(stop) + 1]
    assert seq.finish_reason == "stop" and seq.stop_token_id == stop
    all_blocks_returned(engine)


def test_requests_that_cannot_speculate_decode_as_before(llama: Path) -> None:
    # penalties and logprobs make each row's processing depend on the tokens before it:
    # those requests decode one token a step, in the same batch as the speculating ones
    plain = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, logprobs=2)
    penal = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, presence_penalty=1)
    base = _engine(llama, spec=None)
    want = [base.generate([PROMPTS[0]], plain)[0], base.generate([PROMPTS[3]], penal)[0]]
    engine = _engine(llama)
    engine.add_request("a", PROMPTS[0], plain)
    engine.add_request("b", PROMPTS[3], penal)
    engine.add_request("c", PROMPTS[0], GREEDY)
    out = drain(engine)
    assert [out[("a", 0)], out[("b", 0)]] == want
    assert engine.spec_stats is not None and engine.spec_stats.num_drafts > 0


def test_counters_add_up(llama: Path) -> None:
    engine = _engine(llama)
    _run(engine, PROMPTS, GREEDY)
    stats = engine.spec_stats
    assert stats is not None
    assert stats.num_accepted_tokens == sum(stats.accepted_per_pos)
    assert stats.num_accepted_tokens <= stats.num_draft_tokens <= 3 * stats.num_drafts
    # position i is accepted only when position i - 1 was
    assert sorted(stats.accepted_per_pos, reverse=True) == stats.accepted_per_pos
    # every output token came from a step: accepted drafts plus one per step that sampled
    generated = len(PROMPTS) * GREEDY.max_tokens
    assert engine.stats.num_generation_tokens == generated


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ('{"method": "ngram", "num_speculative_tokens": 0}', "at least 1, got 0"),
        ('{"method": "ngram", "num_speculative_tokens": -2}', "at least 1, got -2"),
        ('{"method": "eagle", "num_speculative_tokens": 2}', "method 'eagle' is not supported"),
        ('{"method": "ngram"}', "'num_speculative_tokens' is required"),
        ('{"method": "ngram", "num_speculative_tokens": 2, "x": 1}', "field 'x'"),
        ('{"method": "draft_model", "num_speculative_tokens": 2}', "needs 'model'"),
        (
            '{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 5,'
            ' "prompt_lookup_max": 2}',
            "prompt_lookup_min <= prompt_lookup_max",
        ),
        ("[1]", "JSON object"),
        ("{", "not JSON"),
    ],
)
def test_bad_config_is_refused_naming_the_reason(raw: str, message: str) -> None:
    with pytest.raises(KilnError, match="speculative_config") as info:
        SpeculativeConfig.from_json(raw)
    assert message in str(info.value)


def test_too_many_speculative_tokens_are_refused_at_load(llama: Path) -> None:
    spec = json.dumps({"method": "ngram", "num_speculative_tokens": 16})
    with pytest.raises(KilnError, match="too large: 1 \\+ 16 tokens do not fit"):
        _engine(llama, spec, max_num_batched_tokens=8)
    with pytest.raises(KilnError, match="too large for max_model_len 12"):
        _engine(llama, spec, max_model_len=12)


def _pbtxt(spec: str) -> EngineConfig:
    from google.protobuf import text_format

    from kiln.backends.base import InstanceSpec
    from kiln.config.model_config_pb2 import ModelConfig
    from kiln.llm.backend import engine_config

    config = ModelConfig(name="m", backend="llm")
    config.parameters["speculative_config"].string_value = spec
    text = text_format.MessageToString(config)
    instance = InstanceSpec(name="m_0", kind="cpu", device_id=0, index=0, total_instances=1)
    return engine_config(text_format.Parse(text, ModelConfig()), instance)


def test_config_pbtxt_parameter_and_cli_flag() -> None:
    from kiln.cli.llm_options import served_models

    spec = _pbtxt(NGRAM).speculative_config
    assert spec == SpeculativeConfig("ngram", 3, None, 4, 1)
    with pytest.raises(KilnError, match="model 'm': speculative_config: method 'medusa'"):
        _pbtxt('{"method": "medusa", "num_speculative_tokens": 2}')
    # --speculative-config becomes the same parameter
    (config,) = served_models((Path("."),), ("m",), {"speculative_config": NGRAM})
    assert config.parameters["speculative_config"].string_value == NGRAM
    # vLLM: {"model": "ngram"} names the method; {"model": PATH} a draft model
    assert SpeculativeConfig.from_json('{"model": "ngram", "num_speculative_tokens": 2}') == (
        SpeculativeConfig("ngram", 2, None, 5, 5)  # vLLM's defaults
    )
    one = SpeculativeConfig.from_json('{"method": "ngram", "num_speculative_tokens": 2, '
                                      '"prompt_lookup_max": 3}')  # fmt: skip
    assert (one.prompt_lookup_min, one.prompt_lookup_max) == (3, 3)
    draft = SpeculativeConfig.from_json('{"model": "/d", "num_speculative_tokens": 2}')
    assert (draft.method, draft.model) == ("draft_model", "/d")


# -- the rejection sampler -----------------------------------------------------------------

#: the target's distributions at three places (two drafts and the bonus) over 5 tokens, and
#: a draft model's, deliberately unlike them (total variation 0.3-0.5 from the target's)
TARGET = [
    [0.50, 0.20, 0.15, 0.10, 0.05],
    [0.05, 0.05, 0.30, 0.40, 0.20],
    [0.25, 0.25, 0.20, 0.20, 0.10],
]
DRAFT = [
    [0.10, 0.20, 0.50, 0.10, 0.10],
    [0.40, 0.30, 0.10, 0.10, 0.10],
]
TRIALS = 20_000


def _tv(counts: list[int], probs: list[float]) -> float:
    total = sum(counts)
    return 0.5 * sum(abs(c / total - p) for c, p in zip(counts, probs, strict=True))


@functools.cache
def _emitted(case: str) -> list[list[int]]:
    """The tokens one verification emits, per trial: drafts drawn from ``DRAFT``
    (``draft_model``), or the same drafts 0, 3 every time as n-gram lookup gives them."""
    import torch

    from kiln.llm.spec_decode import rejection_sample

    gen = torch.Generator().manual_seed(1234)
    target = torch.tensor(TARGET)
    q = torch.tensor(DRAFT) if case == "draft_model" else None
    fixed = [0, 3]
    runs = []
    for _ in range(TRIALS):
        if q is not None:
            drafts = torch.multinomial(q, 1, generator=gen).squeeze(1).tolist()
        else:
            drafts = fixed
        accepted, token = rejection_sample(target, drafts, q, gen)
        runs.append([*drafts[:accepted], token])
    return runs


@pytest.mark.parametrize("case", ["draft_model", "ngram"])
def test_rejection_sampler_keeps_the_target_distribution(case: str) -> None:
    runs = _emitted(case)
    # the first emitted token follows the target's first distribution, the second (when
    # the first was an accepted draft) its second, the third (both accepted) its bonus one
    for place, probs in enumerate(TARGET):
        counts = [0] * 5
        for run in runs:
            if len(run) > place:
                counts[run[place]] += 1
        assert sum(counts) > 1000, f"place {place}: too few samples to judge"
        assert _tv(counts, probs) < 0.025, (place, counts)
    if case == "draft_model":
        # drafts were accepted often enough to matter, and blind acceptance would fail
        # the bound above: the draft's own distribution is far from the target's
        assert sum(len(r) > 1 for r in runs) > TRIALS // 3
        assert 0.5 * sum(abs(p - q) for p, q in zip(TARGET[0], DRAFT[0], strict=True)) > 0.3


def test_rejection_sampler_acceptance_rate_is_the_overlap() -> None:
    # P(accept draft 0) = sum(min(p, q)) (Leviathan et al.): 0.1 + 0.2 + 0.15 + 0.1 + 0.05
    runs = _emitted("draft_model")
    rate = sum(len(r) > 1 for r in runs) / TRIALS
    assert rate == pytest.approx(0.60, abs=0.015)
    # an n-gram draft d is accepted with probability p(d): 0.5 for token 0, then 0.4
    runs = _emitted("ngram")
    assert sum(len(r) > 1 for r in runs) / TRIALS == pytest.approx(0.5, abs=0.015)
    assert sum(len(r) > 2 for r in runs) / TRIALS == pytest.approx(0.2, abs=0.015)


def test_sampled_requests_speculate_and_seeds_reproduce(llama: Path) -> None:
    params = SamplingParams(max_tokens=30, temperature=0.7, top_k=20, seed=7, ignore_eos=True)
    first = _run(_engine(llama), PROMPTS, params)
    engine = _engine(llama)
    # alone or batched, a seeded request draws the same tokens
    assert _run(engine, [PROMPTS[0]], params) == [first[0]]
    assert _run(engine, PROMPTS, params) == first
    assert all(len(t) == 30 for t in first)
    assert engine.spec_stats is not None and engine.spec_stats.num_accepted_tokens > 0


# -- the draft model -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def drafts(llama: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Draft models: the target itself (every draft accepted), the target with noise in its
    MLPs (some accepted), an unrelated random model (hardly any), and one whose vocabulary
    differs."""
    import torch
    import transformers

    root = tmp_path_factory.mktemp("drafts")
    model = transformers.AutoModelForCausalLM.from_pretrained(str(llama))
    torch.manual_seed(1)
    with torch.no_grad():
        for name, weight in model.named_parameters():
            if "mlp" in name:
                weight.add_(torch.randn_like(weight) * weight.std() * 0.5)
    model.save_pretrained(str(root / "noisy"), safe_serialization=True)
    return {
        "self": llama,
        "noisy": root / "noisy",
        "other": build_tiny_llm(root / "other", num_hidden_layers=1, hidden_size=32),
        "vocab": build_tiny_llm(root / "vocab", vocab_size=320),
    }


def _draft(path: Path, k: int = 3) -> str:
    return json.dumps({"model": str(path), "num_speculative_tokens": k})


@pytest.mark.parametrize("draft", ["self", "noisy", "other"])
def test_draft_model_greedy_is_identical(
    llama: Path, expected: list[list[int]], drafts: dict[str, Path], draft: str
) -> None:
    # few blocks and a small budget: chunked prompts, preemption, drafts cut short
    engine = _engine(
        llama, _draft(drafts[draft]), block_size=4, num_gpu_blocks=24, max_num_batched_tokens=10
    )
    assert _run(engine, PROMPTS, GREEDY) == expected
    # and again, the prompts now in the prefix cache (the draft recomputes its own K/V)
    assert _run(engine, PROMPTS, GREEDY) == expected
    assert engine.scheduler.num_preemptions > 0
    stats = engine.spec_stats
    assert stats is not None and stats.num_drafts > 0
    rate = stats.num_accepted_tokens / stats.num_draft_tokens
    if draft == "self":
        assert rate > 0.95
    elif draft == "noisy":
        assert 0.05 < rate < 0.95


def test_draft_model_sampled_keeps_acceptance_and_seeds(
    llama: Path, drafts: dict[str, Path]
) -> None:
    params = SamplingParams(max_tokens=24, temperature=0.8, top_p=0.9, seed=3, ignore_eos=True)
    first = _run(_engine(llama, _draft(drafts["self"])), PROMPTS, params)
    engine = _engine(llama, _draft(drafts["self"]))
    assert _run(engine, PROMPTS[:2], params) == first[:2]
    stats = engine.spec_stats
    # the draft's distribution is the target's (up to rounding): min(1, p/q) ~ 1
    assert stats is not None and stats.num_accepted_tokens / stats.num_draft_tokens > 0.9


def test_draft_model_with_another_vocabulary_is_refused(
    llama: Path, drafts: dict[str, Path]
) -> None:
    with pytest.raises(KilnError, match="vocabulary of 320 tokens, the target 300"):
        _engine(llama, _draft(drafts["vocab"]))


def test_vllm_model_json_takes_speculative_config(tmp_path: Path) -> None:
    from kiln.llm import model_json

    version = tmp_path / "m" / "1"
    version.mkdir(parents=True)
    (tmp_path / "hf").mkdir()
    spec = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3}
    args = {"model": str(tmp_path / "hf"), "speculative_config": spec}
    (version / "model.json").write_text(json.dumps(args))
    engine = model_json.load("m", version).engine
    assert engine.speculative_config == SpeculativeConfig("ngram", 2, None, 3, 3)
    args["speculative_config"] = {"method": "ngram", "num_speculative_tokens": 0}
    (version / "model.json").write_text(json.dumps(args))
    with pytest.raises(KilnError, match=r"model 'm': model\.json: speculative_config: num_spec"):
        model_json.load("m", version)


def test_a_failing_draft_pass_costs_only_its_drafts(
    llama: Path, expected: list[list[int]], drafts: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    # a fault injected into the draft's forward pass (there is no real way to make a
    # loaded model fail on demand): the step runs without drafts, the outputs are unchanged
    from kiln.llm.draft_model import DraftProposer

    engine = _engine(llama, _draft(drafts["self"]))
    assert isinstance(engine.proposer, DraftProposer)
    runner = engine.proposer.runner
    real = runner._eager
    calls = {"n": 0}

    def flaky(*args: object, **kwargs: object) -> object:
        calls["n"] += 1
        if calls["n"] in (2, 5):
            raise RuntimeError("injected")
        return real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(runner, "_eager", flaky)
    assert _run(engine, PROMPTS, GREEDY) == expected
    assert calls["n"] > 5 and engine.spec_stats is not None
    assert engine.spec_stats.num_accepted_tokens > 0
