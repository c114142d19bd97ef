"""The per-runtime distributions: histogram buckets and sliding-window quantiles."""

from __future__ import annotations

import math

from kiln.core.stats import RequestTimes
from kiln.metrics.config import MetricsConfig
from kiln.metrics.observer import Histogram, RuntimeMetrics, SlidingQuantiles

SECOND = 1_000_000_000


def test_histogram_buckets_are_cumulative_and_inclusive() -> None:
    h = Histogram((0.5, 1.0, 2.5))
    for v in (0.1, 0.5, 0.7, 1.0, 3.0):
        h.observe(v)
    assert h.cumulative() == [("0.5", 2), ("1", 4), ("2.5", 4), ("+Inf", 5)]
    assert h.count == 5
    assert math.isclose(h.total, 5.3)


def test_quantiles_are_exact_over_the_window() -> None:
    q = SlidingQuantiles()
    for v in range(1, 101):
        q.observe(float(v), now_ns=SECOND)
    assert q.quantiles([0.5, 0.9, 0.99, 1.0], now_ns=SECOND) == [50.0, 90.0, 99.0, 100.0]
    assert (q.count, q.total) == (100, 5050.0)


def test_old_samples_leave_the_window_but_count_and_sum_stay() -> None:
    q = SlidingQuantiles(max_age_s=60, age_buckets=5)
    q.observe(1000.0, now_ns=0)
    q.observe(1.0, now_ns=50 * SECOND)
    assert q.quantiles([0.99], now_ns=50 * SECOND) == [1000.0]
    # 61 s later the first slot has expired; only the recent sample remains.
    assert q.quantiles([0.99], now_ns=61 * SECOND) == [1.0]
    assert math.isnan(q.quantiles([0.5], now_ns=200 * SECOND)[0])
    assert (q.count, q.total) == (2, 1001.0)


def test_a_slot_keeps_at_most_capacity_samples() -> None:
    q = SlidingQuantiles(capacity=64)
    for v in range(10_000):
        q.observe(float(v), now_ns=0)
    assert sum(len(s) for s in q._samples) == 64
    assert q.count == 10_000
    median = q.quantiles([0.5], now_ns=0)[0]
    assert 0 <= median < 10_000


def test_runtime_metrics_observes_each_phase() -> None:
    config = MetricsConfig.parse(["summary_latencies=true", "histogram_latencies=true"])
    m = RuntimeMetrics(config)
    ms = 1_000_000
    times = RequestTimes(
        received=0, queue_end=1 * ms, input_end=2 * ms, infer_end=5 * ms, output_end=6 * ms
    )
    m.observe_success(times, batch_size=1, end_ns=7 * ms)
    assert m.latency.count == 1 and math.isclose(m.latency.total, 0.007)
    assert m.first_response is not None and math.isclose(m.first_response.total, 7.0)
    assert m.summaries is not None
    got = {k: s.total for k, s in m.summaries.items()}
    assert got == {
        "request": 7000.0,
        "queue": 1000.0,
        "compute_input": 1000.0,
        "compute_infer": 3000.0,
        "compute_output": 1000.0,
    }


def test_defaults_keep_only_the_latency_histogram() -> None:
    m = RuntimeMetrics(MetricsConfig())
    assert m.first_response is None and m.summaries is None
