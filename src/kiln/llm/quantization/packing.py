"""The hub's int4 layouts -> one form: ``q`` [N, K] (0..15), ``scale`` and ``zero`` [G, N]
(float32), the weight being ``(q - zero[g]) * scale[g]`` for row ``k`` of group ``g``.

AWQ (AutoAWQ's GEMM layout): ``qweight`` [K, N/8] int32, eight output columns a word in
the order 0, 2, 4, 6, 1, 3, 5, 7; ``qzeros`` [K/G, N/8] packed the same way.
GPTQ: ``qweight`` [K/8, N] int32, eight input rows a word in order; ``qzeros`` [G, N/8]
int32, eight columns a word in order, each stored minus one in the legacy ``gptq`` format;
``g_idx`` [K]: each input row's group (act-order permutes them).
"""

from __future__ import annotations

import torch

#: AWQ's nibble order: nibble i of a word holds column AWQ_ORDER[i] of its eight
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
_SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)


def _nibbles(packed: torch.Tensor) -> torch.Tensor:
    """[..., W] int32 -> [..., W, 8]: nibble i (bits 4i..4i+3) of each word."""
    return (packed.unsqueeze(-1) >> _SHIFTS.to(packed.device)) & 0xF


def unpack_columns(packed: torch.Tensor, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """[R, N/8] int32 -> [R, N]: eight columns a word (``order``: AWQ's interleaving)."""
    nib = _nibbles(packed)
    if order is not None:
        # column j of a word sits in the nibble that holds it
        nib = nib[..., [order.index(j) for j in range(8)]]
    return nib.reshape(packed.shape[0], -1).to(torch.uint8)


def unpack_rows(packed: torch.Tensor) -> torch.Tensor:
    """[K/8, N] int32 -> [K, N]: eight rows a word, in order (GPTQ's qweight)."""
    nib = _nibbles(packed)  # [K/8, N, 8]
    return nib.permute(0, 2, 1).reshape(-1, packed.shape[1]).to(torch.uint8)


def awq_to_int4(
    qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    q = unpack_columns(qweight, AWQ_ORDER).t().contiguous()  # [N, K]
    zero = unpack_columns(qzeros, AWQ_ORDER).float()
    return q, scales.float(), zero


def gptq_to_int4(
    qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, zero_offset: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    q = unpack_rows(qweight).t().contiguous()  # [N, K]
    # the legacy format stores (zero - 1) mod 16: a stored 15 is zero 0
    zero = (unpack_columns(qzeros).float() + zero_offset).remainder(16)
    return q, scales.float(), zero
