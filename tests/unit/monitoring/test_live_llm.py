"""The LLM engine's live figures (the ``llm`` list of ``/api/live``) from synthetic
snapshots of the ``vllm:*`` families: window rates, quantiles from bucket deltas,
the prefix-cache hit rate, and null (never 0) where the window measured nothing."""

from __future__ import annotations

import pytest

from kiln.monitoring.live import LiveTracker
from kiln.monitoring.llm_live import llm_figures
from kiln.monitoring.snapshot import Labels, Snapshot, labels_of

TTFT = "vllm:time_to_first_token_seconds_bucket"
ITL = "vllm:inter_token_latency_seconds_bucket"


def _m(model: str) -> Labels:
    return labels_of({"model_name": model})


def _buckets(model: str, counts: tuple[float, float, float]) -> dict[Labels, float]:
    pairs = zip(("0.01", "0.1", "+Inf"), counts, strict=True)
    return {labels_of({"model_name": model, "le": le}): c for le, c in pairs}


def llm_snap(
    ts: float,
    model: str = "tiny",
    *,
    running: float = 2,
    waiting: float = 1,
    usage: float = 0.25,
    preemptions: float = 0,
    prompt: float = 0,
    generation: float = 0,
    queries: float = 0,
    hits: float = 0,
    ttft: tuple[float, float, float] = (0, 0, 0),
    itl: tuple[float, float, float] = (0, 0, 0),
) -> Snapshot:
    m = _m(model)
    return Snapshot(
        ts,
        {
            "vllm:num_requests_running": {m: running},
            "vllm:num_requests_waiting": {m: waiting},
            "vllm:kv_cache_usage_perc": {m: usage},
            "vllm:num_preemptions_total": {m: preemptions},
            "vllm:prompt_tokens_total": {m: prompt},
            "vllm:generation_tokens_total": {m: generation},
            "vllm:prefix_cache_queries_total": {m: queries},
            "vllm:prefix_cache_hits_total": {m: hits},
            TTFT: _buckets(model, ttft),
            ITL: _buckets(model, itl),
        },
    )


def test_rates_and_hit_rate_are_over_the_window() -> None:
    old = llm_snap(100.0, preemptions=1, prompt=1000, generation=500, queries=400, hits=100)
    new = llm_snap(
        110.0, usage=0.5, preemptions=3, prompt=1400, generation=1500, queries=600, hits=250
    )
    [f] = llm_figures(new, old)
    assert f["model"] == "tiny"
    assert (f["running"], f["waiting"], f["kv_cache_usage"]) == (2, 1, 0.5)
    assert (f["preemptions"], f["prompt_tokens"], f["generation_tokens"]) == (3, 1400, 1500)
    assert f["preemptions_per_s"] == pytest.approx(0.2)
    assert f["prompt_tokens_per_s"] == pytest.approx(40.0)
    assert f["generation_tokens_per_s"] == pytest.approx(100.0)
    # 150 of the window's 200 looked-up tokens hit; the lifetime ratio (250/600) would not
    assert f["prefix_cache_hit_rate"] == pytest.approx(0.75)


def test_quantiles_come_from_the_windows_bucket_deltas() -> None:
    # 100 slow first tokens before the window, 20 fast ones inside it
    old = llm_snap(100.0, ttft=(0, 0, 100), itl=(5, 5, 5))
    new = llm_snap(110.0, ttft=(0, 20, 120), itl=(5, 5, 5))
    [f] = llm_figures(new, old)
    # Prometheus's interpolation inside (0.01, 0.1]; cumulative counts would say 100 ms
    assert f["ttft_p50_ms"] == pytest.approx(55.0)
    assert f["ttft_p99_ms"] == pytest.approx(10 + 0.99 * 90)
    # no token in the window: not measurable, not 0
    assert f["itl_p50_ms"] is None and f["itl_p99_ms"] is None
    assert f["e2e_p50_ms"] is None  # family absent


def test_first_reading_has_gauges_and_totals_but_null_rates() -> None:
    [f] = llm_figures(llm_snap(100.0, generation=50, queries=10, hits=5, ttft=(1, 1, 1)), None)
    assert (f["running"], f["kv_cache_usage"], f["generation_tokens"]) == (2, 0.25, 50)
    for key in (
        "preemptions_per_s", "prompt_tokens_per_s", "generation_tokens_per_s",
        "prefix_cache_hit_rate", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "e2e_p50_ms",
    ):  # fmt: skip
        assert f[key] is None, key


def test_hit_rate_is_null_without_queries_and_zero_when_nothing_hit() -> None:
    old = llm_snap(100.0, queries=40, hits=10)
    [idle] = llm_figures(llm_snap(110.0, queries=40, hits=10), old)
    assert idle["prefix_cache_hit_rate"] is None
    assert idle["generation_tokens_per_s"] == 0.0  # a rate is measurable: nothing happened
    [missed] = llm_figures(llm_snap(110.0, queries=90, hits=10), old)
    assert missed["prefix_cache_hit_rate"] == 0.0


def test_a_reloaded_model_counts_from_zero() -> None:
    old = llm_snap(100.0, generation=5000, ttft=(0, 0, 70))
    new = llm_snap(105.0, generation=30, ttft=(3, 3, 3))  # counters restarted
    [f] = llm_figures(new, old)
    assert f["generation_tokens_per_s"] == pytest.approx(6.0)
    assert f["ttft_p99_ms"] is not None and f["ttft_p99_ms"] <= 10.0


def test_one_entry_per_model_sorted_and_none_without_llm_models() -> None:
    a, b = llm_snap(100.0, "zeta", generation=10), llm_snap(100.0, "alpha", generation=99)
    both = Snapshot(100.0, {k: {**a.series(k), **b.series(k)} for k in a.values})
    assert [f["model"] for f in llm_figures(both, None)] == ["alpha", "zeta"]
    assert [f["generation_tokens"] for f in llm_figures(both, None)] == [99, 10]
    assert llm_figures(Snapshot(100.0, {}), Snapshot(90.0, {})) == []


def test_live_summary_carries_the_llm_list() -> None:
    clock = iter([100.0, 111.0])

    def source() -> Snapshot:
        ts = next(clock)
        return llm_snap(ts, generation=ts * 10)

    tracker = LiveTracker(source, window_s=30.0, min_interval_s=0.0)
    assert tracker.summary()["llm"][0]["generation_tokens_per_s"] is None
    [f] = tracker.summary()["llm"]
    assert f["generation_tokens_per_s"] == pytest.approx(10.0)
