"""Portable paged attention: scatter new K/V into the block pool, gather each sequence's
keys through its block table, run ``scaled_dot_product_attention`` on CPU or GPU.

A step mixes decodes (one new token each) and prefills (a prompt or a chunk of one), and
padding them into one batch would cost ``batch x longest prompt x longest context``. So:

- decodes go in a few batched groups of similar context length (sorted, then cut where
  padding to the group's longest would waste more than ``MAX_PADDING``): the key gather,
  the step's main memory traffic, stays close to the keys that exist;
- each prefill runs alone. A fresh prompt attends to its own new K/V with SDPA's
  ``is_causal`` (queries and keys are the same length, so top-left alignment is right) and
  touches no cache; a later chunk, or a prompt whose prefix is already cached, gathers its
  keys and uses a causal mask aligned to the bottom right, built from absolute positions.

Everything a layer needs is built once per step (``AttentionMetadata.build``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

#: a decode group is closed when padding its keys to its longest sequence would exceed
#: this fraction of its real keys
MAX_PADDING = 0.25


@dataclass(slots=True)
class DecodeGroup:
    """Sequences with one new token each, of similar context length."""

    #: [b] index of each sequence's token among the step's flat tokens
    token_index: torch.Tensor
    #: [b, nb] physical blocks of each sequence (padding: block 0, masked out)
    block_tables: torch.Tensor
    #: [b, 1, 1, nb * block_size] True where the key position holds a token
    mask: torch.Tensor


@dataclass(slots=True)
class PrefillChunk:
    """One sequence's run of new tokens (flat positions ``start .. start + length``)."""

    start: int
    length: int
    #: tokens already in the cache before this step; 0: attend to the new K/V only
    num_computed: int
    #: [nb] physical blocks (only when ``num_computed > 0``)
    block_table: torch.Tensor | None = None
    #: [length, num_computed + length] causal mask aligned to the bottom right
    mask: torch.Tensor | None = None


@dataclass(slots=True)
class AttentionMetadata:
    """Built once per step by the model runner; read by every layer."""

    #: [T] flat KV slot (block_id * block_size + offset) of each new token
    slot_mapping: torch.Tensor
    decodes: list[DecodeGroup]
    prefills: list[PrefillChunk]

    @classmethod
    def build(
        cls,
        block_tables: list[list[int]],
        num_computed: list[int],
        num_new: list[int],
        block_size: int,
        device: torch.device,
    ) -> AttentionMetadata:
        slots: list[int] = []
        decode_rows: list[tuple[int, int, list[int]]] = []  # (context, flat index, table)
        prefills: list[PrefillChunk] = []
        start = 0
        for table, computed, n in zip(block_tables, num_computed, num_new, strict=True):
            slots.extend(
                table[p // block_size] * block_size + p % block_size
                for p in range(computed, computed + n)
            )
            if n == 1 and computed > 0:
                decode_rows.append((computed + 1, start, table))
            else:
                prefills.append(_prefill(start, n, computed, table, block_size, device))
            start += n
        decode_rows.sort(key=lambda row: row[0])
        decodes = [_decode_group(g, block_size, device) for g in _groups(decode_rows, block_size)]
        slot_mapping = torch.tensor(slots, dtype=torch.long, device=device)
        return cls(slot_mapping=slot_mapping, decodes=decodes, prefills=prefills)


def _groups(rows: list[tuple[int, int, list[int]]],
            block_size: int) -> list[list[tuple[int, int, list[int]]]]:  # fmt: skip
    """Cut rows sorted by context length where padding to the longest would be wasteful."""
    groups: list[list[tuple[int, int, list[int]]]] = []
    current: list[tuple[int, int, list[int]]] = []
    real = 0
    for row in rows:
        blocks = -(-row[0] // block_size)
        if current and (len(current) + 1) * blocks > (1 + MAX_PADDING) * (real + blocks):
            groups.append(current)
            current, real = [], 0
        current.append(row)
        real += blocks
    if current:
        groups.append(current)
    return groups


def _decode_group(rows: list[tuple[int, int, list[int]]], block_size: int,
                  device: torch.device) -> DecodeGroup:  # fmt: skip
    width = -(-rows[-1][0] // block_size)  # sorted: the last row is the longest
    tables = [table[:width] + [0] * (width - len(table[:width])) for _, _, table in rows]
    context = torch.tensor([ctx for ctx, _, _ in rows])
    mask = torch.arange(width * block_size)[None, :] < context[:, None]
    return DecodeGroup(
        token_index=torch.tensor([i for _, i, _ in rows], dtype=torch.long, device=device),
        block_tables=torch.tensor(tables, dtype=torch.long, device=device),
        mask=mask[:, None, None, :].to(device),
    )


def _prefill(start: int, n: int, computed: int, table: list[int], block_size: int,
             device: torch.device) -> PrefillChunk:  # fmt: skip
    if computed == 0:
        return PrefillChunk(start, n, 0)
    total = computed + n
    blocks = table[: -(-total // block_size)]
    q_pos = torch.arange(computed, total)
    mask = torch.arange(total)[None, :] <= q_pos[:, None]
    return PrefillChunk(
        start,
        n,
        computed,
        block_table=torch.tensor(blocks, dtype=torch.long, device=device),
        mask=mask.to(device),
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
    out = torch.empty_like(q)
    for g in meta.decodes:
        # whole blocks are gathered (one index per block, not per token)
        keys = k_cache[g.block_tables].flatten(1, 2).transpose(1, 2)  # [b, Hkv, Lk, D]
        values = v_cache[g.block_tables].flatten(1, 2).transpose(1, 2)
        queries = q[g.token_index][:, :, None]  # [b, H, 1, D]
        o = F.scaled_dot_product_attention(
            queries, keys.to(q.dtype), values.to(q.dtype), attn_mask=g.mask, enable_gqa=True
        )
        out[g.token_index] = o[:, :, 0]
    for p in meta.prefills:
        span = slice(p.start, p.start + p.length)
        queries = q[span].transpose(0, 1)[None]  # [1, H, n, D]
        if p.block_table is None:
            keys, values = k[span], v[span]
            causal, mask = True, None
        else:
            total = p.num_computed + p.length
            keys = k_cache[p.block_table].flatten(0, 1)[:total]
            values = v_cache[p.block_table].flatten(0, 1)[:total]
            causal, mask = False, p.mask
        o = F.scaled_dot_product_attention(
            queries,
            keys.transpose(0, 1)[None].to(q.dtype),
            values.transpose(0, 1)[None].to(q.dtype),
            attn_mask=mask,
            is_causal=causal,
            enable_gqa=True,
        )
        out[span] = o[0].transpose(0, 1)
    return out
