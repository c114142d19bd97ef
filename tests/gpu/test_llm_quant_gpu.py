"""Quantized checkpoints on CUDA (needs a GPU): FP8 through ``torch._scaled_mm`` on compute
capability 8.9+ (Ada, Hopper), int4 through ``torch._weight_int4pack_mm``, and the fp8 KV
cache in the torch attention backend. The tolerances of the CPU tests apply, widened for
fp8 activations (quantized per token): logits within 5% of their range, greedy tokens equal
to ``transformers`` on the dequantized weights up to a near tie within that tolerance."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("transformers")

import torch

from kiln.llm.config import EngineConfig
from kiln.llm.engine import LLMEngine
from kiln.llm.quantization.linear import Fp8Linear, Int4Linear, scaled_mm_usable
from kiln.llm.sequence import SamplingParams
from tests.llm_models import reference_generate
from tests.llm_quant import base_model, kiln_logits, reference_logits, write_awq, write_fp8

pytestmark = pytest.mark.gpu

PROMPT = [5, 17, 42, 99, 3, 250, 7, 8, 9, 10]
GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


def _engine(folder: Path, **kw: str) -> LLMEngine:
    config = EngineConfig(device="cuda", dtype="bfloat16", kv_cache_memory_bytes=1 << 24, **kw)
    return LLMEngine(folder, config)


def _close(engine: LLMEngine, rdir: Path, rel: float) -> None:
    """Logits within ``rel`` of their range; greedy tokens equal to the reference's up to the
    first difference, if any, where kiln's token must be within the same tolerance of the
    reference's best (a near tie: the random model's degenerate repeats have such ties,
    which bf16 and fp8 activations may break the other way)."""
    got, want = kiln_logits(engine, PROMPT).cpu(), reference_logits(rdir, PROMPT)
    tolerance = rel * float(want.max() - want.min())
    assert float((got - want).abs().max()) <= tolerance
    [tokens] = engine.generate([PROMPT], GREEDY)
    reference = reference_generate(rdir, PROMPT, 10)
    for i, (mine, theirs) in enumerate(zip(tokens, reference, strict=True)):
        if mine != theirs:
            row = reference_logits(rdir, PROMPT + tokens[:i])[-1]
            print(f"first difference at token {i}: kiln {mine} ({float(row[mine]):.4f}), "
                  f"reference {theirs} ({float(row[theirs]):.4f})")  # fmt: skip
            assert float(row[theirs] - row[mine]) <= tolerance, (i, tokens, reference)
            break


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return base_model(tmp_path_factory.mktemp("base"))


@pytest.mark.skipif(
    not torch.cuda.is_available() or not scaled_mm_usable(torch.device("cuda")),
    reason="torch._scaled_mm's fp8 needs compute capability 8.9+",
)
def test_fp8_scaled_mm(base: Path, tmp_path: Path) -> None:
    qdir, rdir = write_fp8(base, tmp_path, per_channel=True, method="compressed-tensors")
    engine = _engine(qdir)
    assert isinstance(engine.runner.model.model.layers[0].mlp.down_proj, Fp8Linear)
    _close(engine, rdir, 0.05)


def test_awq_int4pack_cuda(base: Path, tmp_path: Path) -> None:
    qdir, rdir = write_awq(base, tmp_path)
    engine = _engine(qdir)
    assert isinstance(engine.runner.model.model.layers[0].mlp.down_proj, Int4Linear)
    _close(engine, rdir, 0.05)


def test_fp8_kv_cache_cuda(base: Path) -> None:
    engine = _engine(base, kv_cache_dtype="fp8")
    assert engine.runner.kv_cache.dtype == torch.float8_e4m3fn
    assert engine.runner.attention_backend == "torch"
    assert engine.generate([PROMPT], GREEDY) == [reference_generate(base, PROMPT, 10)]
