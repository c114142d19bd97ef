"""``cpu_linear``: the projections of a CPU float32 model keep their parameters (shared,
not copied) and compute what ``F.linear`` computes, through oneDNN's packed weight for
decode-sized batches and ``F.linear`` outside them; the engine packs them on CPU float32
only, and its greedy tokens stay those of ``transformers`` (test_llm_engine.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kiln.llm import cpu_linear
from tests.llm_models import build_tiny_llm

pytestmark = pytest.mark.skipif(not cpu_linear.available(), reason="torch without oneDNN")


@pytest.mark.parametrize("rows", [1, 2, 64, cpu_linear.MAX_ROWS, cpu_linear.MAX_ROWS + 1, 700])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_computes_f_linear(rows: int, bias: bool) -> None:
    torch.manual_seed(rows)
    linear = nn.Linear(96, 320, bias=bias)
    packed = cpu_linear.PackedLinear.wrap(linear)
    assert packed.weight is linear.weight and packed.bias is linear.bias
    x = torch.randn(rows, 96)
    want = F.linear(x, linear.weight, linear.bias)
    got = packed(x)
    assert got.shape == want.shape
    # the two libraries sum in different orders: float32 rounding apart, no more
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    if rows > cpu_linear.MAX_ROWS:
        assert torch.equal(got, want)  # outside oneDNN's range: F.linear itself


@pytest.mark.parametrize("rows", [1, 2, 64, cpu_linear.MAX_ROWS + 1])
def test_a_narrow_projection_uses_f_linear_for_one_row(rows: int) -> None:
    """A narrow projection (o_proj, down_proj) is packed too, but one row stays MKL's gemv;
    a wide one takes oneDNN's product from one row (test above)."""
    torch.manual_seed(rows)
    linear = nn.Linear(320, 96)
    packed = cpu_linear.PackedLinear.wrap(linear)
    assert packed.min_rows == cpu_linear.MIN_ROWS
    assert cpu_linear.PackedLinear.wrap(nn.Linear(96, 320)).min_rows == 1
    x = torch.randn(rows, 320)
    want = F.linear(x, linear.weight, linear.bias)
    got = packed(x)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    if not cpu_linear.MIN_ROWS <= rows <= cpu_linear.MAX_ROWS:
        assert torch.equal(got, want)


def test_pack_swaps_every_float32_cpu_projection() -> None:
    model = nn.Sequential(
        nn.Linear(64, 256),  # wide: packed
        nn.Linear(256, 64),  # narrow: packed
        nn.Linear(64, 256).to(torch.bfloat16),  # not float32: kept
        nn.Sequential(nn.Linear(64, 128)),  # nested, wide: packed
    )
    assert cpu_linear.pack(model) == 3
    kinds = [type(m) for m in (model[0], model[1], model[2], model[3][0])]
    assert kinds == [
        cpu_linear.PackedLinear,
        cpu_linear.PackedLinear,
        nn.Linear,
        cpu_linear.PackedLinear,
    ]
    assert [model[0].min_rows, model[1].min_rows] == [1, cpu_linear.MIN_ROWS]


def test_the_engine_packs_on_cpu_float32(tmp_path: Path) -> None:
    from kiln.llm.config import EngineConfig
    from kiln.llm.engine import LLMEngine

    folder = build_tiny_llm(tmp_path / "m")
    engine = LLMEngine(folder, EngineConfig(num_gpu_blocks=16))
    layer = engine.runner.model.model.layers[0]
    assert isinstance(layer.mlp.gate_up_proj, cpu_linear.PackedLinear)
    assert isinstance(layer.self_attn.qkv_proj, cpu_linear.PackedLinear)
    assert isinstance(layer.self_attn.o_proj, cpu_linear.PackedLinear)  # square: packed too
    assert isinstance(layer.mlp.down_proj, cpu_linear.PackedLinear)
    bf16 = LLMEngine(folder, EngineConfig(num_gpu_blocks=16, dtype="bfloat16"))
    assert not any(isinstance(m, cpu_linear.PackedLinear) for m in bf16.runner.model.modules())
