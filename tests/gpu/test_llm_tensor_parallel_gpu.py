"""Tensor parallelism with NCCL: 2 ranks on 2 GPUs give the tokens of 1 rank (the CPU
test, tests/unit/llm/test_llm_tensor_parallel.py, runs the same split over gloo in CI).
Written and never run: no multi-GPU machine has been lent (docs/scaling.md). On one GPU,
the two-GPU test is skipped with that reason, and the refusal and the NCCL group of one
rank still run."""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from kiln.core.errors import KilnError  # noqa: E402
from kiln.llm.config import EngineConfig  # noqa: E402
from kiln.llm.engine import LLMEngine  # noqa: E402
from kiln.llm.parallel import comm  # noqa: E402
from kiln.llm.sequence import SamplingParams  # noqa: E402
from tests.llm_models import build_tiny_llm, drain, reference_generate  # noqa: E402

pytestmark = pytest.mark.gpu

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
PROMPTS = [[5, 17, 42, 99, 3], list(range(30, 70)), [250]]


def _config(tp: int, **kw: object) -> EngineConfig:
    return EngineConfig(  # type: ignore[arg-type]
        device="cuda:0",
        dtype="float32",
        tensor_parallel_size=tp,
        kv_cache_memory_bytes=1 << 24,
        served_model_name="tiny-nccl",
        **kw,
    )


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    assert torch.cuda.is_available(), "a CUDA build of torch is needed for the GPU path"
    return build_tiny_llm(tmp_path_factory.mktemp("llama"))


def _tokens(folder: Path, tp: int) -> dict[tuple[str, int], list[int]]:
    engine = LLMEngine(folder, _config(tp))
    try:
        for i, prompt in enumerate(PROMPTS):
            engine.add_request(f"r{i}", prompt, GREEDY)
        engine.add_request("seeded", PROMPTS[0], SamplingParams(
            max_tokens=8, temperature=0.8, seed=3, n=2, ignore_eos=True))  # fmt: skip
        return drain(engine)
    finally:
        engine.close()


@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2,
    reason="needs 2 GPUs: NCCL puts each rank on its own GPU",
)
def test_nccl_two_ranks_give_one_ranks_tokens(llama: Path) -> None:
    one, two = _tokens(llama, 1), _tokens(llama, 2)
    assert two == one
    assert two[("r0", 0)] == reference_generate(llama, PROMPTS[0], GREEDY.max_tokens)


@pytest.mark.skipif(
    torch.cuda.is_available() and torch.cuda.device_count() >= 2,
    reason="this machine has 2 GPUs: the refusal is for a machine with fewer",
)
def test_more_ranks_than_gpus_is_refused(llama: Path) -> None:
    visible = torch.cuda.device_count()
    with pytest.raises(KilnError, match=f"needs 2 GPUs from cuda:0, and {visible} are visible"):
        LLMEngine(llama, _config(2))


def test_nccl_group_of_one_rank_all_reduces() -> None:
    """The NCCL constructor and options kiln uses, on whatever GPU there is."""
    from torch.distributed import TCPStore  # type: ignore[attr-defined]

    torch.cuda.set_device(0)
    store = TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False)
    group = comm.new_group(store, 0, 1, torch.device("cuda", 0))
    x = torch.arange(4.0, device="cuda:0")
    comm.all_reduce(group, x)
    assert x.tolist() == [0.0, 1.0, 2.0, 3.0]
