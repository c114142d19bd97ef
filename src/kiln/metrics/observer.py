"""Distributions per model version: kept by the runtime's stats, exposed at scrape time.

One ``RuntimeMetrics`` is bound to each ``ModelStats`` when the runtime is created, so a
request pays a bisect and two additions (plus a few list appends when summaries are on):
no label lookups, no locks of its own (``ModelStats`` already holds one around the call).
Labels are attached at scrape time from the runtime, and an unloaded version's series
disappear with it, as in Triton.
"""

from __future__ import annotations

import math
import random
from bisect import bisect_left

from kiln.core.stats import RequestTimes
from kiln.metrics.config import MetricsConfig


class Histogram:
    """Fixed upper bounds (``le``), one count per bucket plus ``+Inf``, and a sum."""

    __slots__ = ("bounds", "counts", "total")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.total = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
        self.total += value

    def cumulative(self) -> list[tuple[str, float]]:
        """Prometheus buckets: ``(le, observations <= le)``, ending with ``+Inf``."""
        out: list[tuple[str, float]] = []
        running = 0
        for bound, count in zip(self.bounds, self.counts, strict=False):
            running += count
            out.append((_le(bound), running))
        out.append(("+Inf", running + self.counts[-1]))
        return out

    @property
    def count(self) -> int:
        return sum(self.counts)


def _le(bound: float) -> str:
    return str(int(bound)) if bound == int(bound) and bound >= 1 else repr(bound)


class SlidingQuantiles:
    """Quantiles over the last ``max_age_s`` seconds, like a Prometheus summary.

    The window is split into ``age_buckets`` slots that expire one at a time (the same
    shape as Triton's summaries: 60 s, 5 slots). Quantiles are exact over the kept
    samples, so any requested error bound holds; a slot keeps at most ``capacity``
    samples (a uniform reservoir beyond that) to bound memory under heavy load.
    """

    __slots__ = ("_epochs", "_samples", "_seen", "capacity", "count", "slot_ns", "total")

    def __init__(self, max_age_s: float = 60.0, age_buckets: int = 5, capacity: int = 4096) -> None:
        self.slot_ns = int(max_age_s * 1e9 / age_buckets)
        self.capacity = capacity
        self._epochs = [-1] * age_buckets
        self._samples: list[list[float]] = [[] for _ in range(age_buckets)]
        self._seen = [0] * age_buckets
        self.count = 0  # _count and _sum are cumulative, as in Prometheus
        self.total = 0.0

    def observe(self, value: float, now_ns: int) -> None:
        self.count += 1
        self.total += value
        epoch = now_ns // self.slot_ns
        slot = epoch % len(self._epochs)
        if self._epochs[slot] != epoch:
            self._epochs[slot] = epoch
            self._samples[slot] = []
            self._seen[slot] = 0
        self._seen[slot] += 1
        samples = self._samples[slot]
        if len(samples) < self.capacity:
            samples.append(value)
        else:
            j = random.randrange(self._seen[slot])
            if j < self.capacity:
                samples[j] = value

    def quantiles(self, qs: list[float], now_ns: int) -> list[float]:
        """Nearest-rank quantiles over the live window; NaN when it holds no sample."""
        oldest = now_ns // self.slot_ns - len(self._epochs) + 1
        window = sorted(
            v
            for epoch, samples in zip(self._epochs, list(self._samples), strict=True)
            if epoch >= oldest
            for v in samples
        )
        if not window:
            return [math.nan for _ in qs]
        n = len(window)
        return [window[min(n - 1, max(0, math.ceil(q * n) - 1))] for q in qs]


# Triton's summary families, in microseconds, keyed by the phase they time.
SUMMARY_PHASES = ("request", "queue", "compute_input", "compute_infer", "compute_output")


class RuntimeMetrics:
    """The ``RequestObserver`` kiln binds to every runtime's ``ModelStats``."""

    __slots__ = ("first_response", "latency", "summaries")

    def __init__(self, config: MetricsConfig) -> None:
        self.latency = Histogram(config.latency_buckets)
        self.first_response = (
            Histogram(config.first_response_buckets_ms) if config.histogram_latencies else None
        )
        self.summaries = (
            {phase: SlidingQuantiles() for phase in SUMMARY_PHASES}
            if config.summary_latencies
            else None
        )

    def observe_success(self, times: RequestTimes, batch_size: int, end_ns: int) -> None:
        duration_ns = end_ns - times.received
        self.latency.observe(duration_ns * 1e-9)
        if self.first_response is not None:
            # A non-decoupled model's only response is its first one.
            self.first_response.observe(duration_ns * 1e-6)
        if self.summaries is not None:
            s = self.summaries
            s["request"].observe(duration_ns / 1000, end_ns)
            s["queue"].observe((times.queue_end - times.received) / 1000, end_ns)
            s["compute_input"].observe((times.input_end - times.queue_end) / 1000, end_ns)
            s["compute_infer"].observe((times.infer_end - times.input_end) / 1000, end_ns)
            s["compute_output"].observe((times.output_end - times.infer_end) / 1000, end_ns)
