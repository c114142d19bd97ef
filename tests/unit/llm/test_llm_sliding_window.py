"""Sliding-window attention (Mistral; Qwen2 with ``use_sliding_window``) against
``transformers``: prompts and outputs several windows long, greedy tokens identical alone,
batched, with chunked prefill, prefix-cache hits, preemption and ``n > 1``, on both CPU
attention backends; the blocks all come back. The flex backend's are in
test_llm_attention_flex.py, the kernels' against a dense reference in
test_llm_paged_attention.py."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from kiln.core.errors import KilnError
from kiln.llm.config import EngineConfig, ModelArgs
from kiln.llm.engine import LLMEngine
from kiln.llm.sequence import SamplingParams
from tests.llm_models import all_blocks_returned, build_tiny_llm, drain, reference_generate

WINDOW = 8
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
#: 40, 5 and 19 tokens: the first prompt is five windows long, the second fits in one
PROMPTS = [list(range(30, 70)), [5, 17, 42, 99, 3], list(range(7, 26))]
BACKENDS = ["torch", "cpu"]


@pytest.fixture(scope="module")
def mistral(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_llm(tmp_path_factory.mktemp("mistral"), "mistral", sliding_window=WINDOW)


@pytest.fixture(scope="module")
def expected(mistral: Path) -> list[list[int]]:
    return [reference_generate(mistral, p, GREEDY.max_tokens) for p in PROMPTS]


def _engine(folder: Path, backend: str, **kw: object) -> LLMEngine:
    engine = LLMEngine(folder, EngineConfig(attention_backend=backend, **kw))  # type: ignore[arg-type]
    assert engine.runner.attention_backend == backend
    return engine


def test_the_window_changes_the_reference(
    tmp_path: Path, mistral: Path, expected: list[list[int]]
) -> None:
    """The same weights without the window generate other tokens: the tests below would
    catch attention that looks past the window."""
    full = build_tiny_llm(tmp_path / "full", "mistral", sliding_window=None)
    assert reference_generate(full, PROMPTS[0], GREEDY.max_tokens) != expected[0]
    # a prompt inside the window starts the same, then its output slides out of it
    short = reference_generate(full, PROMPTS[1], GREEDY.max_tokens)
    assert short[:3] == expected[1][:3] and short != expected[1]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("block_size", [16, 4], ids=["window-in-a-block", "window-over-blocks"])
def test_single_and_batched_requests_match(
    mistral: Path, expected: list[list[int]], backend: str, block_size: int
) -> None:
    engine = _engine(mistral, backend, block_size=block_size)
    assert engine.config.max_model_len == 256  # the window no longer caps the context
    assert engine.generate(PROMPTS[:1], GREEDY) == expected[:1]
    assert engine.generate(PROMPTS, GREEDY) == expected
    all_blocks_returned(engine)


@pytest.mark.parametrize("backend", BACKENDS)
def test_chunked_prefill_matches(mistral: Path, expected: list[list[int]], backend: str) -> None:
    # 7 tokens a step: the 40-token prompt in chunks that start mid-window and mid-block
    engine = _engine(mistral, backend, block_size=4, max_num_batched_tokens=7)
    assert engine.generate(PROMPTS, GREEDY) == expected
    assert engine.stats.max_step_tokens <= 7
    all_blocks_returned(engine)


@pytest.mark.parametrize("backend", BACKENDS)
def test_prefix_cache_hits_match(mistral: Path, backend: str) -> None:
    engine = _engine(mistral, backend, block_size=4)
    shared = list(range(100, 136))  # 36 tokens: 9 full blocks, four and a half windows
    prompts = {"a": [*shared, 3, 5], "b": [*shared, 11, 13, 17, 19, 23]}
    engine.add_request("a", prompts["a"], GREEDY)
    got = drain(engine)
    engine.add_request("b", prompts["b"], GREEDY)
    got.update(drain(engine))
    assert engine.block_manager.stats.hits == 36  # b computed only its 5 own tokens
    for rid, prompt in prompts.items():
        assert got[(rid, 0)] == reference_generate(mistral, prompt, GREEDY.max_tokens)
    all_blocks_returned(engine)


@pytest.mark.parametrize("backend", BACKENDS)
def test_preemption_keeps_tokens_identical(
    mistral: Path, expected: list[list[int]], backend: str
) -> None:
    # 30 blocks of 4 tokens hold 120; the three requests grow to 132: one gives way
    engine = _engine(mistral, backend, block_size=4, num_gpu_blocks=30)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"r{i}", prompt, GREEDY)
    got = drain(engine)
    assert engine.scheduler.num_preemptions > 0
    assert [got[(f"r{i}", 0)] for i in range(len(PROMPTS))] == expected
    all_blocks_returned(engine)


@pytest.mark.parametrize("backend", BACKENDS)
def test_n_samples_copy_on_write(mistral: Path, backend: str) -> None:
    """Three seeded samples share the 19-token prompt's blocks and copy the partial one;
    each is the request alone with its own seed."""
    params = SamplingParams(max_tokens=16, temperature=1.0, seed=40, n=3)
    engine = _engine(mistral, backend, block_size=4)
    engine.add_request("r", PROMPTS[2], params)
    got = drain(engine)
    for i in range(3):
        alone = _engine(mistral, backend, block_size=4).generate(
            [PROMPTS[2]], replace(params, n=1, seed=40 + i)
        )
        assert got[("r", i)] == alone[0]
    assert len({tuple(v) for v in got.values()}) > 1
    all_blocks_returned(engine)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("layer_types", [True, False], ids=["layer_types", "max_window_layers"])
def test_qwen2_windows_its_upper_layers(tmp_path: Path, backend: str, layer_types: bool) -> None:
    """``use_sliding_window`` with ``max_window_layers: 1``: layer 0 attends to everything,
    layer 1 within the window (transformers >= 5 writes that out as ``layer_types``; older
    configs carry only ``max_window_layers``)."""
    folder = build_tiny_llm(
        tmp_path / "q", "qwen2", use_sliding_window=True, sliding_window=WINDOW,
        max_window_layers=1,
    )  # fmt: skip
    config = json.loads((folder / "config.json").read_text())
    assert config["layer_types"] == ["full_attention", "sliding_attention"]
    if not layer_types:
        del config["layer_types"]
        (folder / "config.json").write_text(json.dumps(config))
    want = [reference_generate(folder, p, 16) for p in PROMPTS[:2]]
    engine = _engine(folder, backend, block_size=4, max_num_batched_tokens=16)
    assert engine.runner.windows == [None, WINDOW]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    assert engine.generate(PROMPTS[:2], params) == want
    all_blocks_returned(engine)


_QWEN2 = {"architectures": ["Qwen2ForCausalLM"], "vocab_size": 8, "hidden_size": 8,
          "intermediate_size": 8, "num_hidden_layers": 4, "num_attention_heads": 2,
          "sliding_window": 32, "use_sliding_window": True}  # fmt: skip


def test_which_layers_use_the_window() -> None:
    def windows(raw: dict[str, object]) -> list[int | None]:
        return ModelArgs.from_dict(raw).layer_windows()

    # transformers' default max_window_layers is 28: no layer of a 4-layer model
    assert windows(_QWEN2) == [None] * 4
    assert windows({**_QWEN2, "max_window_layers": 1}) == [None, 32, 32, 32]
    kinds = ["sliding_attention", "full_attention"] * 2
    assert windows({**_QWEN2, "layer_types": kinds}) == [32, None, 32, None]
    assert windows({**_QWEN2, "use_sliding_window": False, "max_window_layers": 0}) == [None] * 4
    mistral = {**_QWEN2, "architectures": ["MistralForCausalLM"]}
    assert windows(mistral) == [32] * 4
    assert windows({**mistral, "sliding_window": None}) == [None] * 4
    # Llama has no window, whatever its config says
    assert windows({**mistral, "architectures": ["LlamaForCausalLM"]}) == [None] * 4


def test_unsupported_window_configs_are_refused() -> None:
    with pytest.raises(KilnError, match="layer_types 'full_attention' and 'sliding_attention'"):
        ModelArgs.from_dict({**_QWEN2, "layer_types": ["chunked_attention"] * 4})
    with pytest.raises(KilnError, match=r"one per layer \(4\)"):
        ModelArgs.from_dict({**_QWEN2, "layer_types": ["full_attention"]})
    with pytest.raises(KilnError, match="sliding_window must be a positive integer, got 0"):
        ModelArgs.from_dict({**_QWEN2, "sliding_window": 0})
