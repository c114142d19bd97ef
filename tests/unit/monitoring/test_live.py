"""The live figures (``/api/live``): rates between two snapshots of the collectors."""

from __future__ import annotations

import pytest

from kiln.monitoring.live import LiveTracker, gpu_figures, host_figures, model_figures
from kiln.monitoring.snapshot import Labels, Snapshot, labels_of

MLP = labels_of({"model": "mlp", "version": "1"})


def _le(le: str) -> Labels:
    return labels_of({"model": "mlp", "version": "1", "le": le})


def snap(
    ts: float,
    success: float,
    count: float,
    execs: float,
    buckets: dict[str, float],
    failure: float = 0.0,
    queue_us: float = 0.0,
    infer_us: float = 0.0,
) -> Snapshot:
    fail = labels_of({"model": "mlp", "version": "1", "reason": "REJECTED"})
    return Snapshot(
        ts,
        {
            "nv_inference_request_success": {MLP: success},
            "nv_inference_request_failure": {fail: failure},
            "nv_inference_count": {MLP: count},
            "nv_inference_exec_count": {MLP: execs},
            "nv_inference_queue_duration_us": {MLP: queue_us},
            "nv_inference_compute_infer_duration_us": {MLP: infer_us},
            "kiln_request_duration_seconds_bucket": {_le(k): v for k, v in buckets.items()},
            "process_cpu_seconds_total": {(): ts / 2},
            "process_resident_memory_bytes": {(): 1e8},
        },
    )


def test_rates_are_the_increase_over_the_window() -> None:
    old = snap(100.0, 10, 40, 10, {"0.01": 10, "0.1": 10, "+Inf": 10}, queue_us=100)
    new = snap(110.0, 30, 120, 30, {"0.01": 10, "0.1": 30, "+Inf": 30}, 2, 1100, 4000)
    [m] = model_figures(new, old)
    assert m["totals"] == {
        "requests": 32, "success": 30, "failure": 2, "inferences": 120,
        "executions": 30, "avg_batch_size": 4.0, "pending": 0,
    }  # fmt: skip
    r = m["rates"]
    assert r["throughput"] == 8.0  # 80 inferences in 10 s
    assert r["requests_per_s"] == 2.2 and r["errors_per_s"] == 0.2
    assert r["avg_queue_us"] == 50.0  # (1100 - 100) / 20 requests
    assert r["avg_compute_us"] == 200.0
    assert r["avg_batch_size"] == 4.0
    # All 20 requests of the window fell in (0.01, 0.1]: Prometheus's interpolation.
    assert r["p50_ms"] == pytest.approx(55.0) and r["p99_ms"] == pytest.approx(10 + 0.99 * 90)


def test_no_baseline_or_no_traffic_gives_null_rates_not_zeros_for_ratios() -> None:
    s = snap(100.0, 5, 5, 5, {"0.01": 5, "+Inf": 5})
    [first] = model_figures(s, None)
    assert first["rates"]["throughput"] is None and first["rates"]["p99_ms"] is None
    [idle] = model_figures(snap(101.0, 5, 5, 5, {"0.01": 5, "+Inf": 5}), s)
    assert idle["rates"]["throughput"] == 0.0
    assert idle["rates"]["p50_ms"] is None and idle["rates"]["avg_queue_us"] is None


def test_a_counter_reset_counts_from_zero() -> None:
    old = snap(100.0, 50, 50, 50, {"0.01": 50, "+Inf": 50})
    new = snap(105.0, 10, 10, 10, {"0.01": 10, "+Inf": 10})  # model reloaded
    [m] = model_figures(new, old)
    assert m["rates"]["throughput"] == 2.0


def test_host_and_gpu_figures() -> None:
    old, new = snap(100.0, 0, 0, 0, {}), snap(110.0, 0, 0, 0, {})
    host = host_figures(new, old)
    assert host["process_cpu_cores"] == 0.5 and host["process_rss_bytes"] == 1e8
    assert host["cpu_utilization"] is None  # --no-allow-cpu-metrics: absent, not 0
    assert gpu_figures(new) == []
    gpu = labels_of({"gpu_uuid": "GPU-abc"})
    with_gpu = Snapshot(1.0, {"nv_gpu_utilization": {gpu: 0.5}, "nv_gpu_power_usage": {gpu: 70}})
    assert gpu_figures(with_gpu) == [{"uuid": "GPU-abc", "utilization": 0.5, "power_watts": 70}]


def test_tracker_shares_snapshots_between_viewers_and_keeps_a_window() -> None:
    clock = [0.0]
    taken: list[float] = []

    def source() -> Snapshot:
        taken.append(clock[0])
        return snap(clock[0], 0, clock[0], 1, {})

    tracker = LiveTracker(source, window_s=10.0, min_interval_s=0.5)
    latest, base = tracker.pair(now=0.0)
    assert base is None
    for t in (0.2, 1.0, 1.1, 5.0, 12.0, 13.0):
        clock[0] = t
        latest, base = tracker.pair(now=t)
    assert taken == [0.0, 1.0, 5.0, 12.0, 13.0]  # 0.2 and 1.1 reused the previous one
    # The baseline is the newest snapshot at least window_s old (5.0 is only 8 s old).
    assert base is not None and (latest.ts, base.ts) == (13.0, 1.0)
