"""This session's engine features on CUDA (needs a GPU): the profiler's CUDA activity and
``profiler: cuda``; sleep level 1 moving the weights to host memory and level 2 dropping
them, each waking to the same greedy tokens with the device memory given back; the
batch-invariant mode refused on a GPU by name."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from kiln.core.errors import KilnError  # noqa: E402
from kiln.llm.config import EngineConfig  # noqa: E402
from kiln.llm.engine import LLMEngine  # noqa: E402
from kiln.llm.engine_control import EngineControl  # noqa: E402
from kiln.llm.profiler_config import ProfilerConfig  # noqa: E402
from kiln.llm.sequence import SamplingParams  # noqa: E402
from tests.llm_models import build_tiny_llm  # noqa: E402

pytestmark = pytest.mark.gpu

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
PROMPT = [5, 17, 42, 99, 3, 8]


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_llm(tmp_path_factory.mktemp("llama"))


def engine(folder: Path, **kw: object) -> LLMEngine:
    settings: dict[str, object] = dict(device="cuda:0", dtype="bfloat16", block_size=16,
                                       num_gpu_blocks=64, enforce_eager=True)  # fmt: skip
    settings.update(kw)
    return LLMEngine(folder, EngineConfig(**settings))  # type: ignore[arg-type]


def run(eng: LLMEngine, rid: str) -> list[int]:
    eng.add_request(rid, PROMPT, GREEDY)
    out: list[int] = []
    while eng.has_work():
        for r in eng.step():
            out += r.new_token_ids
    return out


def test_the_profiler_records_cuda_kernels(folder: Path, tmp_path: Path) -> None:
    config = ProfilerConfig.parse({"profiler": "torch", "torch_profiler_dir": str(tmp_path),
                                   "torch_profiler_with_stack": False})  # fmt: skip
    eng = engine(folder, profiler_config=config)
    assert eng.profiler is not None and eng.profiler.activities == ("CPU", "CUDA")
    eng.call("start_profile", [None, None, None])
    run(eng, "a")
    files = eng.call("stop_profile", [])
    assert isinstance(files, list)
    [trace] = [f for f in files if ".pt.trace.json" in f]
    with gzip.open(trace, "rt") as f:
        events = json.load(f)["traceEvents"]
    assert any(e.get("cat") == "kernel" for e in events)  # the device's own kernels
    assert sum(1 for e in events if e.get("name") == "kiln::step") == GREEDY.max_tokens
    cuda = ProfilerConfig.parse({"profiler": "cuda"})
    bracketed = engine(folder, profiler_config=cuda)
    bracketed.call("start_profile", [None, None, None])
    run(bracketed, "b")
    assert bracketed.call("stop_profile", []) == []  # nsys writes, not kiln


@pytest.mark.parametrize("level", [1, 2])
def test_sleep_gives_the_device_memory_back_and_wakes_to_the_same_tokens(
    folder: Path, level: int
) -> None:
    eng = engine(folder)
    want = run(eng, "before")
    control = EngineControl(eng)
    torch.cuda.synchronize()
    awake = torch.cuda.memory_allocated()
    control.run("t", "sleep", {"level": level})
    torch.cuda.synchronize()
    asleep = torch.cuda.memory_allocated()
    assert asleep < awake / 4, (awake, asleep)  # weights and KV cache left the device
    assert control.run("t", "wake_up", {"tags": None}) == {"fully_awake": True}
    assert run(eng, "after") == want


def test_batch_invariant_mode_is_refused_on_a_gpu(folder: Path) -> None:
    with pytest.raises(KilnError, match="batch_invariant is supported when it runs on the CPU"):
        engine(folder, batch_invariant=True, dtype="float32")
