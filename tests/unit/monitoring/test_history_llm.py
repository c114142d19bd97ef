"""The LLM engine's series in the SQLite history: stored gauges and counters, tokens/s
aliases, the prefix-cache hit rate and TTFT/ITL quantiles per sampling interval, all
filterable by model (label ``model_name``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kiln.monitoring.history import HistoryOptions, HistoryRecorder
from kiln.monitoring.history_query import HistoryQuery, catalog, run_query
from kiln.monitoring.snapshot import Labels, Snapshot, labels_of

T0 = 1_700_000_000.0
TINY: Labels = labels_of({"model_name": "tiny"})
OTHER: Labels = labels_of({"model_name": "other"})


def _ttft(model: str, counts: tuple[float, float, float]) -> dict[Labels, float]:
    pairs = zip(("0.01", "0.1", "+Inf"), counts, strict=True)
    return {labels_of({"model_name": model, "le": le}): c for le, c in pairs}


def _snapshot(i: int) -> Snapshot:
    # tiny: 50 generated and 20 prompt tokens/s, half its 10 looked-up tokens/s hit the
    # prefix cache; its first tokens take <= 10 ms for 5 s, then 10-100 ms.
    # other: idle, one request running.
    fast, slow = min(i, 5) * 2, max(i - 5, 0) * 2
    return Snapshot(
        T0 + i,
        {
            "vllm:num_requests_running": {TINY: 3.0, OTHER: 1.0},
            "vllm:num_requests_waiting": {TINY: 2.0, OTHER: 0.0},
            "vllm:kv_cache_usage_perc": {TINY: 0.5, OTHER: 0.25},
            "vllm:generation_tokens_total": {TINY: 50.0 * i, OTHER: 7.0},
            "vllm:prompt_tokens_total": {TINY: 20.0 * i, OTHER: 7.0},
            "vllm:prefix_cache_queries_total": {TINY: 10.0 * i, OTHER: 0.0},
            "vllm:prefix_cache_hits_total": {TINY: 5.0 * i, OTHER: 0.0},
            "vllm:time_to_first_token_seconds_bucket": {
                **_ttft("tiny", (fast, fast + slow, fast + slow)),
                **_ttft("other", (0, 0, 0)),
            },
        },
    )


@pytest.fixture
def db(tmp_path: Path) -> Path:
    sampler = HistoryRecorder(HistoryOptions(tmp_path / "h.db", 1.0), iter([]).__next__)
    sampler.store.open()
    for i in range(11):
        sampler.source = lambda i=i: _snapshot(i)  # type: ignore[misc]
        sampler.sample_once()
    sampler.stop()
    return tmp_path / "h.db"


def _query(db: Path, metric: str, step: float = 2.0, model: str = "") -> dict[str, list[float]]:
    result = run_query(db, HistoryQuery(metric, T0, T0 + 10, step, model=model))
    return {s["labels"]["model_name"]: [p[1] for p in s["points"]] for s in result["series"]}


def test_tokens_per_second_and_gauges(db: Path) -> None:
    assert _query(db, "llm_generation_tokens_per_s") == {"tiny": [50.0] * 5, "other": [0.0] * 5}
    assert _query(db, "llm_prompt_tokens_per_s", model="tiny") == {"tiny": [20.0] * 5}
    assert _query(db, "vllm:kv_cache_usage_perc", step=10) == {"tiny": [0.5], "other": [0.25]}
    assert _query(db, "vllm:num_requests_running", step=10, model="other") == {"other": [1.0]}
    assert _query(db, "vllm:num_requests_waiting", step=10, model="tiny") == {"tiny": [2.0]}


def test_prefix_cache_hit_rate_is_a_ratio_of_increases(db: Path) -> None:
    # "other" looked nothing up: no point rather than a 0 % hit rate
    assert _query(db, "llm_prefix_cache_hit_rate") == {"tiny": [0.5] * 5}


def test_time_to_first_token_quantiles_per_interval(db: Path) -> None:
    p99 = _query(db, "kiln_llm_time_to_first_token_p99_seconds", step=1)
    assert set(p99) == {"tiny"}  # no first token from "other": no rows, not zeros
    assert all(0 < v <= 0.01 for v in p99["tiny"][:5])
    assert all(0.01 < v <= 0.1 for v in p99["tiny"][5:])
    p50 = _query(db, "kiln_llm_time_to_first_token_p50_seconds", step=1)["tiny"]
    assert all(a <= b for a, b in zip(p50, p99["tiny"], strict=True))


def test_the_catalog_lists_the_llm_metrics() -> None:
    names = {m["name"]: m["kind"] for m in catalog()}
    assert names["llm_generation_tokens_per_s"] == "rate"
    assert names["llm_prefix_cache_hit_rate"] == "ratio"
    assert names["vllm:kv_cache_usage_perc"] == "gauge"
    assert names["vllm:generation_tokens_total"] == "rate"
    for q in ("time_to_first_token_p50", "time_to_first_token_p99", "inter_token_latency_p99"):
        assert names[f"kiln_llm_{q}_seconds"] == "gauge"
