"""Flex-attention backend: ``torch.nn.attention.flex_attention`` reads K/V straight from
the paged cache, steered by a ``BlockMask`` built from the block tables.

The whole cache, flattened to ``[1, Hkv, num_slots, D]``, is the key sequence of every
query row; nothing is gathered per sequence. Sparsity comes from the ``BlockMask``, whose
KV block is one cache page (``block_size`` slots): for each sequence it lists the physical
pages of its block table, in logical order, split into *full* pages (every slot visible to
every query of the 128-row query block: no mask evaluated) and *partial* ones (the causal
edge, where ``mask_mod`` decides). ``mask_mod`` maps a physical slot back to a logical
position through an inverse block table (-1: not this sequence's page), so it is correct
on its own: the eager CPU implementation ignores the sparsity and evaluates it everywhere.

Sequences of a step go in two groups, each a padded batch: decodes (one query each, the
shape CUDA graphs capture) and prefills/chunks (up to the longest chunk). The mask is
causal aligned to the bottom right by absolute positions, as in the portable backend.

A sliding window (the query at position i sees keys i - window < j <= i) adds its lower
edge to ``mask_mod``; the BlockMask then lists only the pages that hold a visible key of the
query block, *full* where every query of the block sees every slot, *partial* at both edges.

On CUDA ``flex_attention`` is compiled (Triton kernels); on CPU it runs eagerly, which
materialises scores over every cache slot: correct, but only for small caches (tests).

``attention_backend: triton`` (the default on CUDA when triton imports): the same cache and
the same prefill path, but decodes go to kiln's own Triton kernel
(``kernels.decode_attention``), which walks each sequence's block table: no BlockMask is
built for them and the flex kernels are compiled for prefills only.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from kiln.core.errors import KilnError, Status
from kiln.llm import attention_cpu, kernels
from kiln.llm.kernels import PagedDecode

#: rows per query block of the BlockMask (the compiled kernels' default tile)
Q_BLOCK = 128
#: compilations of flex_attention allowed. Dynamo specialises each of a step's batch, query
#: length, query blocks and pages per sequence on being 1 or more, and each mask_mod (full,
#: windowed) separately: a serving mix compiles ~13 variants for a full-attention model and
#: ~24 with full and windowed layers (tests/unit/llm/test_llm_attention_flex.py). torch.compile's
#: default limit is 8, past which fullgraph=True raises FailOnRecompileLimitHit.
FLEX_RECOMPILE_LIMIT = 64
_compiled: Callable[..., Any] | None = None


def resolve_attention_backend(
    name: str,
    device: torch.device,
    block_size: int,
    dtype: torch.dtype = torch.float32,
    softcap: bool = False,
) -> str:
    """``torch``, ``cpu``, ``flex`` or ``triton`` for the configured name: ``auto`` is
    flex on CUDA (``triton`` is opt-in), the fused CPU kernel on the CPU
    when numba is installed and the cache is float32, and the portable backend otherwise.
    A model with attention soft-capping (Gemma 2) runs on the portable backend, the one
    that caps scores."""
    if name == "torch" or (name == "auto" and softcap):
        return "torch"
    if softcap:
        raise KilnError(
            f"llm backend: attention_backend '{name}' has no attention logit soft-capping "
            "(attn_logit_softcapping); use 'torch' or 'auto'",
            Status.INVALID_ARG,
        )
    if name == "cpu" or (name == "auto" and device.type == "cpu"):
        problem = _cpu_backend_problem(device, dtype)
        if problem is None:
            return "cpu"
        if name == "cpu":
            raise KilnError(f"llm backend: attention_backend 'cpu' {problem}", Status.INVALID_ARG)
        return "torch"
    cuda_pages_ok = block_size >= 16  # a page must fill a tensor-core tile (BLOCK_N >= 16)
    if name == "auto":
        if device.type != "cuda" or not cuda_pages_ok:
            return "torch"
        # triton is faster on an H200 (docs/design/triton-decode-attention.md) but opt-in
        # until LoRA, MoE, quantized and speculative engines have run with it on a GPU
        return "flex"
    if device.type == "cuda" and not cuda_pages_ok:
        raise KilnError(
            f"llm backend: attention_backend '{name}' on CUDA needs block_size >= 16, "
            f"got {block_size}",
            Status.INVALID_ARG,
        )
    if name == "triton":
        problem = kernels.problem(device)
        if problem is not None:
            raise KilnError(
                f"llm backend: attention_backend 'triton' {problem}", Status.INVALID_ARG
            )
    return name


def _cpu_backend_problem(device: torch.device, dtype: torch.dtype) -> str | None:
    if device.type != "cpu":
        return f"runs on the CPU, not on {device.type}"
    if dtype != torch.float32:
        return f"needs dtype float32, got {str(dtype).removeprefix('torch.')}"
    if not attention_cpu.available():
        return "needs numba: pip install 'kiln-serve[llm]'"
    return None


@dataclass(slots=True)
class FlexGroup:
    """One padded batch of sequences and the BlockMask that steers it."""

    #: [B, Lq] flat index of each query row among the step's new tokens (padding: 0)
    token_index: torch.Tensor
    #: [B, Lq] True where the row is a real query
    query_valid: torch.Tensor
    #: [B] absolute position of each sequence's first query
    q_start: torch.Tensor
    #: [B, pages] logical page of each physical page, -1 where not the sequence's
    page_to_logical: torch.Tensor
    kv_num_blocks: torch.Tensor
    kv_indices: torch.Tensor
    full_kv_num_blocks: torch.Tensor
    full_kv_indices: torch.Tensor
    block_mask: BlockMask
    #: decode groups have Lq == 1 and every row valid, so they avoid boolean indexing
    #: (whose data-dependent shape a CUDA graph cannot capture)
    is_decode: bool

    def tensors(self) -> list[torch.Tensor]:
        return [
            self.token_index,
            self.query_valid,
            self.q_start,
            self.page_to_logical,
            self.kv_num_blocks,
            self.kv_indices,
            self.full_kv_num_blocks,
            self.full_kv_indices,
        ]


@dataclass(slots=True)
class FlexMetadata:
    """Built once per step by the model runner; read by every layer."""

    #: [T] flat KV slot of each new token
    slot_mapping: torch.Tensor
    groups: list[FlexGroup]
    compiled: bool
    kernel_options: dict[str, Any] | None
    #: the ``triton`` backend: the decodes, for its kernel (then no group holds them)
    decode: PagedDecode | None = None
    #: the layers' sliding window (None: full attention), for the Triton decode kernel
    window: int | None = None

    def copy_(self, other: FlexMetadata) -> None:
        """Overwrite these tensors in place with ``other``'s (same shapes): how a captured
        CUDA graph, which reads fixed addresses, gets each step's metadata."""
        self.slot_mapping.copy_(other.slot_mapping, non_blocking=True)
        for mine, theirs in zip(self.groups, other.groups, strict=True):
            for dst, src in zip(mine.tensors(), theirs.tensors(), strict=True):
                dst.copy_(src, non_blocking=True)
        if self.decode is not None:
            assert other.decode is not None
            for dst, src in zip(self.decode.tensors(), other.decode.tensors(), strict=True):
                dst.copy_(src, non_blocking=True)

    @classmethod
    def build(
        cls,
        block_tables: list[list[int]],
        num_computed: list[int],
        num_new: list[int],
        block_size: int,
        num_pages: int,
        device: torch.device,
        max_pages_per_seq: int = 0,
        window: int | None = None,
        triton_decode: bool = False,
    ) -> FlexMetadata:
        """``num_pages``: pages in the cache tensor (the scratch page included);
        ``max_pages_per_seq``: pad the BlockMask index width to it (CUDA graphs need fixed
        shapes; 0: as wide as this step needs); ``window``: the layers' sliding window
        (None: full causal attention); ``triton_decode``: the decodes for the Triton
        kernel (``PagedDecode``, padded to ``max_pages_per_seq`` too), not a flex group."""
        starts = [0]
        for n in num_new[:-1]:
            starts.append(starts[-1] + n)
        slots: list[int] = []
        for table, c, n in zip(block_tables, num_computed, num_new, strict=True):
            slots.extend(
                table[p // block_size] * block_size + p % block_size for p in range(c, c + n)
            )
        compiled = device.type == "cuda"
        decode = [i for i, n in enumerate(num_new) if n == 1]
        prefill = [i for i, n in enumerate(num_new) if n > 1]
        paged = None
        if triton_decode and decode:
            paged = PagedDecode.build(
                [block_tables[i] for i in decode],
                [num_computed[i] for i in decode],
                [starts[i] for i in decode],
                block_size,
                device,
                width=max_pages_per_seq,
            )
            decode = []
        groups = []
        for members in (decode, prefill):
            if members:
                groups.append(
                    _build_group(
                        [block_tables[i] for i in members],
                        [num_computed[i] for i in members],
                        [num_new[i] for i in members],
                        [starts[i] for i in members],
                        block_size,
                        num_pages,
                        device,
                        max_pages_per_seq,
                        pad_queries=compiled,
                        window=window,
                    )
                )
        return cls(
            slot_mapping=torch.tensor(slots, dtype=torch.long).to(device),
            groups=groups,
            compiled=compiled,
            # one BlockMask KV block is one page; the kernel's KV tile must not span pages
            kernel_options={"BLOCK_N": block_size} if compiled else None,
            decode=paged,
            window=window,
        )


def _build_group(
    tables: list[list[int]],
    computed: list[int],
    new: list[int],
    starts: list[int],
    block_size: int,
    num_pages: int,
    device: torch.device,
    max_pages_per_seq: int,
    pad_queries: bool,
    window: int | None,
) -> FlexGroup:
    batch = len(new)
    lq = max(new)
    if pad_queries and lq > 1:
        # a few distinct shapes, so the compiled kernels are not rebuilt for every length
        lq = 1 << (lq - 1).bit_length()
    nq = -(-lq // Q_BLOCK)
    pages = [-(-(c + n) // block_size) for c, n in zip(computed, new, strict=True)]
    width = max(max_pages_per_seq, *pages)
    kv_num = torch.zeros(batch, 1, nq, dtype=torch.int32)
    kv_idx = torch.zeros(batch, 1, nq, width, dtype=torch.int32)
    full_num = torch.zeros(batch, 1, nq, dtype=torch.int32)
    full_idx = torch.zeros(batch, 1, nq, width, dtype=torch.int32)
    to_logical = torch.full((batch, num_pages), -1, dtype=torch.int32)
    for b, (table, c, n) in enumerate(zip(tables, computed, new, strict=True)):
        used = table[: -(-(c + n) // block_size)]
        to_logical[b, torch.tensor(used, dtype=torch.long)] = torch.arange(
            len(used), dtype=torch.int32
        )
        for j in range(nq):
            first = j * Q_BLOCK
            if first >= n:
                break  # query blocks of padding rows visit nothing
            p0 = c + first
            p1 = c + min(first + Q_BLOCK, n) - 1
            seen_lo, full_lo, full_hi, seen_hi = _page_spans(p0, p1, block_size, window)
            full_pages = table[full_lo:full_hi]
            partial_pages = table[seen_lo:full_lo] + table[full_hi:seen_hi]
            full_num[b, 0, j] = len(full_pages)
            full_idx[b, 0, j, : len(full_pages)] = torch.tensor(full_pages, dtype=torch.int32)
            kv_num[b, 0, j] = len(partial_pages)
            kv_idx[b, 0, j, : len(partial_pages)] = torch.tensor(partial_pages, dtype=torch.int32)
    i = torch.arange(lq)
    new_t = torch.tensor(new, dtype=torch.long)
    valid = i[None, :] < new_t[:, None]
    index = torch.where(valid, torch.tensor(starts)[:, None] + i[None, :], 0)
    q_start = torch.tensor(computed, dtype=torch.int32).to(device)
    to_logical = to_logical.to(device)
    mask_mod = _paged_causal(q_start, to_logical, block_size, window)
    kv_num, kv_idx, full_num, full_idx = (
        t.to(device) for t in (kv_num, kv_idx, full_num, full_idx)
    )
    mask = BlockMask.from_kv_blocks(
        kv_num,
        kv_idx,
        full_num,
        full_idx,
        BLOCK_SIZE=(Q_BLOCK, block_size),
        mask_mod=mask_mod,
        seq_lengths=(lq, num_pages * block_size),
        compute_q_blocks=False,
    )
    return FlexGroup(
        token_index=index.to(device),
        query_valid=valid.to(device),
        q_start=q_start,
        page_to_logical=to_logical,
        kv_num_blocks=kv_num,
        kv_indices=kv_idx,
        full_kv_num_blocks=full_num,
        full_kv_indices=full_idx,
        block_mask=mask,
        is_decode=lq == 1,
    )


def _page_spans(p0: int, p1: int, block_size: int, window: int | None) -> tuple[int, int, int, int]:
    """The logical pages queries at positions ``p0 .. p1`` see, ``seen_lo .. seen_hi - 1``,
    of which ``full_lo .. full_hi - 1`` (maybe none) have every slot seen by every query;
    ``seen_lo <= full_lo <= full_hi <= seen_hi``."""
    if window is None:
        return 0, 0, (p0 + 1) // block_size, p1 // block_size + 1
    seen_lo = max(0, p0 - window + 1) // block_size
    # every query sees positions max(0, p1 - window + 1) .. p0: the pages wholly inside
    full_lo = -(-max(0, p1 - window + 1) // block_size)
    full_hi = max(full_lo, (p0 + 1) // block_size)
    return seen_lo, full_lo, full_hi, p1 // block_size + 1


def _paged_causal(
    q_start: torch.Tensor, to_logical: torch.Tensor, block_size: int, window: int | None
) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:
    # The closure reads the tensors, not copies: a CUDA graph's static metadata is updated
    # in place and the captured kernels see the new values. The window is a constant.
    def mask_mod(
        b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor
    ) -> torch.Tensor:
        logical = to_logical[b, kv_idx // block_size]
        kv_pos = logical * block_size + kv_idx % block_size
        return (logical >= 0) & (kv_pos <= q_start[b] + q_idx)

    if window is None:
        return mask_mod
    size = window  # an int, for the closure

    def windowed_mask_mod(
        b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor
    ) -> torch.Tensor:
        logical = to_logical[b, kv_idx // block_size]
        kv_pos = logical * block_size + kv_idx % block_size
        q_pos = q_start[b] + q_idx
        return (logical >= 0) & (kv_pos <= q_pos) & (kv_pos > q_pos - size)

    return windowed_mask_mod


def _dynamo_config() -> Any:
    return torch._dynamo.config


def _flex() -> Callable[..., Any]:
    global _compiled
    if _compiled is None:
        # torch.compile's typed overloads lag its signature, which has recompile_limit
        compile_: Callable[..., Any] = torch.compile
        if "recompile_limit" in inspect.signature(torch.compile).parameters:
            _compiled = compile_(
                flex_attention, fullgraph=True, recompile_limit=FLEX_RECOMPILE_LIMIT
            )
        else:  # torch < 2.13: only dynamo's global limit (never lowered here)
            config = _dynamo_config()
            name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
            setattr(config, name, max(getattr(config, name), FLEX_RECOMPILE_LIMIT))
            _compiled = compile_(flex_attention, fullgraph=True)
    return _compiled


def flex_paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: FlexMetadata,
    scale: float | None = None,
) -> torch.Tensor:
    """Same contract as ``paged_attention``: ``q`` [T, H, D], ``k``/``v`` [T, Hkv, D];
    caches [pages, block_size, Hkv, D]. Returns [T, H, D]. No soft-capping: the model
    runner does not pick this backend for a model that has it (the Triton decode kernel
    has it, its prefills through flex not)."""
    num_kv_heads, head_dim = k.shape[1], k.shape[2]
    k_flat = k_cache.view(-1, num_kv_heads, head_dim)
    v_flat = v_cache.view(-1, num_kv_heads, head_dim)
    k_flat.index_copy_(0, meta.slot_mapping, k.to(k_flat.dtype))
    v_flat.index_copy_(0, meta.slot_mapping, v.to(v_flat.dtype))
    # [1, Hkv, slots, D] views of the whole cache; batch 1 broadcasts over the queries
    keys = k_flat.permute(1, 0, 2).unsqueeze(0)
    values = v_flat.permute(1, 0, 2).unsqueeze(0)
    attend = _flex() if meta.compiled else cast("Callable[..., Any]", flex_attention)
    out = torch.empty_like(q)
    if meta.decode is not None:
        from kiln.llm.kernels.decode_attention import decode_attention  # imports triton

        decode_attention(q, k_cache, v_cache, meta.decode, out, scale, window=meta.window)
    for g in meta.groups:
        queries = q[g.token_index].transpose(1, 2)  # [B, H, Lq, D]
        o = attend(
            queries,
            keys,
            values,
            block_mask=g.block_mask,
            scale=scale,
            enable_gqa=True,
            kernel_options=meta.kernel_options,
        ).transpose(1, 2)  # [B, Lq, H, D]
        if g.is_decode:
            out[g.token_index[:, 0]] = o[:, 0]
        else:
            out[g.token_index[g.query_valid]] = o[g.query_valid]
    return out
