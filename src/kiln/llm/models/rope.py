"""Rotary position embeddings, with the scaling schemes Llama-family configs use."""

from __future__ import annotations

import math
from typing import Any

import torch

from kiln.core.errors import KilnError, Status


def inverse_frequencies(
    head_dim: int, theta: float, scaling: dict[str, Any] | None
) -> torch.Tensor:
    # explicit CPU: a model built under `torch.device("meta")` still needs real numbers
    steps = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float()
    inv_freq = 1.0 / (theta ** (steps / head_dim))
    if not scaling:
        return inv_freq
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "linear":
        return inv_freq / float(scaling["factor"])
    if kind == "llama3":
        return _llama3(inv_freq, scaling)
    raise KilnError(
        f"llm backend: rope scaling '{kind}' is not supported (default, linear, llama3)",
        Status.INVALID_ARG,
    )


def _llama3(inv_freq: torch.Tensor, s: dict[str, Any]) -> torch.Tensor:
    # Llama 3.1: keep high frequencies, divide low ones by `factor`, blend in between.
    factor = float(s["factor"])
    low, high = float(s["low_freq_factor"]), float(s["high_freq_factor"])
    old_len = float(s["original_max_position_embeddings"])
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


def longrope_frequencies(
    dim: int, theta: float, scaling: dict[str, Any], max_position_embeddings: int
) -> tuple[torch.Tensor, torch.Tensor, float, int]:
    """Phi-3's LongRoPE (``rope_type`` longrope, formerly su): the short and the long
    factors' inverse frequencies over the ``dim`` rotated channels, the cos/sin scale
    (``attention_factor``, by default sqrt(1 + ln(factor) / ln(original length)), factor
    being max_position_embeddings / original_max_position_embeddings), and the original
    length, past which transformers switches to the long factors."""
    original = int(scaling["original_max_position_embeddings"])
    factor = scaling.get("factor")
    if factor is None:
        factor = max_position_embeddings / original
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        attention_factor = (
            1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
        )
    steps = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim
    base = theta**steps
    short = 1.0 / (torch.tensor(scaling["short_factor"], dtype=torch.float32, device="cpu") * base)
    long = 1.0 / (torch.tensor(scaling["long_factor"], dtype=torch.float32, device="cpu") * base)
    return short, long, float(attention_factor), original


class RotaryEmbedding(torch.nn.Module):
    """cos/sin tables for every position up to ``max_positions``, looked up per token."""

    def __init__(
        self, head_dim: int, max_positions: int, theta: float, scaling: dict[str, Any] | None
    ) -> None:
        super().__init__()
        self.inv_freq = self.frequencies(head_dim, theta, scaling)
        self.max_positions = max_positions
        self.cos: torch.Tensor
        self.sin: torch.Tensor
        self.register_buffer("cos", torch.empty(0), persistent=False)
        self.register_buffer("sin", torch.empty(0), persistent=False)
        self.rebuild(torch.device("cpu"))

    def frequencies(
        self, head_dim: int, theta: float, scaling: dict[str, Any] | None
    ) -> torch.Tensor:
        return inverse_frequencies(head_dim, theta, scaling)

    def rebuild(self, device: torch.device) -> None:
        """Compute the tables on ``device`` (they are not weights: a model built on the meta
        device gets them here)."""
        positions = torch.arange(self.max_positions, dtype=torch.float32, device="cpu")
        freqs = torch.outer(positions, self.inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1).to(device)
        self.cos = emb.cos()
        self.sin = emb.sin()

    def lookup(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and *signed* sin ``[T, 1, D]`` of the step's tokens, looked up once per step
        for every layer. The sin's first half is negated so that ``rotate`` needs no
        negation of its own: ``-x2 * s == x2 * -s`` exactly, so the result is bit for bit
        the rotate-half formula's."""
        cos = self.cos[positions].unsqueeze(1).to(dtype)
        sin = self.sin[positions].unsqueeze(1).to(dtype)
        half = sin.shape[-1] // 2
        sin[..., :half].neg_()
        return cos, sin


class LongRopeEmbedding(RotaryEmbedding):
    """LongRoPE tables: a position below the original length rotates by the short factors,
    one at or past it by the long ones, both scaled by the attention factor. transformers
    picks one set per forward call from the longest position in it, so the two agree on
    every decode step and on every prompt that ends on the same side of the original
    length; a prompt crossing it gets the long factors for all its tokens there, the short
    ones for those before it here (vLLM switches the whole batch instead)."""

    def __init__(self, dim: int, max_positions: int, theta: float, scaling: dict[str, Any],
                 max_position_embeddings: int) -> None:  # fmt: skip
        self.longrope = longrope_frequencies(dim, theta, scaling, max_position_embeddings)
        super().__init__(dim, max_positions, theta, None)

    def frequencies(
        self, head_dim: int, theta: float, scaling: dict[str, Any] | None
    ) -> torch.Tensor:
        return self.longrope[0]

    def rebuild(self, device: torch.device) -> None:
        short, long, attention_factor, original = self.longrope
        positions = torch.arange(self.max_positions, dtype=torch.float32, device="cpu")
        tables = []
        for inv_freq in (short, long):
            freqs = torch.outer(positions, inv_freq)
            tables.append(torch.cat((freqs, freqs), dim=-1))
        use_long = (positions >= original)[:, None]
        emb = torch.where(use_long, tables[1], tables[0]).to(device)
        self.cos = emb.cos() * attention_factor
        self.sin = emb.sin() * attention_factor


def rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """``x`` [T, heads, D] rotated by its tokens' positions (``RotaryEmbedding.lookup``);
    rotate-half layout, as HF checkpoints store."""
    half = x.shape[-1] // 2
    swapped = torch.cat((x[..., half:], x[..., :half]), dim=-1)
    # not addcmul: its fused multiply-add rounds differently from transformers' formula
    out = x * cos
    out += swapped.mul_(signed_sin)
    return out
