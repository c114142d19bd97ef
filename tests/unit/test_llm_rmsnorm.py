"""RMSNorm's fused path (``F.rms_norm``, small steps) against its op-by-op formula (long
prefills), which is transformers' LlamaRMSNorm: the two must agree bit for bit, or greedy
tokens could differ between a decode step and a prefill."""

from __future__ import annotations

import pytest
import torch

from kiln.llm.models.llama import RMS_NORM_FUSED_MAX_TOKENS, RMSNorm


def _reference(norm: RMSNorm, x: torch.Tensor) -> torch.Tensor:
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + norm.eps)
    return norm.weight * h.to(x.dtype)


@pytest.mark.parametrize(
    "tokens", [1, 64, RMS_NORM_FUSED_MAX_TOKENS, RMS_NORM_FUSED_MAX_TOKENS + 1]
)
def test_rms_norm_is_bit_identical_to_the_formula(tokens: int) -> None:
    torch.manual_seed(tokens)
    norm = RMSNorm(96, 1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(96))
    x = torch.randn(tokens, 96) * 3
    with torch.inference_mode():
        assert torch.equal(norm(x), _reference(norm, x))
