"""Portable paged attention: scatter new K/V into the block pool, gather each sequence's
keys through its block table, run ``scaled_dot_product_attention`` on CPU or GPU.

Cache layout (this backend): ``[num_blocks, num_kv_heads, block_size, head_dim]``. A block
keeps each KV head's keys together, so gathering a sequence's blocks head by head (one
``index_select`` row per block and head) writes them straight into SDPA's
``[batch, kv_heads, keys, head_dim]`` layout, contiguous: the kernel then streams them
without a transpose or a copy of its own.

A step mixes decodes (one new token each) and prefills (a prompt or a chunk of one), and
padding them into one batch would cost ``batch x longest prompt x longest context``. So:

- decodes go in small batched groups of similar context length (sorted, then cut where
  padding to the group's longest would waste more than ``MAX_PADDING`` or the group holds
  ``MAX_GROUP_SEQS``). Each group's keys are gathered into one reused workspace and
  attended at once, while they are still in the CPU's cache: the gather writes them and
  SDPA reads them back from there instead of from memory. The GQA group of query heads
  that share a KV head is folded into the query length (``[b, Hkv, H / Hkv, D]``), which
  turns the kernel's per-head matrix-vector products into one small matrix product.
- each prefill runs alone. A fresh prompt attends to its own new K/V with SDPA's
  ``is_causal`` (queries and keys are the same length, so top-left alignment is right) and
  touches no cache; a later chunk, or a prompt whose prefix is already cached, gathers its
  keys and uses a causal mask aligned to the bottom right, built from absolute positions.

A sliding window (Mistral; Qwen2's upper layers): the query at position i sees the keys at
positions j with i - window < j <= i. Decodes and chunks gather only from the block holding
their first visible key on, and their masks drop the keys before it; a fresh prompt longer
than the window gets an explicit banded mask instead of ``is_causal`` (the two agree when
the prompt fits in the window).

Everything a layer needs is built once per step (``AttentionMetadata.build``), once per
distinct window when the layers differ.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kiln.llm import attention_cpu
from kiln.llm.attention_cpu import FusedDecode

#: a decode group is closed when padding its keys to its longest sequence would exceed
#: this fraction of its real keys
MAX_PADDING = 0.25
#: ... or when it holds this many sequences: a group's gathered keys should stay in the
#: CPU's cache until SDPA reads them (on the 2-vCPU Xeon of benchmarks/llm_cpu.py, groups
#: of 16 were fastest between 1 and 64, for contexts of 150 to 300 tokens)
MAX_GROUP_SEQS = 16


class KVWorkspace:
    """Reused buffers for a decode group's gathered keys and values. A fresh tensor of a few
    MB per group and layer goes back to the OS when freed (glibc maps large blocks), and
    every page of the next one faults in again: that cost as much as the copy itself."""

    def __init__(self) -> None:
        self.keys = torch.empty(0)
        self.values = torch.empty(0)

    def reserve(self, rows: int, block_size: int, head_dim: int, dtype: torch.dtype,
                device: torch.device) -> None:  # fmt: skip
        """Room for ``rows`` gathered (block, head) rows."""
        keys = self.keys
        if (
            keys.shape[0] < rows
            or keys.shape[1:] != (block_size, head_dim)
            or keys.dtype != dtype
            or keys.device != device
        ):
            # headroom: contexts grow a token a step, and each reallocation faults pages in
            shape = (rows + rows // 2, block_size, head_dim)
            self.keys = torch.empty(shape, dtype=dtype, device=device)
            self.values = torch.empty(shape, dtype=dtype, device=device)


@dataclass(slots=True)
class DecodeGroup:
    """Sequences with one new token each, of similar context length."""

    #: [b] index of each sequence's token among the step's flat tokens
    token_index: torch.Tensor
    #: [b * Hkv * nb] row of each (sequence, KV head, block) in the cache viewed as
    #: [num_blocks * Hkv, block_size, D], from the sequence's first block in its window
    #: (padding: block 0, masked out)
    rows: torch.Tensor
    #: [b, 1, 1, nb * block_size] True where the gathered slot holds a key the query sees
    mask: torch.Tensor
    #: blocks per sequence (nb)
    width: int


@dataclass(slots=True)
class PrefillChunk:
    """One sequence's run of new tokens (flat positions ``start .. start + length``)."""

    start: int
    length: int
    #: tokens already in the cache before this step; 0: attend to the new K/V only
    num_computed: int
    #: [nb] physical blocks to gather, from the one holding the first key any of the chunk's
    #: queries sees (only when ``num_computed > 0``)
    block_table: torch.Tensor | None = None
    #: position of the first gathered key (a block boundary)
    first_key: int = 0
    #: [length, num_computed + length - first_key] causal (and windowed) mask aligned to the
    #: bottom right; None: SDPA's ``is_causal`` (a fresh prompt that fits in the window)
    mask: torch.Tensor | None = None


@dataclass(slots=True)
class AttentionMetadata:
    """Built once per step by the model runner; read by every layer."""

    #: [T * Hkv] row of each new token's key (per KV head) in the cache viewed as
    #: [num_blocks * Hkv * block_size, D]
    kv_rows: torch.Tensor
    decodes: list[DecodeGroup]
    prefills: list[PrefillChunk]
    workspace: KVWorkspace
    #: the most (block, head) rows one decode group gathers
    max_rows: int = 0
    #: the ``cpu`` backend: all decodes for its kernel, which reads the blocks in place
    #: (then ``decodes`` is empty)
    fused: FusedDecode | None = None

    @classmethod
    def build(
        cls,
        block_tables: list[list[int]],
        num_computed: list[int],
        num_new: list[int],
        block_size: int,
        device: torch.device,
        num_kv_heads: int,
        workspace: KVWorkspace,
        fused_decode: bool = False,
        window: int | None = None,
        every_row: bool = False,
    ) -> AttentionMetadata:
        """``window``: the layers' sliding window (None: full causal attention);
        ``every_row`` (batch-invariant, with ``fused_decode``): every new token, a prompt's
        too, is attended by the cpu kernel as a decode of its own, so a position's result
        never depends on how its prompt was chunked or what else the step holds."""
        per_block = num_kv_heads * block_size  # cache rows per block
        decode_rows: list[tuple[int, int, list[int]]] = []  # (context, flat index, table)
        prefills: list[PrefillChunk] = []
        start = 0
        for table, computed, n in zip(block_tables, num_computed, num_new, strict=True):
            if every_row and fused_decode:
                decode_rows.extend((computed + j + 1, start + j, table) for j in range(n))
            elif n == 1 and computed > 0:
                decode_rows.append((computed + 1, start, table))
            else:
                prefills.append(_prefill(start, n, computed, table, block_size, device, window))
            start += n
        slots: list[int] = []  # row of each new token's first KV head
        # the cpu kernel writes decodes' K/V itself; a prompt's rows read each other's keys,
        # which must all be in the cache before it runs
        if not (fused_decode and not prefills) or any(n > 1 for n in num_new):
            for table, computed, n in zip(block_tables, num_computed, num_new, strict=True):
                slots.extend(
                    table[p // block_size] * per_block + p % block_size
                    for p in range(computed, computed + n)
                )
        fused = None
        if fused_decode and decode_rows:
            fused, decode_rows = FusedDecode.build(decode_rows, block_size, window), []
        # (blocks to gather, context, index, table), sorted: similar numbers of blocks go
        # together (without a window, in context order as before)
        gathers = sorted(
            (-(-ctx // block_size) - window_start(ctx, window) // block_size, ctx, i, table)
            for ctx, i, table in decode_rows
        )
        decodes = [_decode_group(g, block_size, num_kv_heads, device, window)
                   for g in _groups(gathers)]  # fmt: skip
        heads = torch.arange(num_kv_heads, dtype=torch.long) * block_size
        kv_rows = (torch.tensor(slots, dtype=torch.long)[:, None] + heads).flatten()
        return cls(
            kv_rows=kv_rows.to(device),
            decodes=decodes,
            prefills=prefills,
            workspace=workspace,
            max_rows=max((g.rows.shape[0] for g in decodes), default=0),
            fused=fused,
        )


@dataclass(slots=True)
class DenseMetadata:
    """A forward pass outside the cache (pooling): each sequence attends causally to its own
    new tokens, which are neither read from nor written to any KV block."""

    prefills: list[PrefillChunk]

    @classmethod
    def build(cls, lengths: list[int], device: torch.device,
              window: int | None = None) -> DenseMetadata:  # fmt: skip
        starts = [sum(lengths[:i]) for i in range(len(lengths))]
        return cls([_prefill(s, n, 0, [], 1, device, window)
                    for s, n in zip(starts, lengths, strict=True)])  # fmt: skip


def dense_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    meta: DenseMetadata,
    scale: float | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """``q`` [T, H, D], ``k``/``v`` [T, Hkv, D]; returns [T, H, D]."""
    out = torch.empty_like(q)
    for p in meta.prefills:
        span = slice(p.start, p.start + p.length)
        o = attend(
            q[span].transpose(0, 1)[None],
            k[span].transpose(0, 1)[None],
            v[span].transpose(0, 1)[None],
            p.mask,
            scale,
            softcap,
        )
        out[span] = o[0].transpose(0, 1)
    return out


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """SDPA over ``q`` [B, H, Lq, D] and ``k``/``v`` [B, Hkv, Lk, D] (Hkv divides H);
    ``mask`` True where a key is seen, None: causal with Lq == Lk. With ``softcap`` (Gemma
    2) the scores pass through ``c * tanh(s / c)`` before the mask and softmax, which no
    SDPA kernel does: then the product is spelled out (transformers' eager formula)."""
    if softcap is None:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=True
        )
    group = q.shape[1] // k.shape[1]
    if group > 1:
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)) * (scale or q.shape[-1] ** -0.5)
    scores = torch.tanh(scores / softcap) * softcap
    if mask is None:
        n = q.shape[2]
        mask = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
    scores = scores.masked_fill(~mask, float("-inf"))
    weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(weights, v)


def window_start(context: int, window: int | None) -> int:
    """The first position the query of a sequence of ``context`` tokens (its own included)
    sees."""
    return 0 if window is None else max(0, context - window)


#: a decode to gather: (blocks from its window's first to its last, context, flat index,
#: block table)
_Gather = tuple[int, int, int, list[int]]


def _groups(rows: list[_Gather]) -> list[list[_Gather]]:
    """Cut rows sorted by blocks to gather where padding to the longest would be wasteful,
    or where the group is full."""
    groups: list[list[_Gather]] = []
    current: list[_Gather] = []
    real = 0
    for row in rows:
        blocks = row[0]
        if current and (
            len(current) >= MAX_GROUP_SEQS
            or (len(current) + 1) * blocks > (1 + MAX_PADDING) * (real + blocks)
        ):
            groups.append(current)
            current, real = [], 0
        current.append(row)
        real += blocks
    if current:
        groups.append(current)
    return groups


def _decode_group(rows: list[_Gather], block_size: int, num_kv_heads: int,
                  device: torch.device, window: int | None) -> DecodeGroup:  # fmt: skip
    width = rows[-1][0]  # sorted: the last row gathers the most blocks
    spans, firsts = [], []
    for blocks, ctx, _, table in rows:
        first = -(-ctx // block_size) - blocks  # its window's first block (0: none)
        spans.append(table[first : first + width])
        firsts.append(first)
    tables = torch.tensor([span + [0] * (width - len(span)) for span in spans], dtype=torch.long)
    heads = torch.arange(num_kv_heads, dtype=torch.long)
    # (sequence, head, block) -> row block * Hkv + head of the [NB * Hkv, bs, D] view
    cache_rows = (tables[:, None, :] * num_kv_heads + heads[None, :, None]).flatten()
    context = torch.tensor([ctx for _, ctx, _, _ in rows])[:, None]
    slots = torch.arange(width * block_size)[None, :]
    if window is None:
        mask = slots < context
    else:  # the gathered slot's absolute position, against the window's two edges
        position = torch.tensor(firsts)[:, None] * block_size + slots
        mask = (position < context) & (position >= context - window)
    return DecodeGroup(
        token_index=torch.tensor([i for _, _, i, _ in rows], dtype=torch.long, device=device),
        rows=cache_rows.to(device),
        mask=mask[:, None, None, :].to(device),
        width=width,
    )


def _prefill(start: int, n: int, computed: int, table: list[int], block_size: int,
             device: torch.device, window: int | None) -> PrefillChunk:  # fmt: skip
    if computed == 0 and (window is None or n <= window):
        return PrefillChunk(start, n, 0)  # is_causal over its own keys
    total = computed + n
    # the first query (position ``computed``) sees the furthest back
    first = window_start(computed + 1, window) // block_size if computed else 0
    q_pos = torch.arange(computed, total)[:, None]
    k_pos = torch.arange(first * block_size, total)[None, :]
    mask = k_pos <= q_pos
    if window is not None:
        mask &= k_pos > q_pos - window
    blocks = table[first : -(-total // block_size)]
    return PrefillChunk(
        start,
        n,
        computed,
        block_table=torch.tensor(blocks, dtype=torch.long, device=device) if computed else None,
        first_key=first * block_size,
        mask=mask.to(device),
    )


def cache_shape(num_blocks: int, block_size: int, num_kv_heads: int,
                head_dim: int) -> tuple[int, int, int, int]:  # fmt: skip
    """One layer's K (or V) pool in this backend's layout."""
    return (num_blocks, num_kv_heads, block_size, head_dim)


def _raw(t: torch.Tensor) -> torch.Tensor:
    """An fp8 KV cache (``--kv-cache-dtype fp8``) as its bytes: torch's CPU index_copy_ and
    gathers do not take fp8 tensors, and moving bytes is the same thing."""
    return t.view(torch.uint8) if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) else t


def _cooked(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Bytes gathered by ``_raw`` read back as the cache's dtype."""
    return t.view(dtype) if t.dtype != dtype else t


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """``q`` [T, H, D], ``k``/``v`` [T, Hkv, D] for the step's new tokens; caches
    [num_blocks, Hkv, block_size, D]. Returns [T, H, D]. ``scale``: the scores' (None:
    1 / sqrt(D)); ``softcap``: Gemma 2's score capping (not in the fused cpu kernel: the
    model runner does not pick it for such a model)."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads, block_size = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    cache_dtype = k_cache.dtype
    if meta.kv_rows.numel():
        # the cpu kernel writes its decoding tokens' K/V itself: a step of decodes alone
        # skips this copy (prefill rows need it; the kernel's rows are written twice, alike)
        new_k = _raw(k.reshape(-1, head_dim).to(cache_dtype))
        new_v = _raw(v.reshape(-1, head_dim).to(cache_dtype))
        _raw(k_cache).view(-1, head_dim).index_copy_(0, meta.kv_rows, new_k)
        _raw(v_cache).view(-1, head_dim).index_copy_(0, meta.kv_rows, new_v)
    out = torch.empty_like(q)
    k_rows = _raw(k_cache).view(-1, block_size, head_dim)
    v_rows = _raw(v_cache).view(-1, block_size, head_dim)
    if meta.fused is not None:
        assert softcap is None, "the fused cpu decode has no soft-capping"
        attention_cpu.decode(q, k, v, k_cache, v_cache, meta.fused, out, scale)
    ws = meta.workspace
    if meta.decodes:
        ws.reserve(meta.max_rows, block_size, head_dim, k_rows.dtype, k_cache.device)
    for g in meta.decodes:
        b = g.token_index.shape[0]
        n = g.rows.shape[0]
        keys = torch.index_select(k_rows, 0, g.rows, out=ws.keys[:n])
        values = torch.index_select(v_rows, 0, g.rows, out=ws.values[:n])
        length = g.width * block_size
        # the query heads sharing a KV head ride as that head's query rows
        queries = q[g.token_index].view(b, num_kv_heads, group, head_dim)
        o = attend(
            queries,
            _cooked(keys, cache_dtype).view(b, num_kv_heads, length, head_dim).to(q.dtype),
            _cooked(values, cache_dtype).view(b, num_kv_heads, length, head_dim).to(q.dtype),
            g.mask,
            scale,
            softcap,
        )
        # reshape: CUDA's attention kernels may return a layout view() cannot take
        out.index_copy_(0, g.token_index, o.reshape(b, num_heads, head_dim))
    for p in meta.prefills:
        span = slice(p.start, p.start + p.length)
        queries = q[span].transpose(0, 1)[None]  # [1, H, n, D]
        if p.block_table is None:
            keys, values = k[span].transpose(0, 1), v[span].transpose(0, 1)
        else:
            count = p.num_computed + p.length - p.first_key
            keys = _cooked(_raw(k_cache)[p.block_table], cache_dtype)
            values = _cooked(_raw(v_cache)[p.block_table], cache_dtype)
            keys = keys.transpose(0, 1).flatten(1, 2)[:, :count]
            values = values.transpose(0, 1).flatten(1, 2)[:, :count]
        o = attend(queries, keys[None].to(q.dtype), values[None].to(q.dtype), p.mask, scale,
                   softcap)  # fmt: skip
        out[span] = o[0].transpose(0, 1)
    return out
