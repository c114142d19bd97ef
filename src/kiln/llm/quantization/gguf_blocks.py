"""GGUF's 4-bit blocks -> the packed int4 kernel's form, exactly: ``q`` [N, K] (0..15) and
per group of 32 a ``scale`` and an ``offset`` [K/32, N], the weight being
``(q - 8) * scale + offset`` (llama.cpp's ggml-quants.c defines the blocks).

- Q4_0, 18 bytes a 32 values: f16 ``d``, 16 bytes of nibbles (low: values 0-15, high:
  16-31); ``w = d * (q - 8)``.
- Q4_1, 20 bytes: f16 ``d``, f16 ``m``, the same nibbles; ``w = d * q + m``.
- Q4_K, 144 bytes a 256 values: f16 ``d``, f16 ``dmin``, 12 bytes holding eight 6-bit
  scales and mins, 128 bytes of nibbles (each 32 bytes: low nibbles one sub-block, high
  the next); ``w = d * sc * q - dmin * m`` per sub-block of 32.
"""

from __future__ import annotations

import torch

#: GGML type name -> (values a block, bytes a block)
BLOCKS = {"Q4_0": (32, 18), "Q4_1": (32, 20), "Q4_K": (256, 144)}


def _f16(raw: torch.Tensor) -> torch.Tensor:
    """[..., 2] bytes -> [...] float32 (little-endian f16)."""
    return raw.contiguous().view(torch.float16).squeeze(-1).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[..., 16 or 32] bytes -> [..., 32 or 64] values: the low nibbles, then the high."""
    return torch.cat([qs & 0xF, qs >> 4], dim=-1)


def _k4_scales(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K's 12 bytes -> eight 6-bit scales and eight mins (ggml's get_scale_min_k4)."""
    s = s.long()
    low_sc, low_m = s[..., 0:4] & 63, s[..., 4:8] & 63
    high_sc = (s[..., 8:12] & 0xF) | ((s[..., 0:4] >> 6) << 4)
    high_m = (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)
    return torch.cat([low_sc, high_sc], -1).float(), torch.cat([low_m, high_m], -1).float()


def to_int4(
    raw: torch.Tensor, kind: str, k: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[N, row bytes] uint8 of ``kind`` -> q [N, K] uint8, scale and offset [K/32, N]."""
    values, size = BLOCKS[kind]
    n = raw.shape[0]
    blocks = raw.reshape(n, k // values, size)
    if kind == "Q4_K":
        d, dmin = _f16(blocks[..., 0:2]), _f16(blocks[..., 2:4])
        sc, m = _k4_scales(blocks[..., 4:16])  # [N, B, 8]
        qs = blocks[..., 16:].reshape(n, k // values, 4, 32)
        q = _nibbles(qs).reshape(n, k)
        scale = (d.unsqueeze(-1) * sc).reshape(n, -1)
        offset = 8 * scale - (dmin.unsqueeze(-1) * m).reshape(n, -1)
    else:
        d = _f16(blocks[..., 0:2])
        start = 2 if kind == "Q4_0" else 4
        q = _nibbles(blocks[..., start:]).reshape(n, k)
        scale = d
        offset = torch.zeros_like(d) if kind == "Q4_0" else 8 * d + _f16(blocks[..., 2:4])
    return q, scale.t().contiguous(), offset.t().contiguous()
