"""A shadow version's record: the copies sent to it, and how its answers agree with the
primary's (tensors: exact, top-1 and the largest difference; LLM generations: tokens)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from kiln.core.types import InferenceResponse


@dataclass(slots=True)
class ShadowStats:
    sent: int = 0
    dropped: int = 0
    errors: int = 0
    compared: int = 0
    exact: int = 0
    top1: int = 0
    top1_compared: int = 0
    max_abs_diff: float = 0.0  # the largest seen
    latency_delta_sum: float = 0.0  # shadow - primary, seconds
    # LLM generations: output positions compared, and those holding the same token
    token_positions: int = 0
    token_agree: int = 0

    def to_json(self) -> dict[str, Any]:
        return {
            "sent": self.sent,
            "dropped": self.dropped,
            "errors": self.errors,
            "compared": self.compared,
            "exact_agreement": self.exact / self.compared if self.compared else None,
            "top1_agreement": self.top1 / self.top1_compared if self.top1_compared else None,
            "max_abs_diff": self.max_abs_diff,
            "token_agreement": (
                self.token_agree / self.token_positions if self.token_positions else None
            ),
            "mean_latency_delta_s": (
                self.latency_delta_sum / self.compared if self.compared else None
            ),
        }


@dataclass(frozen=True, slots=True)
class LLMShadowJob:
    """A generation to repeat on the shadow version, and what the primary produced."""

    prompt: list[int]
    params: Any  # kiln.llm.sequence.SamplingParams (the llm layer sits beside this one)
    tokens: dict[int, list[int]]  # each sample's output token ids
    secs: float


def compare_outputs(
    primary: InferenceResponse, shadow: InferenceResponse, stats: ShadowStats
) -> None:
    """Exact agreement (every output equal), top-1 (argmax of the last axis, numeric
    outputs) and the largest absolute difference."""
    theirs = {o.name: o.data for o in shadow.outputs}
    exact = set(theirs) == {o.name for o in primary.outputs}
    top1: bool | None = None
    for out in primary.outputs:
        other = theirs.get(out.name)
        if other is None or other.shape != out.data.shape:
            exact = False
            continue
        if out.data.dtype.kind in "biuf" and other.dtype.kind in "biuf":
            a, b = out.data.astype(np.float64), other.astype(np.float64)
            diff = float(np.max(np.abs(a - b))) if a.size else 0.0
            stats.max_abs_diff = max(stats.max_abs_diff, diff)
            exact = exact and diff == 0
            if a.ndim and a.shape[-1] > 1:
                same = bool(np.array_equal(a.argmax(axis=-1), b.argmax(axis=-1)))
                top1 = same if top1 is None else top1 and same
        else:
            exact = exact and bool(np.array_equal(out.data, other))
    stats.exact += exact
    if top1 is not None:
        stats.top1_compared += 1
        stats.top1 += top1


def compare_tokens(
    primary: dict[int, list[int]], shadow: dict[int, list[int]], stats: ShadowStats
) -> None:
    """Exact agreement (every sample's tokens equal) and token agreement: positions, up
    to the longer of the two outputs, that hold the same token (meaningful for greedy or
    seeded requests; a sampled request's copy draws its own tokens)."""
    exact = set(primary) == set(shadow)
    for index, ours in primary.items():
        theirs = shadow.get(index, [])
        same = sum(1 for a, b in zip(ours, theirs, strict=False) if a == b)
        stats.token_positions += max(len(ours), len(theirs))
        stats.token_agree += same
        exact = exact and ours == theirs
    stats.exact += exact


__all__ = [
    "LLMShadowJob",
    "ShadowStats",
    "compare_outputs",
    "compare_tokens",
]
