"""Triton-named per-model families, read from the runtimes' statistics at scrape time.

Nothing is counted twice: the statistics extension and /metrics read the same counters,
and the hot path pays for them once. Distributions come from the ``RuntimeMetrics``
bound to each runtime's stats (see ``observer.py``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator

from prometheus_client.core import GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from kiln.core.stats import FailureReason
from kiln.metrics import names
from kiln.metrics.config import MetricsConfig
from kiln.metrics.exposition import counter
from kiln.metrics.observer import SUMMARY_PHASES, Histogram, RuntimeMetrics
from kiln.server.runtime import ModelRuntime

LABELS = ("model", "version")
# Upper bounds of kiln_batch_size: powers of two cover every preferred_batch_size layout.
BATCH_BOUNDS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)

_DURATIONS = (
    (
        names.INFERENCE_REQUEST_DURATION_US,
        "success",
        "Cumulative inference request duration in microseconds (successful requests)",
    ),
    (
        names.INFERENCE_QUEUE_DURATION_US,
        "queue",
        "Cumulative inference queuing duration in microseconds",
    ),
    (
        names.INFERENCE_COMPUTE_INPUT_DURATION_US,
        "compute_input",
        "Cumulative compute input duration in microseconds",
    ),
    (
        names.INFERENCE_COMPUTE_INFER_DURATION_US,
        "compute_infer",
        "Cumulative compute inference duration in microseconds",
    ),
    (
        names.INFERENCE_COMPUTE_OUTPUT_DURATION_US,
        "compute_output",
        "Cumulative inference compute output duration in microseconds",
    ),
)
_SUMMARY_HELP = {
    "request": "Summary of inference request duration in microseconds",
    "queue": "Summary of inference queuing duration in microseconds",
    "compute_input": "Summary of compute input duration in microseconds",
    "compute_infer": "Summary of compute inference duration in microseconds",
    "compute_output": "Summary of inference compute output duration in microseconds",
}


class ServerCollector(Collector):
    def __init__(
        self, runtimes: Callable[[], Iterable[ModelRuntime]], config: MetricsConfig
    ) -> None:
        self.runtimes = runtimes
        self.config = config

    def collect(self) -> Iterator[Metric]:
        runtimes = list(self.runtimes())
        yield from self._counts(runtimes)
        if self.config.counter_latencies:
            yield from self._durations(runtimes)
        yield from self._cache(runtimes)
        yield from self._gauges(runtimes)
        yield from self._distributions(runtimes)

    def _counts(self, runtimes: list[ModelRuntime]) -> Iterator[Metric]:
        success = counter(
            names.INFERENCE_REQUEST_SUCCESS,
            "Number of successful inference requests, all batch sizes",
        )
        failure = counter(
            names.INFERENCE_REQUEST_FAILURE, "Number of failed inference requests, all batch sizes"
        )
        count = counter(
            names.INFERENCE_COUNT,
            "Number of inferences performed (does not include cached requests)",
        )
        execs = counter(
            names.INFERENCE_EXEC_COUNT,
            "Number of model executions performed (does not include cached requests)",
        )
        for rt in runtimes:
            lv = _labels(rt)
            s = rt.stats
            success.add_sample(success.name, lv, s.success.count)
            for reason in FailureReason:
                failure.add_sample(
                    failure.name, {**lv, "reason": reason.value}, s.fail_reasons[reason]
                )
            count.add_sample(count.name, lv, s.inference_count)
            execs.add_sample(execs.name, lv, s.execution_count)
        yield from (success, failure, count, execs)

    def _durations(self, runtimes: list[ModelRuntime]) -> Iterator[Metric]:
        for name, attr, doc in _DURATIONS:
            family = counter(name, doc)
            for rt in runtimes:
                family.add_sample(name, _labels(rt), getattr(rt.stats, attr).ns // 1000)
            yield family

    def _cache(self, runtimes: list[ModelRuntime]) -> Iterator[Metric]:
        hits = counter(names.CACHE_NUM_HITS_PER_MODEL, "Number of cache hits per model")
        misses = counter(names.CACHE_NUM_MISSES_PER_MODEL, "Number of cache misses per model")
        hit_us = counter(
            names.CACHE_HIT_DURATION_PER_MODEL,
            "Total cache hit duration per model, in microseconds",
        )
        miss_us = counter(
            names.CACHE_MISS_DURATION_PER_MODEL,
            "Total cache miss (insert+lookup) duration per model, in microseconds",
        )
        for rt in runtimes:
            lv = _labels(rt)
            s = rt.stats
            hits.add_sample(hits.name, lv, s.cache_hit.count)
            misses.add_sample(misses.name, lv, s.cache_miss.count)
            hit_us.add_sample(hit_us.name, lv, s.cache_hit.ns // 1000)
            miss_us.add_sample(miss_us.name, lv, s.cache_miss.ns // 1000)
        yield from (hits, misses, hit_us, miss_us)

    def _gauges(self, runtimes: list[ModelRuntime]) -> Iterator[Metric]:
        pending = GaugeMetricFamily(
            names.INFERENCE_PENDING_REQUEST_COUNT,
            "Instantaneous number of pending requests awaiting execution per-model.",
            labels=LABELS,
        )
        load = GaugeMetricFamily(
            names.MODEL_LOAD_DURATION_SECS, "Model load time in seconds", labels=LABELS
        )
        for rt in runtimes:
            lv = [rt.name, rt.version_str]
            pending.add_metric(lv, rt.scheduler.pending if rt.scheduler else 0)
            load.add_metric(lv, rt.load_seconds)
        yield from (pending, load)

    def _distributions(self, runtimes: list[ModelRuntime]) -> Iterator[Metric]:
        latency = HistogramMetricFamily(
            names.KILN_REQUEST_DURATION_SECONDS,
            "End-to-end duration of successful inference requests in seconds",
            labels=LABELS,
        )
        batch = HistogramMetricFamily(
            names.KILN_BATCH_SIZE, "Batch size of each model execution", labels=LABELS
        )
        first = HistogramMetricFamily(
            names.INFERENCE_FIRST_RESPONSE_HISTOGRAM_MS,
            "Duration from request to first response in milliseconds",
            labels=LABELS,
        )
        summaries = {
            p: Metric(f"nv_inference_{p}_summary_us", h, "summary")
            for p, h in _SUMMARY_HELP.items()
        }
        now = time.monotonic_ns()
        for rt in runtimes:
            lv = [rt.name, rt.version_str]
            _add_batch_sizes(batch, lv, rt.stats.batch_executions())
            obs = rt.stats.observer
            if not isinstance(obs, RuntimeMetrics):
                continue
            _add_histogram(latency, lv, obs.latency)
            if obs.first_response is not None:
                _add_histogram(first, lv, obs.first_response)
            if obs.summaries is not None:
                qs = [q for q, _ in self.config.summary_quantiles]
                for phase in SUMMARY_PHASES:
                    window = obs.summaries[phase]
                    family = summaries[phase]
                    labels = _labels(rt)
                    for q, v in zip(qs, window.quantiles(qs, now), strict=True):
                        family.add_sample(family.name, {**labels, "quantile": _q(q)}, v)
                    family.add_sample(family.name + "_count", labels, window.count)
                    family.add_sample(family.name + "_sum", labels, window.total)
        yield from (latency, batch)
        if self.config.histogram_latencies:
            yield first
        if self.config.summary_latencies:
            yield from summaries.values()


def _labels(rt: ModelRuntime) -> dict[str, str]:
    return {"model": rt.name, "version": rt.version_str}


def _q(q: float) -> str:
    return repr(q)


def _add_histogram(family: HistogramMetricFamily, lv: list[str], h: Histogram) -> None:
    family.add_metric(lv, h.cumulative(), h.total)


def _add_batch_sizes(family: HistogramMetricFamily, lv: list[str], sizes: dict[int, int]) -> None:
    buckets = []
    for bound in BATCH_BOUNDS:
        buckets.append((str(bound), sum(n for size, n in sizes.items() if size <= bound)))
    buckets.append(("+Inf", sum(sizes.values())))
    family.add_metric(lv, buckets, sum(size * n for size, n in sizes.items()))
