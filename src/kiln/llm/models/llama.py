"""The Llama skeleton (also Mistral, Qwen2): RMSNorm, RoPE, GQA attention, SwiGLU MLP.

Module names follow Hugging Face's, so a checkpoint's state dict loads without renaming.
Tokens of all sequences of a step come flattened ([T, hidden]); the paged attention puts
them back into sequences.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kiln.llm.attention import AttentionMetadata, paged_attention
from kiln.llm.attention_flex import FlexMetadata, flex_paged_attention
from kiln.llm.config import ModelArgs
from kiln.llm.models.rope import RotaryEmbedding


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # in float32 whatever the model dtype: bf16 variance loses too much
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        out: torch.Tensor = self.weight * h.to(x.dtype)
        return out


class Attention(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.num_heads = args.num_attention_heads
        self.num_kv_heads = args.num_key_value_heads
        self.head_dim = args.head_dim
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        bias = args.attention_bias
        self.q_proj = nn.Linear(args.hidden_size, q_size, bias=bias)
        self.k_proj = nn.Linear(args.hidden_size, kv_size, bias=bias)
        self.v_proj = nn.Linear(args.hidden_size, kv_size, bias=bias)
        # Llama's attention_bias covers o_proj too; Qwen2's q/k/v biases do not
        o_bias = bias and args.architecture != "Qwen2ForCausalLM"
        self.o_proj = nn.Linear(q_size, args.hidden_size, bias=o_bias)
        self.k_cache = torch.empty(0)
        self.v_cache = torch.empty(0)

    def forward(
        self,
        positions: torch.Tensor,
        x: torch.Tensor,
        rope: RotaryEmbedding,
        meta: AttentionMetadata | FlexMetadata,
    ) -> torch.Tensor:
        t = x.shape[0]
        q = self.q_proj(x).view(t, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(t, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(t, self.num_kv_heads, self.head_dim)
        q, k = rope(positions, q, k)
        if isinstance(meta, FlexMetadata):
            out = flex_paged_attention(q, k, v, self.k_cache, self.v_cache, meta)
        else:
            out = paged_attention(q, k, v, self.k_cache, self.v_cache, meta)
        result: torch.Tensor = self.o_proj(out.reshape(t, -1))
        return result


class MLP(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(args.hidden_size, args.intermediate_size, bias=False)
        self.up_proj = nn.Linear(args.hidden_size, args.intermediate_size, bias=False)
        self.down_proj = nn.Linear(args.intermediate_size, args.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        return out


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.self_attn = Attention(args)
        self.mlp = MLP(args)
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)

    def forward(
        self,
        positions: torch.Tensor,
        x: torch.Tensor,
        rope: RotaryEmbedding,
        meta: AttentionMetadata | FlexMetadata,
    ) -> torch.Tensor:
        x = x + self.self_attn(positions, self.input_layernorm(x), rope, meta)
        out: torch.Tensor = x + self.mlp(self.post_attention_layernorm(x))
        return out


class Backbone(nn.Module):
    def __init__(self, args: ModelArgs, max_positions: int) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(args) for _ in range(args.num_hidden_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(
            args.head_dim, max_positions, args.rope_theta, args.rope_scaling
        )


class LlamaForCausalLM(nn.Module):
    def __init__(self, args: ModelArgs, max_positions: int) -> None:
        super().__init__()
        self.args = args
        self.model = Backbone(args, max_positions)
        self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        if args.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def attention_layers(self) -> list[Attention]:
        return [m for m in self.modules() if isinstance(m, Attention)]

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata | FlexMetadata,
        logit_index: torch.Tensor,
    ) -> torch.Tensor:
        """Logits [len(logit_index), vocab] for the flat tokens ``logit_index`` picks."""
        x = self.model.embed_tokens(input_ids)
        for layer in self.model.layers:
            x = layer(positions, x, self.model.rotary_emb, meta)
        hidden = self.model.norm(x[logit_index])
        logits: torch.Tensor = self.lm_head(hidden)
        return logits
