"""Gemma 2 and Gemma 3 (the text model, ``Gemma3ForCausalLM``).

On Llama's skeleton: RMSNorm scaling by ``1 + weight`` (in float32), embeddings scaled by
sqrt(hidden) (rounded to the model's dtype first, as transformers), a GeGLU MLP (tanh
GELU), norms after attention and around the MLP as well as before, scores scaled by
``query_pre_attn_scalar ** -0.5``, local (sliding-window) layers alternating with global
ones. Gemma 2 caps attention scores and the final logits (``c * tanh(x / c)``); Gemma 3
normalises queries and keys per head instead, and rotates its local layers with their own
base (``rope_local_base_freq``) and no scaling.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kiln.llm import cpu_ops
from kiln.llm.config import ModelArgs
from kiln.llm.models.llama import MLP, Attention, LlamaForCausalLM, RMSNorm, StepMetadata
from kiln.llm.models.qwen3 import NormedAttention
from kiln.llm.models.rope import RotaryEmbedding


class GemmaRMSNorm(RMSNorm):
    """``x / rms(x) * (1 + weight)``, in float32 whatever the model's dtype (the checkpoint
    holds ``weight``; ``1 + weight`` is computed once, at ``fuse``)."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__(size, eps)
        self.scale = torch.empty(0)

    def fuse(self) -> None:
        self.scale = 1.0 + self.weight.detach().float()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if cpu_ops.usable(x) and x.dim() == 2:
            return cpu_ops.rms_norm(x, self.scale, self.eps)
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * self.scale).to(x.dtype)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        if cpu_ops.usable(residual):
            return cpu_ops.add_rms_norm(x, residual, self.scale, self.eps)
        residual.add_(x)
        return self.forward(residual)


class GemmaMLP(MLP):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_proj is not None:
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        out: torch.Tensor = self.down_proj(F.gelu(gate, approximate="tanh").mul_(up))
        return out


def _scale(args: ModelArgs) -> float:
    scalar = float(args.hf_config.get("query_pre_attn_scalar", 256))
    return float(scalar**-0.5)


class Gemma2Attention(Attention):
    def __init__(self, args: ModelArgs, layer: int) -> None:
        super().__init__(args, layer)
        self.scale = _scale(args)
        self.softcap = args.attn_logit_softcapping


class Gemma3Attention(NormedAttention):
    norm_cls: type[RMSNorm] = GemmaRMSNorm

    def __init__(self, args: ModelArgs, layer: int) -> None:
        super().__init__(args, layer)
        self.scale = _scale(args)


class Gemma2DecoderLayer(nn.Module):
    attention_cls: type[Attention] = Gemma2Attention

    def __init__(self, args: ModelArgs, layer: int) -> None:
        super().__init__()
        size, eps = args.hidden_size, args.rms_norm_eps
        self.self_attn = self.attention_cls(args, layer)
        self.mlp = GemmaMLP(args)
        self.input_layernorm = GemmaRMSNorm(size, eps)
        self.post_attention_layernorm = GemmaRMSNorm(size, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(size, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(size, eps)

    def forward(
        self,
        rope: tuple[torch.Tensor, torch.Tensor],
        x: torch.Tensor,
        residual: torch.Tensor | None,
        metas: StepMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """As Llama's layer (the output not yet added to the stream); the attention's and
        the MLP's outputs are normalised before they join the stream."""
        if residual is None:
            residual = x
            h = self.input_layernorm(x)
        else:
            h = self.input_layernorm.add_forward(x, residual)
        h = self.post_attention_layernorm(self.self_attn(rope, h, metas))
        h = self.pre_feedforward_layernorm.add_forward(h, residual)
        out: torch.Tensor = self.post_feedforward_layernorm(self.mlp(h))
        return out, residual


class Gemma3DecoderLayer(Gemma2DecoderLayer):
    attention_cls: type[Attention] = Gemma3Attention


def _local_rope(raw: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """Gemma 3's local layers' base and scaling: ``rope_parameters.sliding_attention``
    (transformers >= 5) or ``rope_local_base_freq`` (no scaling)."""
    params = (raw.get("rope_parameters") or {}).get("sliding_attention")
    if isinstance(params, dict):
        params = dict(params)
        theta = float(params.pop("rope_theta", 10_000.0))
        kind = params.get("rope_type", params.get("type", "default"))
        return theta, None if kind == "default" else params
    return float(raw.get("rope_local_base_freq", 10_000.0)), None


class Gemma2ForCausalLM(LlamaForCausalLM):
    layer_cls: type[nn.Module] = Gemma2DecoderLayer
    norm_cls: type[RMSNorm] = GemmaRMSNorm
    #: Gemma 2 caps the final logits unless its config sets null
    default_final_softcap: float | None = 30.0

    def __init__(self, args: ModelArgs, max_positions: int) -> None:
        super().__init__(args, max_positions)
        raw = args.hf_config
        cap = raw.get("final_logit_softcapping", self.default_final_softcap)
        self.final_softcap = None if cap is None else float(cap)
        #: which layers are local (the ones with a window), for their rotary tables
        self.local_layers = [w is not None for w in args.layer_windows()]
        self.rotary_local: RotaryEmbedding | None = None

    def _layers(
        self, input_ids: torch.Tensor, positions: torch.Tensor, metas: StepMetadata
    ) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.model.embed_tokens(input_ids)
        # sqrt(hidden) rounded to the model's dtype before the product (transformers')
        x = x * torch.tensor(self.args.hidden_size**0.5, dtype=x.dtype)
        rope = self.model.rotary_emb.lookup(positions, x.dtype)
        local = rope if self.rotary_local is None else self.rotary_local.lookup(positions, x.dtype)
        residual: torch.Tensor | None = None
        for layer, is_local in zip(self.model.layers, self.local_layers, strict=True):
            x, residual = layer(local if is_local else rope, x, residual, metas)
        assert residual is not None, "a model has at least one layer"
        return x, residual

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        metas: StepMetadata,
        logit_index: torch.Tensor,
    ) -> torch.Tensor:
        logits = super().forward(input_ids, positions, metas, logit_index)
        if self.final_softcap is not None:
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    layer_cls: type[nn.Module] = Gemma3DecoderLayer
    default_final_softcap: float | None = None

    def __init__(self, args: ModelArgs, max_positions: int) -> None:
        super().__init__(args, max_positions)
        theta, scaling = _local_rope(args.hf_config)
        self.rotary_local = RotaryEmbedding(args.head_dim, max_positions, theta, scaling)
