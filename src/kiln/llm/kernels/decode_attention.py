"""Paged decode attention in the Triton language: one query token per sequence.

One program per (sequence, KV head). Its query heads (the GQA group sharing that KV head)
are the rows of one tile, padded to 16 (the smallest ``tl.dot`` tile), so K and V are read
once per KV head, not once per query head. The program walks the sequence's context a tile
of keys at a time; each key's page comes from the block table (``pos // block_size``) and
its slot from ``pos % block_size``, so tiles and pages are independent sizes and the cache
is read in place (the flex layout ``[pages, block_size, Hkv, D]``, or any other with the
head dimension contiguous: strides are arguments). Softmax is online (running max and sum
in float32, exp2 with the scale folded in), as in flash attention.

- sliding window: the walk starts at the tile holding the first visible key
  (``seq_len - window``) and masks the keys before it, so a windowed decode reads at most a
  window of K/V;
- soft-capping (Gemma 2): ``c * tanh(s / c)`` on the scaled scores before the softmax,
  tanh spelled with ``exp`` (older Triton versions have no ``tanh``);
- float32 caches use IEEE products (``tl.dot`` would otherwise take TF32 on NVIDIA GPUs);
  bfloat16 and float16 tiles multiply on the tensor cores with float32 accumulation.

Not done (yet): splitting a long context over several programs (flash decoding). At batch 1
a decode launches only ``Hkv`` programs; for the contexts of a chat (a few thousand tokens)
the weights, not the K/V, dominate what a step reads.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kiln.llm.kernels import PagedDecode, interpreting

#: keys per tile of the walk (tl.dot needs at least 16)
TILE = 32


@triton.jit
def _tanh(x):  # type: ignore[no-untyped-def]
    # 1 - 2 / (e^2x + 1): exp overflowing to inf gives 1, underflowing to 0 gives -1
    return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)


@triton.jit  # type: ignore[untyped-decorator]
def _paged_decode_kernel(  # type: ignore[no-untyped-def]
    out_ptr,
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    token_index_ptr,
    block_table_ptr,
    seq_lens_ptr,
    scale,
    softcap,
    window,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_kp,
    stride_ks,
    stride_kh,
    stride_vp,
    stride_vs,
    stride_vh,
    stride_bt,
    BLOCK_SIZE: tl.constexpr,
    GROUP: tl.constexpr,
    GROUP_P: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_P: tl.constexpr,
    TILE_N: tl.constexpr,
    USE_SOFTCAP: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    token = tl.load(token_index_ptr + seq).to(tl.int64)
    seq_len = tl.load(seq_lens_ptr + seq)
    g = tl.arange(0, GROUP_P)
    d = tl.arange(0, HEAD_DIM_P)
    g_ok = g < GROUP
    d_ok = d < HEAD_DIM
    heads = kv_head * GROUP + g
    q = tl.load(
        q_ptr + token * stride_qt + heads[:, None] * stride_qh + d[None, :],
        mask=g_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    if UPCAST:
        q = q.to(tl.float32)
    m_i = tl.full([GROUP_P], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([GROUP_P], dtype=tl.float32)
    acc = tl.zeros([GROUP_P, HEAD_DIM_P], dtype=tl.float32)
    first = 0
    if USE_WINDOW:
        first = tl.maximum(seq_len - window, 0)
    table = block_table_ptr + seq.to(tl.int64) * stride_bt
    for start in range((first // TILE_N) * TILE_N, seq_len, TILE_N):
        pos = start + tl.arange(0, TILE_N)
        ok = pos < seq_len
        if USE_WINDOW:
            ok = ok & (pos >= first)
        page = tl.load(table + pos // BLOCK_SIZE, mask=ok, other=0).to(tl.int64)
        slot = pos % BLOCK_SIZE
        kv_mask = ok[:, None] & d_ok[None, :]
        k_off = page * stride_kp + slot * stride_ks + kv_head * stride_kh
        k = tl.load(k_cache_ptr + k_off[:, None] + d[None, :], mask=kv_mask, other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION)
        s = s * scale
        if USE_SOFTCAP:
            s = softcap * _tanh(s / softcap)
        s = tl.where(ok[None, :], s * 1.4426950408889634, float("-inf"))  # log2 units
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v_off = page * stride_vp + slot * stride_vs + kv_head * stride_vh
        v = tl.load(v_cache_ptr + v_off[:, None] + d[None, :], mask=kv_mask, other=0.0)
        # the probabilities in V's dtype, as flash attention multiplies them
        p = p.to(v.dtype)
        if UPCAST:
            p, v = p.to(tl.float32), v.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=PRECISION)
        m_i = m_new
    acc = acc / l_i[:, None]
    tl.store(
        out_ptr + token * stride_ot + heads[:, None] * stride_oh + d[None, :],
        acc.to(out_ptr.dtype.element_ty),
        mask=g_ok[:, None] & d_ok[None, :],
    )


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: PagedDecode,
    out: torch.Tensor,
    scale: float | None = None,
    softcap: float | None = None,
    window: int | None = None,
) -> None:
    """``out[t] = attention(q[t], the keys of its sequence)`` for each decoding sequence's
    token ``t = meta.token_index[b]``. ``q``/``out`` [T, H, D]; caches [pages, block_size,
    Hkv, D] (the flex layout; any strides with D contiguous); the new tokens' K/V are
    already in the cache. ``window``: the layer's sliding window (None: the whole
    context); ``softcap``: Gemma 2's score capping."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    for name, t in (("q", q), ("out", out), ("k_cache", k_cache), ("v_cache", v_cache)):
        if t.stride(-1) != 1:
            raise ValueError(f"decode_attention: {name}'s head dimension must be contiguous")
    batch = meta.token_index.shape[0]
    if batch == 0:
        return
    _paged_decode_kernel[(batch, num_kv_heads)](
        out,
        q,
        k_cache,
        v_cache,
        meta.token_index,
        meta.block_table,
        meta.seq_lens,
        scale if scale is not None else head_dim**-0.5,
        softcap or 1.0,
        window or 0,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        meta.block_table.stride(0),
        BLOCK_SIZE=block_size,
        GROUP=group,
        GROUP_P=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim,
        HEAD_DIM_P=max(16, triton.next_power_of_2(head_dim)),
        TILE_N=TILE,
        USE_SOFTCAP=softcap is not None,
        USE_WINDOW=window is not None,
        # float32: IEEE products, not TF32; float16/bfloat16 tiles: tl.dot's default
        PRECISION="ieee" if k_cache.dtype == torch.float32 else None,
        # Triton's interpreter multiplies bfloat16 tiles wrongly (3.9: garbage); there the
        # operands, already rounded to bfloat16, are multiplied in float32
        UPCAST=k_cache.dtype == torch.bfloat16 and interpreting(),
    )
