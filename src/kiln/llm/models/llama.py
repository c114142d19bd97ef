"""The Llama skeleton (also Mistral, Qwen2): RMSNorm, RoPE, GQA attention, SwiGLU MLP.

Module names follow Hugging Face's, so a checkpoint's state dict loads without renaming.
Tokens of all sequences of a step come flattened ([T, hidden]); the paged attention puts
them back into sequences. A step's attention metadata comes per sliding window (None: full
attention): each layer reads the one of its own window.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import nn

from kiln.llm import cpu_ops
from kiln.llm.attention import (
    AttentionMetadata,
    DenseMetadata,
    dense_attention,
    paged_attention,
)
from kiln.llm.attention_flex import FlexMetadata, flex_paged_attention
from kiln.llm.config import ModelArgs
from kiln.llm.models.rope import RotaryEmbedding, rotate
from kiln.llm.quantization.linear import QuantLinear

#: ``F.rms_norm`` (float32) is faster than the op-by-op formula for decode-sized batches
#: (single thread, hidden 256: 54 vs 83 us at 64 tokens) but not for long prefills (1.2 vs
#: 1.1 ms at 2,048 tokens), so only steps up to this many tokens use it
RMS_NORM_FUSED_MAX_TOKENS = 256

#: a step's attention metadata by sliding window (None: full causal attention)
StepMetadata = Mapping[int | None, AttentionMetadata | FlexMetadata | DenseMetadata]


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps
        #: one Triton kernel instead of torch's operations (``kernels.enable``)
        self.use_triton = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.use_triton:
            from kiln.llm.kernels import elementwise

            return elementwise.rms_norm(x, self.weight, self.eps)
        if cpu_ops.usable(x):
            return cpu_ops.rms_norm(x, self.weight, self.eps)
        if x.shape[0] <= RMS_NORM_FUSED_MAX_TOKENS and x.dtype == torch.float32:
            # the same operations in one call (bit-identical results): fewer dispatches
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        # in float32 whatever the model dtype: bf16 variance loses too much
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        out: torch.Tensor = self.weight * h.to(x.dtype)
        return out

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """``residual += x`` (in place: the caller owns ``residual``), then the norm of the
        sum: the residual stream's add and the next norm in one pass on CPU float32
        (``cpu_ops``), the same two steps in torch elsewhere."""
        if self.use_triton:
            from kiln.llm.kernels import elementwise

            return elementwise.fused_add_rms_norm(x, residual, self.weight, self.eps)
        if cpu_ops.usable(residual):
            return cpu_ops.add_rms_norm(x, residual, self.weight, self.eps)
        residual.add_(x)
        return self.forward(residual)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, layer: int) -> None:
        super().__init__()
        #: this layer's attention window (None: the whole causal context)
        self.sliding_window = args.layer_window(layer)
        self.num_heads = args.num_attention_heads
        self.num_kv_heads = args.num_key_value_heads
        self.head_dim = args.head_dim
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        bias = args.attention_bias
        self.q_proj = nn.Linear(args.hidden_size, q_size, bias=bias)
        self.k_proj = nn.Linear(args.hidden_size, kv_size, bias=bias)
        self.v_proj = nn.Linear(args.hidden_size, kv_size, bias=bias)
        #: q, k and v in one matrix product, once the checkpoint is loaded (``fuse``)
        self.qkv_proj: nn.Linear | None = None
        # Llama's attention_bias covers o_proj too; Qwen2's q/k/v biases do not
        o_bias = bias and args.architecture != "Qwen2ForCausalLM"
        self.o_proj = nn.Linear(q_size, args.hidden_size, bias=o_bias)
        self.k_cache = torch.empty(0)
        self.v_cache = torch.empty(0)
        #: the scores' scale (None: 1 / sqrt(head_dim)); Gemma's ``query_pre_attn_scalar``
        self.scale: float | None = None
        #: Gemma 2's ``attn_logit_softcapping``: scores become ``c * tanh(s / c)``
        self.softcap: float | None = None
        #: RoPE by a Triton kernel, in place (``kernels.enable``)
        self.use_triton = False

    def fuse(self) -> None:
        """Replace q/k/v_proj (the checkpoint's names) by one projection: one matrix product
        a layer instead of three small ones. Its rows are theirs, stacked: each output is
        the same dot product as before."""
        self.qkv_proj = _stack(self.q_proj, self.k_proj, self.v_proj)
        del self.q_proj, self.k_proj, self.v_proj

    def forward(
        self,
        rope: tuple[torch.Tensor, torch.Tensor],
        x: torch.Tensor,
        metas: StepMetadata,
    ) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self.project(rope, x)
        meta = metas[self.sliding_window]
        scale, softcap = self.scale, self.softcap
        if isinstance(meta, DenseMetadata):
            out = dense_attention(q, k, v, meta, scale=scale, softcap=softcap)
        elif isinstance(meta, FlexMetadata):
            out = flex_paged_attention(q, k, v, self.k_cache, self.v_cache, meta, scale=scale)
        else:
            out = paged_attention(
                q, k, v, self.k_cache, self.v_cache, meta, scale=scale, softcap=softcap
            )
        result: torch.Tensor = self.o_proj(out.reshape(t, -1))
        return result

    def project(
        self, rope: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [T, H, D], k and v [T, Hkv, D] of the step's tokens, q and k rotated (the
        hook the other architectures' attentions override)."""
        t = x.shape[0]
        h, hkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        if self.qkv_proj is not None:
            qkv = self.qkv_proj(x).view(t, h + 2 * hkv, d)
            if self.use_triton:
                from kiln.llm.kernels import elementwise

                elementwise.rotate_(qkv[:, : h + hkv], *rope)  # the projection's output: ours
                q, k, v = qkv[:, :h], qkv[:, h : h + hkv], qkv[:, h + hkv :]
            elif cpu_ops.usable(qkv):
                # q and k rotate in place, in one pass (the projection's output is ours)
                cpu_ops.rotate_(qkv, *rope, h + hkv)
                q, k, v = qkv[:, :h], qkv[:, h : h + hkv], qkv[:, h + hkv :]
            else:
                # q and k rotate together: one pass over both
                qk = rotate(qkv[:, : h + hkv], *rope)
                q, k, v = qk[:, :h], qk[:, h:], qkv[:, h + hkv :]
        else:
            q = rotate(self.q_proj(x).view(t, h, d), *rope)
            k = rotate(self.k_proj(x).view(t, hkv, d), *rope)
            v = self.v_proj(x).view(t, hkv, d)
        return q, k, v


def _stack(*parts: nn.Linear) -> nn.Linear:
    first = parts[0]
    if isinstance(first, QuantLinear):  # quantized projections stack their own way
        return first.stack(parts)
    out = sum(p.out_features for p in parts)
    fused = nn.Linear(
        first.in_features,
        out,
        bias=first.bias is not None,
        device=first.weight.device,
        dtype=first.weight.dtype,
    )
    with torch.no_grad():
        fused.weight.copy_(torch.cat([p.weight for p in parts]))
        if fused.bias is not None:
            fused.bias.copy_(torch.cat([p.bias for p in parts]))
    return fused


class MLP(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(args.hidden_size, args.intermediate_size, bias=False)
        self.up_proj = nn.Linear(args.hidden_size, args.intermediate_size, bias=False)
        self.down_proj = nn.Linear(args.intermediate_size, args.hidden_size, bias=False)
        #: gate and up in one matrix product, once the checkpoint is loaded (``fuse``)
        self.gate_up_proj: nn.Linear | None = None
        #: SiLU-and-mul by a Triton kernel (``kernels.enable``)
        self.use_triton = False

    def fuse(self) -> None:
        """One projection for gate and up (as ``Attention.fuse``)."""
        self.gate_up_proj = _stack(self.gate_proj, self.up_proj)
        del self.gate_proj, self.up_proj

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_proj is not None and self.use_triton:
            from kiln.llm.kernels import elementwise

            fused: torch.Tensor = self.down_proj(elementwise.silu_and_mul(self.gate_up_proj(x)))
            return fused
        if self.gate_up_proj is not None:
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        hidden = F.silu(gate)
        out: torch.Tensor = self.down_proj(hidden.mul_(up))
        return out


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, layer: int) -> None:
        super().__init__()
        self.self_attn = Attention(args, layer)
        self.mlp = MLP(args)
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)

    def forward(
        self,
        rope: tuple[torch.Tensor, torch.Tensor],
        x: torch.Tensor,
        residual: torch.Tensor | None,
        metas: StepMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``x`` is the previous layer's output, not yet added to the ``residual`` stream
        (None for the first layer, whose ``x`` is the embeddings); returns this layer's
        output and the stream, for the next layer to add (vLLM's layout: each add is fused
        with the norm that follows it)."""
        if residual is None:
            residual = x
            h = self.input_layernorm(x)
        else:
            h = self.input_layernorm.add_forward(x, residual)
        h = self.self_attn(rope, h, metas)
        h = self.post_attention_layernorm.add_forward(h, residual)
        return self.feed_forward(h), residual

    def feed_forward(self, h: torch.Tensor) -> torch.Tensor:
        """The layer's MLP (Mixtral's experts sit elsewhere in its checkpoint)."""
        out: torch.Tensor = self.mlp(h)
        return out


class Backbone(nn.Module):
    def __init__(
        self,
        args: ModelArgs,
        rotary_emb: RotaryEmbedding,
        layer_cls: type[nn.Module] = DecoderLayer,
        norm_cls: type[RMSNorm] = RMSNorm,
    ) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(layer_cls(args, i) for i in range(args.num_hidden_layers))
        self.norm = norm_cls(args.hidden_size, args.rms_norm_eps)
        self.rotary_emb: RotaryEmbedding = rotary_emb


class LlamaForCausalLM(nn.Module):
    #: the decoder layer and norm of this architecture (subclasses name theirs)
    layer_cls: type[nn.Module] = DecoderLayer
    norm_cls: type[RMSNorm] = RMSNorm
    #: the decode step may be captured as a CUDA graph (no host synchronisation in it)
    cuda_graphs = True

    def __init__(self, args: ModelArgs, max_positions: int) -> None:
        super().__init__()
        self.args = args
        rope = self.rotary_embedding(args, max_positions)
        self.model = Backbone(args, rope, self.layer_cls, self.norm_cls)
        self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        # a classifier has no LM head in its checkpoint: the embeddings stand in (unused)
        if args.tie_word_embeddings or args.num_labels:
            self.lm_head.weight = self.model.embed_tokens.weight
        if args.num_labels:  # transformers' *ForSequenceClassification head
            self.score = nn.Linear(args.hidden_size, args.num_labels, bias=False)

    def rotary_embedding(self, args: ModelArgs, max_positions: int) -> RotaryEmbedding:
        """The model's RoPE tables (an architecture with its own scheme overrides this)."""
        return RotaryEmbedding(args.head_dim, max_positions, args.rope_theta, args.rope_scaling)

    def fuse(self) -> None:
        """Fuse every layer's projections (after the checkpoint is loaded into the
        separate ones): every submodule with a ``fuse`` step runs it."""
        for module in list(self.modules()):
            fuse = getattr(module, "fuse", None)
            if module is not self and callable(fuse):
                fuse()

    def rebuild_rope(self, device: torch.device) -> None:
        """Compute every rotary table on ``device`` (a model built on the meta device)."""
        for module in self.modules():
            if isinstance(module, RotaryEmbedding):
                module.rebuild(device)

    def attention_layers(self) -> list[Attention]:
        return [m for m in self.modules() if isinstance(m, Attention)]

    def windows(self) -> list[int | None]:
        """The distinct attention windows of the layers: a step's metadata is built for
        each (usually one: a model's layers all share theirs)."""
        return list(dict.fromkeys(a.sliding_window for a in self.attention_layers()))

    def _layers(
        self, input_ids: torch.Tensor, positions: torch.Tensor, metas: StepMetadata
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Every layer: the last one's output and the residual stream, not yet added."""
        x = self.model.embed_tokens(input_ids)
        rope = self.model.rotary_emb.lookup(positions, x.dtype)
        residual: torch.Tensor | None = None
        for layer in self.model.layers:
            x, residual = layer(rope, x, residual, metas)
        assert residual is not None, "a model has at least one layer"
        return x, residual

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        metas: StepMetadata,
        logit_index: torch.Tensor,
    ) -> torch.Tensor:
        """Logits [len(logit_index), vocab] for the flat tokens ``logit_index`` picks;
        ``metas``: the step's attention metadata for each of ``windows()``."""
        x, residual = self._layers(input_ids, positions, metas)
        # only the rows that are sampled: their last add and the final norm
        hidden = self.model.norm.add_forward(x[logit_index], residual[logit_index])
        logits: torch.Tensor = self.lm_head(hidden)
        return logits

    def hidden_states(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        metas: StepMetadata,
        rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The final norm's output (``transformers``' ``last_hidden_state``) for the flat
        tokens ``rows`` picks (None: every token): what a pooler reads."""
        x, residual = self._layers(input_ids, positions, metas)
        if rows is not None:
            x, residual = x[rows], residual[rows]
        hidden: torch.Tensor = self.model.norm.add_forward(x, residual)
        return hidden
