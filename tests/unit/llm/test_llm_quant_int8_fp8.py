"""FP8 and INT8 checkpoints (vLLM's ``fp8`` and compressed-tensors W8A8 / W8A16) against
``transformers`` running the same weights dequantized.

Tolerance: kiln's CPU int8 kernel takes bf16 activations (linear.py), so logits may differ
from the float32 reference by bf16's rounding: at most 2% of the logits' range here;
fp8 dequantizes at load on the CPU, so its logits match to float32 rounding (1e-4).
Greedy tokens are identical in every case.
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("transformers")

import torch

from kiln.llm.config import EngineConfig
from kiln.llm.engine import LLMEngine
from kiln.llm.quantization.linear import Int8Linear
from kiln.llm.sequence import SamplingParams
from tests.llm_models import reference_generate
from tests.llm_quant import (
    base_model,
    kiln_logits,
    reference_logits,
    write_fp8,
    write_int8,
)

PROMPT = [5, 17, 42, 99, 3, 250, 7, 8, 9, 10]
GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return base_model(tmp_path_factory.mktemp("base"))


def _check(qdir: Path, rdir: Path, rel: float) -> LLMEngine:
    engine = LLMEngine(qdir, EngineConfig(kv_cache_memory_bytes=1 << 22))
    got, want = kiln_logits(engine, PROMPT), reference_logits(rdir, PROMPT)
    span = float(want.max() - want.min())
    assert float((got - want).abs().max()) <= rel * span
    assert engine.generate([PROMPT], GREEDY) == [reference_generate(rdir, PROMPT, 10)]
    return engine


@pytest.mark.parametrize(
    ("method", "per_channel"),
    [
        ("fp8", False),
        ("fp8-block", False),
        ("compressed-tensors", False),
        ("compressed-tensors", True),
    ],
)
def test_fp8_matches_dequantized_reference(
    base: Path, tmp_path: Path, method: str, per_channel: bool
) -> None:
    qdir, rdir = write_fp8(base, tmp_path, per_channel, method)
    engine = _check(qdir, rdir, 1e-4)
    assert engine.runner.quantization is not None
    assert engine.runner.quantization.method == method.removesuffix("-block")


@pytest.mark.parametrize(("per_channel", "w8a8"), [(True, True), (False, False)])
def test_int8_matches_dequantized_reference(
    base: Path, tmp_path: Path, per_channel: bool, w8a8: bool
) -> None:
    qdir, rdir = write_int8(base, tmp_path, per_channel, w8a8)
    engine = _check(qdir, rdir, 0.02)
    # the weights stay int8 in memory, fused as the float model fuses them
    layer = engine.runner.model.model.layers[0]
    assert isinstance(layer.self_attn.qkv_proj, Int8Linear)
    assert isinstance(layer.mlp.gate_up_proj, Int8Linear)
    assert layer.mlp.down_proj.weight.dtype == torch.int8
