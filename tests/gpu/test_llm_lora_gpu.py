"""Multi-LoRA on CUDA (needs a GPU): the flex attention backend (CUDA graphs are off while
LoRA is enabled), float32, one mixed batch of two adapters and the base model, each
request's greedy tokens equal to ``transformers`` + PEFT with its adapter alone."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("peft")

from kiln.llm.config import EngineConfig
from kiln.llm.engine import LLMEngine
from kiln.llm.lora import LoRAConfig, LoRARegistry
from kiln.llm.sequence import SamplingParams
from tests.llm_models import build_lora_adapter, build_tiny_llm, reference_generate_lora

pytestmark = pytest.mark.gpu

PROMPTS = [[5, 17, 42, 99, 3], list(range(30, 70))]
GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


def test_mixed_adapters_on_cuda_match_peft(tmp_path: Path) -> None:
    base = build_tiny_llm(tmp_path / "base")
    paths = {
        "a": build_lora_adapter(base, tmp_path / "a", seed=1, r=8),
        "b": build_lora_adapter(
            base, tmp_path / "b", seed=2, r=4, target_modules=("q_proj", "v_proj")
        ),
    }
    config = EngineConfig(
        device="cuda", dtype="float32", kv_cache_memory_bytes=1 << 24,
        lora_config=LoRAConfig(max_loras=2),
    )  # fmt: skip
    engine = LLMEngine(base, config)
    assert engine.runner.graphs is None
    loras = {n: LoRARegistry.new_request(n, str(p)) for n, p in paths.items()}
    for request in loras.values():
        engine.add_lora(request)
    jobs = [(f"{n}-{i}", p, n) for i, p in enumerate(PROMPTS) for n in ("a", "b", "")]
    for rid, prompt, name in jobs:
        engine.add_request(rid, prompt, GREEDY, lora_request=loras.get(name))
    outputs: dict[str, list[int]] = {rid: [] for rid, _, _ in jobs}
    while engine.has_work():
        for result in engine.step():
            outputs[result.request_id].extend(result.new_token_ids)
    for rid, prompt, name in jobs:
        adapter = paths.get(name)
        assert outputs[rid] == reference_generate_lora(base, adapter, prompt, 10), rid
