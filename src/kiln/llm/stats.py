"""Latency distributions the engine records and ``/metrics`` exposes (vLLM's names and
buckets, so dashboards written for vLLM read kiln's histograms as they are).

The engine thread observes; the metrics thread reads at scrape time. Each histogram takes a
lock for both, so a scrape never sees a count that disagrees with its buckets. Importing
this module does not import torch.
"""

from __future__ import annotations

import bisect
import threading
from dataclasses import dataclass, field

#: vLLM's ``time_to_first_token_seconds`` buckets
TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
#: vLLM's ``inter_token_latency_seconds`` buckets
ITL_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
#: vLLM's buckets for whole-request intervals (e2e, queue)
REQUEST_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
    60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip


@dataclass(slots=True)
class Histogram:
    """Prometheus-style: per-bucket counts (non-cumulative here), sum and count."""

    buckets: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    count: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        self.counts = [0] * (len(self.buckets) + 1)  # the last one is +Inf

    def observe(self, value: float) -> None:
        with self.lock:
            # ``le`` is inclusive: a value equal to a bound belongs to that bucket
            self.counts[bisect.bisect_left(self.buckets, value)] += 1
            self.total += value
            self.count += 1

    def snapshot(self) -> tuple[list[tuple[str, float]], float]:
        """Cumulative ``(le, count)`` pairs ending with ``+Inf``, and the sum."""
        with self.lock:
            counts, total = list(self.counts), self.total
        out: list[tuple[str, float]] = []
        running = 0
        for bound, n in zip((*(str(b) for b in self.buckets), "+Inf"), counts, strict=True):
            running += n
            out.append((bound, float(running)))
        return out, total


@dataclass(slots=True)
class LatencyStats:
    """One engine's request-latency histograms."""

    time_to_first_token: Histogram = field(default_factory=lambda: Histogram(TTFT_BUCKETS))
    inter_token_latency: Histogram = field(default_factory=lambda: Histogram(ITL_BUCKETS))
    e2e_request_latency: Histogram = field(default_factory=lambda: Histogram(REQUEST_BUCKETS))
    request_queue_time: Histogram = field(default_factory=lambda: Histogram(REQUEST_BUCKETS))
