"""vLLM's sleep-mode operation metrics (``vllm:sleep_mode_operation_duration_seconds``,
``vllm:sleep_mode_operations_in_flight``, label ``operation``: ``sleep``,
``release_kv_cache_memory``, ``wake``), kept per server process as vLLM keeps them per API
server, and exported once an operation has run (vLLM creates them at the first one).
Torch-free."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

from prometheus_client.core import GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from kiln.llm.stats import Histogram

OPERATIONS = ("sleep", "release_kv_cache_memory", "wake")
BUCKETS = (0.01, 0.1, 1, 10, 30, 60, 120, 300, 600)


class SleepOperations:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.durations: dict[str, Histogram] = {}
        self.in_flight: dict[str, int] = {}

    @contextmanager
    def record(self, operation: str) -> Iterator[None]:
        with self._lock:
            self.in_flight[operation] = self.in_flight.get(operation, 0) + 1
            hist = self.durations.setdefault(operation, Histogram(BUCKETS))
        started = time.perf_counter()
        try:
            yield
        finally:
            with self._lock:
                self.in_flight[operation] -= 1
            hist.observe(time.perf_counter() - started)


#: the server's (vLLM: one per API server process)
OPERATIONS_METRICS = SleepOperations()


class SleepModeCollector(Collector):
    def __init__(self, source: SleepOperations = OPERATIONS_METRICS) -> None:
        self.source = source

    def collect(self) -> Iterator[Metric]:
        source = self.source
        with source._lock:
            durations = dict(source.durations)
            in_flight = dict(source.in_flight)
        if not durations:
            return
        duration = HistogramMetricFamily(
            "vllm:sleep_mode_operation_duration_seconds",
            "Duration of one sleep-mode operation.",
            labels=("operation",),
        )
        for op, hist in sorted(durations.items()):
            buckets, total = hist.snapshot()
            duration.add_metric([op], buckets, total)
        gauge = GaugeMetricFamily(
            "vllm:sleep_mode_operations_in_flight",
            "Sleep-mode operations currently awaited.",
            labels=("operation",),
        )
        for op, count in sorted(in_flight.items()):
            gauge.add_metric([op], count)
        yield duration
        yield gauge
