"""RMSNorm and the fused residual add + RMSNorm.

On CPU float32 with numba (``kiln.llm.cpu_ops``) a row is normalised in one pass, in a
fixed order: its result must not depend on the other rows of the step (a decode and a
prefill give the same bits), and it must match transformers' LlamaRMSNorm formula to float32
rounding. Without numba (or off CPU float32) the torch path must stay bit-identical to the
formula, for every step size."""

from __future__ import annotations

import pytest
import torch

from kiln.llm import cpu_ops
from kiln.llm.models.llama import RMS_NORM_FUSED_MAX_TOKENS, RMSNorm

pytest.importorskip("numba")


def _reference(norm: RMSNorm, x: torch.Tensor) -> torch.Tensor:
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + norm.eps)
    return norm.weight * h.to(x.dtype)


def _norm(size: int, seed: int) -> RMSNorm:
    torch.manual_seed(seed)
    norm = RMSNorm(size, 1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(size))
    return norm


@pytest.mark.parametrize("tokens", [1, 64, 300])
def test_cpu_kernel_matches_the_formula_to_rounding(tokens: int) -> None:
    norm = _norm(96, tokens)
    x = torch.randn(tokens, 96) * 3
    assert cpu_ops.usable(x)
    with torch.inference_mode():
        got, want = norm(x), _reference(norm, x)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_a_rows_result_does_not_depend_on_its_step() -> None:
    norm = _norm(256, 1)
    x = torch.randn(200, 256) * 2
    residual = torch.randn(200, 256)
    with torch.inference_mode():
        whole = norm(x)
        fused_whole = norm.add_forward(x, residual.clone())
        for i in (0, 57, 199):
            assert torch.equal(norm(x[i : i + 1]), whole[i : i + 1])
            alone = norm.add_forward(x[i : i + 1], residual[i : i + 1].clone())
            assert torch.equal(alone, fused_whole[i : i + 1])


@pytest.mark.parametrize("numba_path", [True, False], ids=["cpu-kernel", "torch"])
def test_add_forward_updates_the_residual_and_normalises_the_sum(
    monkeypatch: pytest.MonkeyPatch, numba_path: bool
) -> None:
    if not numba_path:
        monkeypatch.setattr(cpu_ops, "numba", None)
    norm = _norm(96, 7)
    x, residual = torch.randn(33, 96), torch.randn(33, 96)
    expected_sum = residual + x
    stream = residual.clone()
    with torch.inference_mode():
        out = norm.add_forward(x, stream)
        want = _reference(norm, expected_sum)
    # the stream's add is exact in both paths: a plain float32 addition
    assert torch.equal(stream, expected_sum)
    if numba_path:
        torch.testing.assert_close(out, want, rtol=1e-6, atol=1e-6)
    else:
        assert torch.equal(out, want)


@pytest.mark.parametrize(
    "tokens", [1, 64, RMS_NORM_FUSED_MAX_TOKENS, RMS_NORM_FUSED_MAX_TOKENS + 1]
)
def test_torch_path_is_bit_identical_to_the_formula(
    monkeypatch: pytest.MonkeyPatch, tokens: int
) -> None:
    monkeypatch.setattr(cpu_ops, "numba", None)
    norm = _norm(96, tokens)
    x = torch.randn(tokens, 96) * 3
    assert not cpu_ops.usable(x)
    with torch.inference_mode():
        assert torch.equal(norm(x), _reference(norm, x))
