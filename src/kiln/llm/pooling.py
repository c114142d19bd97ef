"""Pooling a decoder's final hidden states into one vector per input, as vLLM's pooling
runner does for an embedding model (``--runner pooling``, its default pooler for a
converted decoder: ``LAST`` token, L2-normalized).

The forward pass is the model's own over each input alone, causally (``attention.
DenseMetadata``): it reads and writes no KV block, so it never competes with generation for
the cache. The hidden states are the final norm's output, what ``transformers``' base model
(``AutoModel``) returns as ``last_hidden_state``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def token_rows(lengths: list[int], pooling_type: str) -> torch.Tensor | None:
    """The flat token each input is pooled from (``LAST``: its last, ``CLS``: its first);
    None for ``MEAN`` and ``ALL`` (every token's state, vLLM's ``token_embed``), which read
    them all."""
    if pooling_type in ("MEAN", "ALL"):
        return None
    counts = torch.tensor(lengths)
    ends = counts.cumsum(0)
    return ends - 1 if pooling_type == "LAST" else ends - counts


def mean_pool(hidden: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    """``hidden`` [sum(lengths), H]: the inputs' final states, flattened in order; returns
    each input's average [len(lengths), H], in float32 (vLLM pools in float32)."""
    counts = torch.tensor(lengths, device=hidden.device)
    rows = torch.repeat_interleave(torch.arange(len(lengths), device=hidden.device), counts)
    sums = hidden.new_zeros(len(lengths), hidden.shape[1], dtype=torch.float32)
    sums.index_add_(0, rows, hidden.float())
    return sums / counts[:, None].float()


def finish(pooled: torch.Tensor, dimensions: int | None, normalize: bool) -> torch.Tensor:
    """vLLM's embedding head: a matryoshka model's vectors cut to ``dimensions`` first,
    then L2-normalized."""
    if dimensions is not None:
        pooled = pooled[..., :dimensions]
    if normalize:
        pooled = F.normalize(pooled, p=2, dim=-1)
    return pooled
