"""AWQ and GPTQ int4 checkpoints against ``transformers`` running the same weights
dequantized, and kiln's unpacking against the plain packers of tests/llm_quant.py.

Tolerance: torch's packed int4 CPU kernel takes bf16 activations and bf16 scales/zeros, so
logits may differ from the float32 reference by bf16's rounding: at most 2% of the logits'
range. Greedy tokens are identical.
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("transformers")

import torch

from kiln.llm.config import EngineConfig
from kiln.llm.cpu_linear import PackedLinear
from kiln.llm.engine import LLMEngine
from kiln.llm.quantization import packing
from kiln.llm.quantization.linear import ConcatLinear, Int4Linear
from kiln.llm.sequence import SamplingParams
from tests.llm_models import reference_generate
from tests.llm_quant import (
    AWQ_ORDER,
    base_model,
    kiln_logits,
    pack_columns,
    pack_rows,
    reference_logits,
    write_awq,
    write_gptq,
)

DENSE = (torch.nn.Linear, PackedLinear)

PROMPT = [5, 17, 42, 99, 3, 250, 7, 8, 9, 10]
GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return base_model(tmp_path_factory.mktemp("base"))


def _check(qdir: Path, rdir: Path) -> LLMEngine:
    engine = LLMEngine(qdir, EngineConfig(kv_cache_memory_bytes=1 << 22))
    got, want = kiln_logits(engine, PROMPT), reference_logits(rdir, PROMPT)
    span = float(want.max() - want.min())
    assert float((got - want).abs().max()) <= 0.02 * span
    assert engine.generate([PROMPT], GREEDY) == [reference_generate(rdir, PROMPT, 10)]
    return engine


def test_unpacking_matches_the_plain_packers() -> None:
    gen = torch.Generator().manual_seed(0)
    q = torch.randint(0, 16, (24, 64), dtype=torch.uint8, generator=gen)
    assert torch.equal(packing.unpack_columns(pack_columns(q)), q)
    assert torch.equal(packing.unpack_columns(pack_columns(q, AWQ_ORDER), AWQ_ORDER), q)
    assert torch.equal(packing.unpack_rows(pack_rows(q)), q)
    # AWQ's order is not the identity: reading it in order gives other columns
    assert not torch.equal(packing.unpack_columns(pack_columns(q, AWQ_ORDER)), q)
    # the legacy GPTQ zeros are stored minus one, zero 0 wrapping to 15
    zeros = torch.tensor([[0, 1, 7, 8, 15, 3, 0, 9]], dtype=torch.long)
    stored = pack_columns((zeros - 1) & 0xF)
    _, _, got = packing.gptq_to_int4(
        torch.zeros(1, 8, dtype=torch.int32), stored, torch.ones(1, 8), zero_offset=1
    )
    assert torch.equal(got, zeros.float())


def test_awq_matches_dequantized_reference(base: Path, tmp_path: Path) -> None:
    engine = _check(*write_awq(base, tmp_path))
    layer = engine.runner.model.model.layers[0]
    # q/k/v and gate/up fused into one packed matrix each
    assert isinstance(layer.self_attn.qkv_proj, Int4Linear)
    assert isinstance(layer.mlp.gate_up_proj, Int4Linear)
    assert layer.mlp.down_proj.packed.dtype == torch.uint8


@pytest.mark.parametrize(("desc_act", "sym"), [(False, True), (True, True), (True, False)])
def test_gptq_matches_dequantized_reference(
    base: Path, tmp_path: Path, desc_act: bool, sym: bool
) -> None:
    engine = _check(*write_gptq(base, tmp_path, desc_act=desc_act, sym=sym))
    layer = engine.runner.model.model.layers[0]
    if desc_act:
        # each projection gathers its input in its own group order: computed side by side
        assert isinstance(layer.self_attn.qkv_proj, ConcatLinear)
        assert layer.mlp.down_proj.perm is not None
    else:
        assert isinstance(layer.self_attn.qkv_proj, Int4Linear)


def test_gptq_per_channel_falls_back_to_dequantized(base: Path, tmp_path: Path) -> None:
    """group_size -1 (one group a row): no packed kernel takes it; dequantized at load."""
    engine = _check(*write_gptq(base, tmp_path, group_size=-1))
    layer = engine.runner.model.model.layers[0]
    assert type(layer.mlp.down_proj) in DENSE  # dense float32 (packed by cpu_linear on CPU)


def test_stacked_int4_projections_equal_their_parts_on_this_cpu() -> None:
    """q/k/v and gate/up fuse into one Int4Linear: its product must equal the parts' side by
    side. torch's CPU int4 layout is the ISA's (AVX-512 tiles rows), so the parts' packed
    tensors cannot simply be concatenated: on an AVX-512 CPU that gave wrong logits."""
    torch.manual_seed(0)
    k, group = 128, 32

    def part(n: int) -> Int4Linear:
        q = torch.randint(0, 16, (n, k), dtype=torch.int32)
        scale, offset = torch.rand(k // group, n) * 0.1 + 0.01, torch.randn(k // group, n) * 0.1
        return Int4Linear(q, scale, offset, group, None, None)

    parts = [part(64), part(32), part(32)]
    fused = parts[0].stack(parts)
    assert isinstance(fused, Int4Linear)
    x = torch.randn(5, k)
    want = torch.cat([p(x) for p in parts], dim=-1)
    torch.testing.assert_close(fused(x), want, atol=1e-3, rtol=0)
