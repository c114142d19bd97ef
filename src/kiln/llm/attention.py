"""Portable paged attention: scatter new K/V into the block pool, gather each sequence's
keys through its block table, run ``scaled_dot_product_attention`` on CPU or GPU.

All sequences of a step (prefills, prefill chunks, decodes) go in one padded batch. The
mask is built from absolute positions, so it is causal aligned to the bottom right: a query
at position p sees keys 0..p even when the keys outnumber the queries (a decode, a later
chunk of a prompt, a prefix-cache hit). SDPA's own ``is_causal`` aligns to the top left,
which is only right when queries and keys are the same length.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(slots=True)
class AttentionMetadata:
    """Built once per step by the model runner; read by every layer."""

    #: [T] flat KV slot (block_id * block_size + offset) of each new token
    slot_mapping: torch.Tensor
    #: [B, Lq] index into the flat new tokens of each sequence's queries (padding: 0)
    query_index: torch.Tensor
    #: [B, Lq] True where query_index is a real token
    query_valid: torch.Tensor
    #: [B, Lk] flat KV slot of each sequence's keys 0..Lk-1 (padding: slot 0)
    key_slots: torch.Tensor
    #: [B, 1, Lq, Lk] True where a query may attend to a key
    mask: torch.Tensor

    @classmethod
    def build(
        cls,
        block_tables: list[list[int]],
        num_computed: list[int],
        num_new: list[int],
        block_size: int,
        device: torch.device,
    ) -> AttentionMetadata:
        batch = len(num_new)
        lq = max(num_new)
        lk = max(c + n for c, n in zip(num_computed, num_new, strict=True))
        width = max(len(t) for t in block_tables)
        tables = torch.zeros(batch, width, dtype=torch.long)
        for b, table in enumerate(block_tables):
            tables[b, : len(table)] = torch.tensor(table, dtype=torch.long)
        computed = torch.tensor(num_computed, dtype=torch.long)
        new = torch.tensor(num_new, dtype=torch.long)
        starts = torch.cumsum(new, 0) - new
        i = torch.arange(lq)
        query_valid = i[None, :] < new[:, None]
        query_index = torch.where(query_valid, starts[:, None] + i[None, :], 0)
        k = torch.arange(lk)
        block_of_k = torch.clamp(k // block_size, max=width - 1)
        key_slots = tables[:, block_of_k] * block_size + (k % block_size)[None, :]
        q_pos = computed[:, None] + i[None, :]  # [B, Lq]
        mask = k[None, None, :] <= q_pos[:, :, None]
        # A padding query row must attend somewhere or SDPA returns NaN; its output is
        # discarded anyway.
        mask |= (~query_valid)[:, :, None] & (k == 0)[None, None, :]
        q_abs = (computed[:, None] + i[None, :])[query_valid]
        slot_mapping = tables[
            torch.repeat_interleave(torch.arange(batch), new), q_abs // block_size
        ] * block_size + (q_abs % block_size)
        return cls(
            slot_mapping=slot_mapping.to(device),
            query_index=query_index.to(device),
            query_valid=query_valid.to(device),
            key_slots=key_slots.to(device),
            mask=mask[:, None].to(device),
        )


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
) -> torch.Tensor:
    """``q`` [T, H, D], ``k``/``v`` [T, Hkv, D] for the step's new tokens; caches
    [num_blocks, block_size, Hkv, D]. Returns [T, H, D]."""
    num_kv_heads, head_dim = k.shape[1], k.shape[2]
    k_flat = k_cache.view(-1, num_kv_heads, head_dim)
    v_flat = v_cache.view(-1, num_kv_heads, head_dim)
    k_flat.index_copy_(0, meta.slot_mapping, k.to(k_flat.dtype))
    v_flat.index_copy_(0, meta.slot_mapping, v.to(v_flat.dtype))
    queries = q[meta.query_index].transpose(1, 2)  # [B, H, Lq, D]
    keys = k_flat[meta.key_slots].transpose(1, 2)  # [B, Hkv, Lk, D]
    values = v_flat[meta.key_slots].transpose(1, 2)
    out = F.scaled_dot_product_attention(
        queries, keys.to(q.dtype), values.to(q.dtype), attn_mask=meta.mask, enable_gqa=True
    )
    result: torch.Tensor = out.transpose(1, 2)[meta.query_valid]
    return result
