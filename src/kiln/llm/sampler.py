"""Pick the next token per sequence: greedy, or temperature / top-k / top-p sampling with a
per-request generator, so a request with a ``seed`` gets the same tokens whatever else
shares its batch."""

from __future__ import annotations

import torch

from kiln.llm.sequence import SamplingParams


def sample(
    logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]
) -> list[int]:
    """``logits`` [B, vocab] (one row per sequence that samples this step)."""
    greedy = logits.argmax(dim=-1).tolist()
    tokens: list[int] = []
    for row, p, gen, best in zip(logits, params, generators, greedy, strict=True):
        if p.temperature == 0.0:
            tokens.append(int(best))
            continue
        probs = _filtered_probs(row.float() / p.temperature, p.top_k, p.top_p)
        # multinomial draws on the CPU: a CPU generator works for any device's logits
        choice = torch.multinomial(probs.cpu(), 1, generator=gen)
        tokens.append(int(choice.item()))
    return tokens


def _filtered_probs(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        # keep the smallest set whose mass reaches top_p (the top token always stays)
        before = torch.cumsum(sorted_probs, 0) - sorted_probs
        sorted_probs = sorted_probs.masked_fill(before >= top_p, 0.0)
        probs = torch.zeros_like(probs).scatter(0, order, sorted_probs)
        probs = probs / probs.sum()
    return probs
