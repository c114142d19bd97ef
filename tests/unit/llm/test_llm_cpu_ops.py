"""``cpu_ops.rotate_``: RoPE in place on the fused projection's q and k heads must give
torch's ``rope.rotate`` bit for bit (greedy tokens are compared with transformers), leave
the v heads alone, and be used by the model on CPU float32 only."""

from __future__ import annotations

import pytest
import torch

from kiln.llm import cpu_ops
from kiln.llm.models.rope import RotaryEmbedding, rotate

pytest.importorskip("numba")


@pytest.mark.parametrize("tokens", [1, 64, 700])
@pytest.mark.parametrize("scaling", [None, {"rope_type": "linear", "factor": 4.0}])
def test_rotate_in_place_is_bit_identical_to_the_formula(
    tokens: int, scaling: dict[str, object] | None
) -> None:
    torch.manual_seed(tokens)
    rope = RotaryEmbedding(64, 4096, 10000.0, scaling)
    cos, sin = rope.lookup(torch.randint(0, 4096, (tokens,)), torch.float32)
    qkv = torch.randn(tokens, 8, 64) * 3  # 4 query + 2 key heads rotate, 2 value heads not
    want = rotate(qkv[:, :6], cos, sin)
    got = qkv.clone()
    cpu_ops.rotate_(got, cos, sin, 6)
    assert torch.equal(got[:, :6], want)
    assert torch.equal(got[:, 6:], qkv[:, 6:])


def test_kernels_apply_to_cpu_float32_only(monkeypatch: pytest.MonkeyPatch) -> None:
    assert cpu_ops.usable(torch.ones(2, 2))
    assert not cpu_ops.usable(torch.ones(2, 2, dtype=torch.bfloat16))
    assert not cpu_ops.usable(torch.ones(2, 2, device="meta"))
    monkeypatch.setattr(cpu_ops, "numba", None)
    assert not cpu_ops.usable(torch.ones(2, 2))
