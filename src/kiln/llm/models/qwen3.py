"""Qwen3: Llama's skeleton with a per-head RMSNorm on queries and keys (``q_norm``,
``k_norm``) between the projection and the rotation, and no q/k/v biases."""

from __future__ import annotations

import torch
from torch import nn

from kiln.llm import cpu_ops
from kiln.llm.config import ModelArgs
from kiln.llm.models.llama import Attention, DecoderLayer, LlamaForCausalLM, RMSNorm
from kiln.llm.models.rope import rotate


def head_norm(norm: RMSNorm, x: torch.Tensor) -> torch.Tensor:
    """``norm`` over the last dimension of ``x`` [T, heads, D], each head alone."""
    t, heads, d = x.shape
    out: torch.Tensor = norm(x.reshape(t * heads, d)).view(t, heads, d)
    return out


def rotate_fresh(x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """``x`` [T, heads, D] (a tensor of our own) rotated: in place with the CPU kernel."""
    if cpu_ops.usable(x) and x.is_contiguous():
        cpu_ops.rotate_(x, *rope, x.shape[1])
        return x
    return rotate(x, *rope)


class NormedAttention(Attention):
    """Attention whose queries and keys are RMS-normalised per head before RoPE (Qwen3,
    Gemma 3); ``norm_cls`` is the architecture's RMSNorm."""

    norm_cls: type[RMSNorm] = RMSNorm

    def __init__(self, args: ModelArgs, layer: int) -> None:
        super().__init__(args, layer)
        self.q_norm = self.norm_cls(self.head_dim, args.rms_norm_eps)
        self.k_norm = self.norm_cls(self.head_dim, args.rms_norm_eps)

    def project(
        self, rope: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        t = x.shape[0]
        h, hkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        if self.qkv_proj is not None:
            qkv = self.qkv_proj(x).view(t, h + 2 * hkv, d)
            q, k, v = qkv[:, :h], qkv[:, h : h + hkv], qkv[:, h + hkv :]
        else:
            q = self.q_proj(x).view(t, h, d)
            k = self.k_proj(x).view(t, hkv, d)
            v = self.v_proj(x).view(t, hkv, d)
        q = rotate_fresh(head_norm(self.q_norm, q), rope)
        k = rotate_fresh(head_norm(self.k_norm, k), rope)
        return q, k, v


class Qwen3DecoderLayer(DecoderLayer):
    def __init__(self, args: ModelArgs, layer: int) -> None:
        super().__init__(args, layer)
        self.self_attn = NormedAttention(args, layer)


class Qwen3ForCausalLM(LlamaForCausalLM):
    layer_cls: type[nn.Module] = Qwen3DecoderLayer
