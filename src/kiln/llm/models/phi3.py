"""Phi-3 and Phi-4-mini (``Phi3ForCausalLM``): Llama's skeleton with q/k/v and gate/up
fused in the checkpoint itself (``qkv_proj``, ``gate_up_proj``), RoPE on the first
``partial_rotary_factor`` of each head's channels (Phi-4-mini: 0.75), and LongRoPE
(``rope_scaling`` type longrope) for the long-context variants."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from kiln.core.errors import KilnError, Status
from kiln.llm.config import ModelArgs
from kiln.llm.models.llama import MLP, Attention, DecoderLayer, LlamaForCausalLM
from kiln.llm.models.rope import LongRopeEmbedding, RotaryEmbedding, rotate


def rotary_dim(args: ModelArgs) -> int:
    raw = args.hf_config
    params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    factor = params.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0))
    return int(args.head_dim * float(factor))


class Phi3Attention(Attention):
    def __init__(self, args: ModelArgs, layer: int) -> None:
        super().__init__(args, layer)
        out = (self.num_heads + 2 * self.num_kv_heads) * self.head_dim
        del self.q_proj, self.k_proj, self.v_proj
        self.qkv_proj = nn.Linear(args.hidden_size, out, bias=False)
        self.rotary_dim = rotary_dim(args)

    def fuse(self) -> None:
        """Fused already in the checkpoint."""

    def project(
        self, rope: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if self.rotary_dim == self.head_dim:
            return super().project(rope, x)
        assert self.qkv_proj is not None
        t, h, hkv, r = x.shape[0], self.num_heads, self.num_kv_heads, self.rotary_dim
        qkv = self.qkv_proj(x).view(t, h + 2 * hkv, self.head_dim)
        qk = qkv[:, : h + hkv]
        # the first r channels rotate, the rest pass through (transformers' split)
        qk = torch.cat((rotate(qk[..., :r], *rope), qk[..., r:]), dim=-1)
        return qk[:, :h], qk[:, h:], qkv[:, h + hkv :]


class Phi3MLP(MLP):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__(args)
        del self.gate_proj, self.up_proj
        self.gate_up_proj = nn.Linear(args.hidden_size, 2 * args.intermediate_size, bias=False)

    def fuse(self) -> None:
        """Fused already in the checkpoint."""


class Phi3DecoderLayer(DecoderLayer):
    def __init__(self, args: ModelArgs, layer: int) -> None:
        super().__init__(args, layer)
        self.self_attn = Phi3Attention(args, layer)
        self.mlp = Phi3MLP(args)


def rotary_embedding(args: ModelArgs, max_positions: int) -> RotaryEmbedding:
    dim = rotary_dim(args)
    scaling: dict[str, Any] | None = args.rope_scaling
    kind = scaling.get("rope_type", scaling.get("type")) if scaling else None
    if kind not in ("longrope", "su", "yarn"):  # transformers reads Phi-3's su/yarn as longrope
        return RotaryEmbedding(dim, max_positions, args.rope_theta, scaling)
    assert scaling is not None
    scaling = dict(scaling)
    raw = args.hf_config
    scaling.setdefault(
        "original_max_position_embeddings",
        raw.get("original_max_position_embeddings", args.max_position_embeddings),
    )
    for key in ("short_factor", "long_factor"):
        if len(scaling.get(key) or ()) != dim // 2:
            raise KilnError(
                f"llm backend: rope_scaling {key} must hold {dim // 2} numbers (half the "
                f"rotary dimension {dim}), got {len(scaling.get(key) or ())}",
                Status.INVALID_ARG,
            )
    return LongRopeEmbedding(
        dim, max_positions, args.rope_theta, scaling, args.max_position_embeddings
    )


class Phi3ForCausalLM(LlamaForCausalLM):
    layer_cls: type[nn.Module] = Phi3DecoderLayer

    def rotary_embedding(self, args: ModelArgs, max_positions: int) -> RotaryEmbedding:
        return rotary_embedding(args, max_positions)
