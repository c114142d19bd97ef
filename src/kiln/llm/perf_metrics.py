"""vLLM's ``--enable-mfu-metrics`` estimates: the floating-point operations, and the bytes
read and written, that one engine step costs each GPU, from the model's shapes and the
step's token counts alone (vLLM's ``v1/metrics/perf.py`` analytical model, reproduced
term by term so that kiln's ``vllm:estimated_*_per_gpu_total`` read as vLLM's do).

Three components are billed, as in vLLM: attention (the QKV and output projections, the
QK and AV products over each token's context, a sliding window's layers over the
window), the feed-forward (SwiGLU's three matmuls; a mixture of experts' routed and
shared experts) and the unembedding (logits of each prefill's last token and of every
decode token). Attention and the feed-forward are left out, as vLLM leaves them out, for a
quantization method vLLM has no weight size for (GGUF). Per GPU: heads, the FFN's
intermediate width and the vocabulary are divided over ``--tensor-parallel-size``.

The arithmetic is a few dozen multiplications per step, and a pass over the step's
sequences to sum their tokens and contexts: nothing per token. Importing this module does
not import torch.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

#: vLLM's weight bytes per quantized weight, for the methods kiln loads (``gguf`` has
#: none in vLLM's table: attention and the FFN are not billed)
QUANT_WEIGHT_BYTES: dict[str, float] = {
    "fp8": 1, "compressed-tensors": 0.5, "awq": 0.5, "awq_marlin": 0.5, "gptq": 0.5,
    "gptq_marlin": 0.5,
}  # fmt: skip
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


@dataclass(slots=True)
class StepContext:
    """vLLM's ``ExecutionContext``: one step's sequences as (tokens, context) pairs, split
    into prefills and decodes."""

    requests: list[tuple[int, int, bool]] = field(default_factory=list)
    prefill_requests: int = 0
    prefill_tokens: int = 0
    prefill_context: int = 0
    decode_tokens: int = 0
    decode_context: int = 0
    token_context: int = 0

    def add(self, num_tokens: int, context_len: int, is_prefill: bool) -> None:
        self.requests.append((num_tokens, context_len, is_prefill))
        if is_prefill:
            self.prefill_requests += 1
            self.prefill_tokens += num_tokens
            self.prefill_context += context_len
        else:
            self.decode_tokens += num_tokens
            self.decode_context += context_len
        self.token_context += num_tokens * context_len

    @property
    def tokens(self) -> int:
        return self.prefill_tokens + self.decode_tokens

    def windowed(self, window: int) -> tuple[int, int, int]:
        """(sum of tokens x context, prefill context, decode context), each context
        clamped to the sliding ``window``."""
        product = prefill = decode = 0
        for n, ctx, is_prefill in self.requests:
            ctx = min(ctx, window)
            product += n * ctx
            if is_prefill:
                prefill += ctx
            else:
                decode += ctx
        return product, prefill, decode


def quant_method(config: Mapping[str, Any]) -> str | None:
    """A Hugging Face ``config.json``'s quantization method (vLLM's name; None: none)."""
    quant = config.get("quantization_config")
    if not isinstance(quant, dict):
        return None
    return str(quant.get("quant_method", "")).lower() or None


def _first(raw: Mapping[str, Any], names: tuple[str, ...], default: Any) -> Any:
    for name in names:
        if name in raw:
            return raw[name]
    return default


@dataclass(slots=True)
class ModelShape:
    """What vLLM's parsers read from a model's config, for one engine."""

    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    layers: int
    vocab: int
    intermediate: int
    #: sliding-window layers and their window (0, None: none)
    swa_layers: int = 0
    window: int | None = None
    num_experts: int = 0
    experts_per_tok: int = 0
    moe_intermediate: int = 0
    shared_experts: int = 0
    moe_layers: int = 0
    weight_bytes: float = 2
    act_bytes: int = 2
    cache_bytes: int = 2
    #: the model dtype's bytes (the unembedding's weights are never quantized in vLLM's)
    dtype_bytes: int = 2
    #: attention and the FFN are billed (False: a quantization vLLM has no size for)
    billed: bool = True
    tp: int = 1

    @classmethod
    def of(
        cls,
        args: Any,
        dtype: str,
        kv_cache_dtype: str = "auto",
        quantization: str | None = None,
        tp: int = 1,
    ) -> ModelShape:
        """``args``: the engine's ``ModelArgs``; ``dtype``: the resolved model dtype;
        ``quantization``: the checkpoint's method (vLLM's name; None: none)."""
        raw: Mapping[str, Any] = args.hf_config.get("text_config") or args.hf_config
        size = DTYPE_BYTES.get(dtype, 2)
        windows = [w for w in args.layer_windows() if w is not None]
        experts = _first(raw, ("num_experts", "moe_num_experts", "n_routed_experts",
                               "num_local_experts"), 0) or 0  # fmt: skip
        experts = int(experts[0] if isinstance(experts, list) else experts)
        per_tok = _first(raw, ("num_experts_per_tok", "num_experts_per_token",
                               "top_k_experts", "moe_topk", "moe_top_k"), 0) or 0  # fmt: skip
        per_tok = int(max(per_tok, default=0) if isinstance(per_tok, list) else per_tok)
        layers = args.num_hidden_layers
        moe_layers = layers if experts else 0
        step = raw.get("interleave_moe_layer_step") or 0
        if step > 0:
            moe_layers = sum(1 for i in range(layers) if (i + 1) % step == 0)
        if "moe_layer_freq" in raw and "first_k_dense_replace" in raw:
            first, freq = raw["first_k_dense_replace"], raw["moe_layer_freq"]
            moe_layers = sum(1 for i in range(layers) if i >= first and i % freq == 0)
        billed = quantization is None or quantization in QUANT_WEIGHT_BYTES
        return cls(
            hidden=args.hidden_size,
            heads=args.num_attention_heads,
            kv_heads=args.num_key_value_heads,
            head_dim=args.head_dim,
            layers=layers,
            vocab=args.vocab_size,
            intermediate=int(raw.get("intermediate_size", args.hidden_size * 4)),
            swa_layers=len(windows),
            window=args.sliding_window if windows else None,
            num_experts=experts,
            experts_per_tok=per_tok,
            moe_intermediate=int(_first(raw, ("moe_intermediate_size", "intermediate_size"), 0)),
            shared_experts=int(_first(raw, ("n_shared_experts", "num_shared_experts"), 0) or 0),
            moe_layers=moe_layers,
            weight_bytes=size if quantization is None else QUANT_WEIGHT_BYTES.get(quantization, 0),
            act_bytes=size,
            cache_bytes=1 if kv_cache_dtype.startswith("fp8") else size,
            dtype_bytes=size,
            billed=billed,
            tp=tp,
        )

    # ---- one step ------------------------------------------------------------------------
    def estimate(self, ctx: StepContext) -> tuple[int, int, int]:
        """(FLOPs, bytes read, bytes written) of the step, per GPU."""
        flops = read = write = 0
        if self.billed:
            f, r, w = self._attention(ctx)
            flops, read, write = f, r, w
            f, r, w = self._ffn(ctx)
            flops, read, write = flops + f, read + r, write + w
        f, r, w = self._unembed(ctx)
        return flops + f, read + r, write + w

    def _attention(self, ctx: StepContext) -> tuple[int, int, int]:
        D, d, act, wb = self.hidden, self.head_dim, self.act_bytes, self.weight_bytes
        cache = self.cache_bytes
        q, kv = max(1, self.heads // self.tp), max(1, self.kv_heads // self.tp)
        T = ctx.tokens
        L = float(self.layers)
        L_swa = float(self.swa_layers)
        L_full = L - L_swa
        flops = int(2 * T * D * (q + 2 * kv) * d * L) + int(2 * T * D * q * d * L)
        qk = av = 0.0
        if L_full > 0:
            qk += 2 * q * ctx.token_context * d * L_full
            av += 2 * q * ctx.token_context * d * L_full
        sw_product = sw_prefill = sw_decode = 0
        if L_swa > 0 and self.window is not None:
            sw_product, sw_prefill, sw_decode = ctx.windowed(self.window)
            qk += 2 * q * sw_product * d * L_swa
            av += 2 * q * sw_product * d * L_swa
        flops += int(qk) + int(av)
        attn_input = 0.0
        for layers, prefill_ctx, decode_ctx in (
            (L_full, ctx.prefill_context, ctx.decode_context),
            (L_swa, sw_prefill, sw_decode),
        ):
            if layers <= 0:
                continue
            if ctx.prefill_tokens > 0:
                attn_input += (ctx.prefill_tokens * q + 2 * prefill_ctx * kv) * d * act * layers
            if ctx.decode_tokens > 0:
                attn_input += (ctx.decode_tokens * q * d * act * layers
                               + 2 * decode_ctx * kv * d * cache * layers)  # fmt: skip
        read = int(T * D * act * L) + int(D * (q + 2 * kv) * d * wb * L)
        if T > 0:
            read += int(attn_input)
        read += int(T * q * d * act * L) + int(q * d * D * wb * L)
        write = (int(T * (q + 2 * kv) * d * act * L) + int(2 * T * kv * d * cache * L)
                 + int(T * D * act * L))  # fmt: skip
        return flops, read, write

    def _ffn(self, ctx: StepContext) -> tuple[int, int, int]:
        D, act, wb = self.hidden, self.act_bytes, self.weight_bytes
        T = ctx.tokens
        Lm, E, S = self.moe_layers, self.experts_per_tok, self.shared_experts
        Ld = self.layers - Lm
        DI, MI = self.intermediate // self.tp, self.moe_intermediate // self.tp
        tokens = T * E if E else 0  # the activated (token, expert) pairs
        flops = read = write = 0
        if Ld:
            flops += 2 * D * 3 * DI * T * Ld
            read += (int(T * D * act * Ld) + int(2 * D * DI * wb * Ld) + int(2 * T * DI * act * Ld)
                     + int(T * DI * act * Ld) + int(D * DI * wb * Ld))  # fmt: skip
            write += int(2 * T * DI * act * Ld) + int(T * DI * act * Ld) + int(T * D * act * Ld)
        if Lm and E:
            experts = min(tokens, self.num_experts)  # perfect balance, as vLLM assumes
            flops += 2 * D * 3 * MI * tokens * Lm
            read += (int(tokens * D * act * Lm) + int(2 * D * MI * experts * wb * Lm)
                     + int(2 * tokens * MI * act * Lm) + int(tokens * MI * act * Lm)
                     + int(D * MI * experts * wb * Lm))  # fmt: skip
            write += (int(2 * tokens * MI * act * Lm) + int(tokens * MI * act * Lm)
                      + int(tokens * D * act * Lm))  # fmt: skip
        if Lm and S:
            flops += 2 * D * 3 * MI * S * T * Lm
            read += (int(T * D * act * Lm) + int(2 * D * MI * S * wb * Lm)
                     + int(2 * T * MI * S * act * Lm) + int(T * MI * act * Lm)
                     + int(D * MI * S * wb * Lm))  # fmt: skip
            write += (int(2 * T * S * MI * act * Lm) + int(T * S * MI * act * Lm)
                      + int(T * S * D * act * Lm))  # fmt: skip
        return flops, read, write

    def _unembed(self, ctx: StepContext) -> tuple[int, int, int]:
        D, V = self.hidden, self.vocab // self.tp
        T = ctx.prefill_requests + ctx.decode_tokens  # the rows that need logits
        return (2 * T * D * V, T * D * self.act_bytes + D * V * self.dtype_bytes,
                T * V * self.act_bytes)  # fmt: skip
