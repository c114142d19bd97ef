"""Per-request timings of ``kiln bench --openai`` and their summary (vLLM's definitions).

- TTFT: from sending the request to the first chunk that carries text.
- TPOT per request: ``(latency - ttft) / (output_tokens - 1)``, requests with > 1 token.
- ITL: every gap between text chunks, pooled over requests (a chunk may hold several
  tokens when the server coalesces them, so ITL and TPOT can differ).
- E2E: the whole request.
Throughputs divide by the run's wall time, from the first send to the last completion.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

METRICS = ("ttft", "tpot", "itl", "e2el")


@dataclass(slots=True)
class RequestResult:
    """One request as the client saw it; times in seconds from ``time.perf_counter``."""

    index: int
    start: float
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    output_tokens: int = 0
    chunks: int = 0  # streamed chunks that carried text
    usage: bool = False  # token counts came from the server's usage
    finish_reason: str | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def tpot(self) -> float | None:
        if self.output_tokens <= 1:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)


def describe(values_s: Sequence[float]) -> dict[str, float]:
    """Mean, median and p99 in milliseconds (numpy's linear percentiles, as vLLM reports)."""
    if not values_s:
        return {"mean": 0.0, "p50": 0.0, "p99": 0.0}
    ms = np.asarray(values_s, dtype=np.float64) * 1e3
    return {
        "mean": float(ms.mean()),
        "p50": float(np.percentile(ms, 50)),
        "p99": float(np.percentile(ms, 99)),
    }


@dataclass(slots=True)
class LLMBenchResult:
    """A run's summary; ``to_json`` is the ``--json`` report."""

    url: str
    model: str
    endpoint: str
    started: str
    duration_s: float
    settings: dict[str, Any]
    results: list[RequestResult]
    warmup: RequestResult | None = None
    completed: int = 0
    failed: int = 0
    total_input_tokens: int = 0
    total_output_tokens: int = 0
    latency_ms: dict[str, dict[str, float]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        done = [r for r in self.results if r.ok]
        self.completed = len(done)
        self.failed = len(self.results) - len(done)
        self.total_input_tokens = sum(r.prompt_tokens for r in done)
        self.total_output_tokens = sum(r.output_tokens for r in done)
        tpots = [t for r in done if (t := r.tpot) is not None]
        self.latency_ms = {
            "ttft": describe([r.ttft for r in done]),
            "tpot": describe(tpots),
            "itl": describe([gap for r in done for gap in r.itl]),
            "e2el": describe([r.latency for r in done]),
        }

    def _per_s(self, amount: float) -> float:
        return amount / self.duration_s if self.duration_s > 0 else 0.0

    @property
    def request_throughput(self) -> float:
        return self._per_s(self.completed)

    @property
    def output_throughput(self) -> float:
        return self._per_s(self.total_output_tokens)

    @property
    def total_token_throughput(self) -> float:
        return self._per_s(self.total_input_tokens + self.total_output_tokens)

    @property
    def errors(self) -> dict[str, int]:
        """Failure messages and how often each happened."""
        out: dict[str, int] = {}
        for r in self.results:
            if r.error is not None:
                out[r.error] = out.get(r.error, 0) + 1
        return out

    def to_json(self) -> dict[str, Any]:
        return {
            "url": self.url,
            "model": self.model,
            "endpoint": self.endpoint,
            "started": self.started,
            "settings": self.settings,
            "duration_s": self.duration_s,
            "completed": self.completed,
            "failed": self.failed,
            "total_input_tokens": self.total_input_tokens,
            "total_output_tokens": self.total_output_tokens,
            "request_throughput": self.request_throughput,
            "output_throughput": self.output_throughput,
            "total_token_throughput": self.total_token_throughput,
            **{f"{m}_ms": self.latency_ms[m] for m in METRICS},
            "errors": self.errors,
            "warmup": None if self.warmup is None else request_json(self.warmup),
            "requests": [request_json(r) for r in self.results],
        }


def request_json(r: RequestResult) -> dict[str, Any]:
    return {
        "index": r.index,
        "prompt_tokens": r.prompt_tokens,
        "output_tokens": r.output_tokens,
        "ttft_ms": r.ttft * 1e3,
        "tpot_ms": None if r.tpot is None else r.tpot * 1e3,
        "e2el_ms": r.latency * 1e3,
        "chunks": r.chunks,
        "usage": r.usage,
        "finish_reason": r.finish_reason,
        "error": r.error,
    }
