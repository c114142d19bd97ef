"""The LLM engine on CUDA: compiled flex attention and CUDA-graph decode (needs a GPU and a
CUDA build of torch with Triton). Greedy tokens must equal ``transformers``' with and
without graphs; decode tokens/s with and without graphs is printed (`pytest -s`), never
asserted."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from kiln.llm.config import EngineConfig
from kiln.llm.engine import LLMEngine
from kiln.llm.sequence import SamplingParams
from tests.llm_models import build_tiny_llm, reference_generate

pytestmark = pytest.mark.gpu

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
PROMPTS = [
    [5, 17, 42, 99, 3],
    [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25],
    [250],
    list(range(30, 70)),
    list(range(100, 140)),
]


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import torch

    assert torch.cuda.is_available(), "a CUDA build of torch is needed for the GPU path"
    return build_tiny_llm(tmp_path_factory.mktemp("llama"))


@pytest.fixture(scope="module")
def expected(llama: Path) -> list[list[int]]:
    # the reference runs on the CPU in float32, as the CPU tests' does
    return [reference_generate(llama, p, GREEDY.max_tokens) for p in PROMPTS]


def _engine(folder: Path, **kw: object) -> LLMEngine:
    return LLMEngine(folder, EngineConfig(device="cuda", **kw))  # type: ignore[arg-type]


@pytest.mark.parametrize("enforce_eager", [True, False], ids=["eager", "cuda-graphs"])
def test_flex_on_cuda_matches_transformers(
    llama: Path, expected: list[list[int]], enforce_eager: bool
) -> None:
    # flex, auto's choice on CUDA (triton: test_llm_triton_gpu.py)
    engine = _engine(llama, enforce_eager=enforce_eager, max_num_seqs=8, attention_backend="flex")
    assert engine.runner.attention_backend == "flex"
    graphs = engine.runner.graphs
    assert (graphs is None) == enforce_eager
    assert engine.generate(PROMPTS, GREEDY) == expected
    # prompts one by one: batch 1 decode graphs
    for prompt, want in zip(PROMPTS[:2], expected[:2], strict=True):
        assert engine.generate([prompt], GREEDY) == [want]
    if graphs is not None:
        assert graphs.num_replays > 0


def test_chunked_prefill_mixed_with_graph_decodes(llama: Path, expected: list[list[int]]) -> None:
    engine = _engine(llama, max_num_batched_tokens=7, max_num_seqs=8)
    assert engine.generate(PROMPTS, GREEDY) == expected
    assert engine.stats.max_step_tokens <= 7


@pytest.mark.parametrize("enforce_eager", [True, False], ids=["eager", "cuda-graphs"])
def test_sliding_window_on_cuda_matches_transformers(tmp_path: Path, enforce_eager: bool) -> None:
    """Mistral with a 24-token window over 16-token pages: the compiled windowed mask_mod and
    BlockMask, chunks past the window, and decode graphs whose window slides."""
    folder = build_tiny_llm(tmp_path / "m", arch="mistral", sliding_window=24)
    want = [reference_generate(folder, p, 40) for p in PROMPTS]
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    engine = _engine(folder, enforce_eager=enforce_eager, max_num_seqs=8, max_num_batched_tokens=32)
    assert engine.generate(PROMPTS, params) == want
    assert engine.generate(PROMPTS[3:4], params) == want[3:4]
    if engine.runner.graphs is not None:
        assert engine.runner.graphs.num_replays > 0


def test_portable_backend_on_cuda_matches(llama: Path, expected: list[list[int]]) -> None:
    engine = _engine(llama, attention_backend="torch")
    assert engine.runner.graphs is None  # graphs need the flex backend's metadata
    assert engine.generate(PROMPTS, GREEDY) == expected


def _decode_tokens_per_s(engine: LLMEngine, batch: int, steps: int) -> float:
    import torch

    params = SamplingParams(max_tokens=steps + 1, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"r{i}", [1 + i, 2, 3, 4], params)
    engine.step()  # the prefill
    torch.cuda.synchronize()
    start = time.perf_counter()
    tokens = 0
    while engine.has_work():
        tokens += len(engine.step())
    torch.cuda.synchronize()
    return tokens / (time.perf_counter() - start)


def test_decode_throughput_with_and_without_graphs(llama: Path) -> None:
    rates = {}
    for eager in (True, False):
        engine = _engine(llama, enforce_eager=eager, max_num_seqs=8)
        _decode_tokens_per_s(engine, 8, 8)  # warm-up: compiled kernels
        rates[eager] = [_decode_tokens_per_s(engine, b, 64) for b in (1, 8)]
        if not eager:
            assert engine.runner.graphs is not None and engine.runner.graphs.num_replays > 0
    for i, batch in enumerate((1, 8)):
        print(
            f"\ndecode tokens/s at batch {batch}: eager {rates[True][i]:.0f}, "
            f"CUDA graphs {rates[False][i]:.0f} (x{rates[False][i] / rates[True][i]:.2f})"
        )
    assert all(r > 0 for r in rates[True] + rates[False])
