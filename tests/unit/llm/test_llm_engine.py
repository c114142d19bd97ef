"""kiln's engine against ``transformers``: greedy tokens must be identical, alone, batched,
across preemption and chunked prefill; blocks must all come back."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("transformers")

from kiln.core.errors import KilnError
from kiln.llm.config import EngineConfig, ModelArgs
from kiln.llm.engine import LLMEngine
from kiln.llm.sequence import SamplingParams
from tests.llm_models import all_blocks_returned, build_tiny_llm, reference_generate

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
PROMPTS = [
    [5, 17, 42, 99, 3],
    [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25],
    [250],
    list(range(30, 70)),
]


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_llm(tmp_path_factory.mktemp("llama"))


@pytest.fixture(scope="module")
def expected(llama: Path) -> list[list[int]]:
    return [reference_generate(llama, p, GREEDY.max_tokens) for p in PROMPTS]


def _engine(folder: Path, **kw: int) -> LLMEngine:
    return LLMEngine(folder, EngineConfig(**kw))  # type: ignore[arg-type]


def test_single_requests_match_transformers(llama: Path, expected: list[list[int]]) -> None:
    engine = _engine(llama)
    for prompt, want in zip(PROMPTS, expected, strict=True):
        assert engine.generate([prompt], GREEDY) == [want]
    all_blocks_returned(engine)


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_batched_requests_of_different_lengths_match(
    llama: Path, expected: list[list[int]], backend: str
) -> None:
    engine = LLMEngine(llama, EngineConfig(attention_backend=backend))
    assert engine.runner.attention_backend == backend
    assert engine.generate(PROMPTS, GREEDY) == expected
    # every step after the first mixed several sequences in one batch
    assert engine.stats.num_steps < sum(GREEDY.max_tokens for _ in PROMPTS)
    all_blocks_returned(engine)


def test_preemption_by_recompute_keeps_tokens_identical(
    llama: Path, expected: list[list[int]]
) -> None:
    # 14 blocks of 4 tokens: the first three grow to 17 blocks, so one must give way
    engine = _engine(llama, block_size=4, num_gpu_blocks=14)
    seqs = []
    for i, prompt in enumerate(PROMPTS):
        seqs.append(engine.add_request(f"r{i}", prompt, GREEDY))
    outputs: dict[str, list[int]] = {}
    while engine.has_work():
        for result in engine.step():
            outputs.setdefault(result.request_id, []).extend(result.new_token_ids)
        live = engine.scheduler.running + list(engine.scheduler.waiting)
        engine.block_manager.check(live)
    assert engine.scheduler.num_preemptions > 0
    assert [outputs[f"r{i}"] for i in range(len(PROMPTS))] == expected
    # vLLM's ``request_num_preemptions``: one observation per request, summing to the total
    preemptions = engine.stats.histograms.num_preemptions
    assert preemptions.count == len(PROMPTS)
    assert preemptions.total == engine.scheduler.num_preemptions
    all_blocks_returned(engine)


def test_chunked_prefill_keeps_tokens_identical(llama: Path, expected: list[list[int]]) -> None:
    # a budget of 7 tokens per step splits the 19- and 40-token prompts into chunks
    engine = _engine(llama, max_num_batched_tokens=7)
    assert engine.generate(PROMPTS, GREEDY) == expected
    assert engine.stats.max_step_tokens <= 7
    all_blocks_returned(engine)


def test_max_num_seqs_bounds_the_running_batch(llama: Path, expected: list[list[int]]) -> None:
    engine = _engine(llama, max_num_seqs=2)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"r{i}", prompt, GREEDY)
    outputs: dict[str, list[int]] = {}
    while engine.has_work():
        for result in engine.step():
            outputs.setdefault(result.request_id, []).extend(result.new_token_ids)
        assert len(engine.scheduler.running) <= 2
    assert [outputs[f"r{i}"] for i in range(len(PROMPTS))] == expected


def test_new_requests_join_between_steps(llama: Path, expected: list[list[int]]) -> None:
    engine = _engine(llama)
    engine.add_request("a", PROMPTS[0], GREEDY)
    outputs: dict[str, list[int]] = {"a": [], "b": []}
    for _ in range(3):
        for r in engine.step():
            outputs[r.request_id].extend(r.new_token_ids)
    engine.add_request("b", PROMPTS[1], GREEDY)
    joined = engine.scheduler.schedule()
    # "a" decodes one token while "b" prefills, in the same step
    assert [s.request_id for s in joined.seqs] == ["a", "b"]
    assert joined.num_new_tokens == [1, len(PROMPTS[1])]
    sampled = engine.runner.run(joined)
    for seq, n in zip(joined.seqs, joined.num_new_tokens, strict=True):
        seq.num_computed_tokens += n
        tok = sampled[seq.seq_id].token_id
        seq.append(tok)
        outputs[seq.request_id].append(tok)
    while engine.has_work():
        for r in engine.step():
            outputs[r.request_id].extend(r.new_token_ids)
    assert outputs == {"a": expected[0], "b": expected[1]}


def test_abort_frees_blocks(llama: Path) -> None:
    engine = _engine(llama, block_size=4)
    engine.add_request("x", PROMPTS[3], GREEDY)
    engine.add_request("y", PROMPTS[1], GREEDY)
    engine.step()
    assert engine.block_manager.num_free_blocks < engine.block_manager.num_blocks
    assert engine.abort("x")
    engine.block_manager.check(engine.scheduler.running)
    assert engine.abort("y")
    assert not engine.abort("y")
    all_blocks_returned(engine)


def test_stop_token_and_max_tokens(llama: Path, expected: list[list[int]]) -> None:
    engine = _engine(llama)
    stop = expected[0][4]
    first = expected[0].index(stop)
    params = SamplingParams(max_tokens=12, temperature=0.0, stop_token_ids=(stop,))
    engine.add_request("s", PROMPTS[0], params)
    results = []
    while engine.has_work():
        results.extend(engine.step())
    assert [r.new_token_ids[0] for r in results] == expected[0][: first + 1]
    assert results[-1].finish_reason == "stop"
    short = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    assert engine.generate([PROMPTS[0]], short) == [expected[0][:3]]


def test_seeded_sampling_is_reproducible_whatever_the_batch(llama: Path) -> None:
    params = SamplingParams(max_tokens=10, temperature=0.9, top_k=50, top_p=0.9, seed=7)
    alone = _engine(llama).generate([PROMPTS[0]], params)[0]
    other = SamplingParams(max_tokens=10, temperature=1.0, seed=1)
    batched = _engine(llama).generate([PROMPTS[1], PROMPTS[0]], [other, params])[1]
    assert alone == batched
    assert all(0 <= t < 300 for t in alone)


def test_requests_that_can_never_run_are_refused(llama: Path) -> None:
    from kiln.core.errors import KilnError

    engine = _engine(llama)
    with pytest.raises(KilnError, match="maximum context length is 256"):
        engine.add_request("long", [1] * 256, GREEDY)
    with pytest.raises(KilnError, match="max_tokens must be at least 1"):
        engine.add_request("zero", [1, 2], SamplingParams(max_tokens=0))
    with pytest.raises(KilnError, match=r"token ids must be in \[0, 300\)"):
        engine.add_request("vocab", [1, 300], GREEDY)


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_type": "linear", "factor": 2.0},
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        },
    ],
)
def test_rope_scaling_matches_transformers(tmp_path: Path, rope: dict[str, object]) -> None:
    folder = build_tiny_llm(tmp_path / "m", rope_scaling=rope)
    want = [reference_generate(folder, p, 8) for p in PROMPTS[:2]]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    assert _engine(folder).generate(PROMPTS[:2], params) == want


def test_qwen2_matches_transformers(tmp_path: Path) -> None:
    folder = build_tiny_llm(tmp_path / "q", arch="qwen2")
    want = [reference_generate(folder, p, 8) for p in PROMPTS[:2]]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    assert _engine(folder).generate(PROMPTS[:2], params) == want


@pytest.mark.parametrize("window", [None, 4096])
def test_mistral_matches_transformers(tmp_path: Path, window: int | None) -> None:
    folder = build_tiny_llm(tmp_path / "m", arch="mistral", sliding_window=window)
    want = [reference_generate(folder, p, 8) for p in PROMPTS[:2]]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    engine = _engine(folder)
    assert engine.config.max_model_len == 256  # a window wider than the context changes nothing
    assert engine.generate(PROMPTS[:2], params) == want


def test_a_sliding_window_serves_the_whole_context(tmp_path: Path) -> None:
    """Mistral's window no longer caps max_model_len: past it, attention slides, equal to
    transformers (more in test_llm_sliding_window.py)."""
    folder = build_tiny_llm(tmp_path / "m", arch="mistral", sliding_window=48)
    engine = _engine(folder)
    assert engine.config.max_model_len == 256
    prompt = list(range(30, 70))  # 40 tokens: the window slides after 8 more
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    assert engine.generate([prompt], params) == [reference_generate(folder, prompt, 20)]
    engine.check_request(200, params)
    with pytest.raises(KilnError, match="maximum context length is 256 tokens"):
        engine.check_request(256, params)
    all_blocks_returned(engine)


def test_qwen2_window_counts_only_when_used(tmp_path: Path) -> None:
    args = {"architectures": ["Qwen2ForCausalLM"], "vocab_size": 8, "hidden_size": 8,
            "intermediate_size": 8, "num_hidden_layers": 1, "num_attention_heads": 2,
            "sliding_window": 32}  # fmt: skip
    assert ModelArgs.from_dict(args).sliding_window is None
    assert ModelArgs.from_dict({**args, "use_sliding_window": True}).sliding_window == 32
