"""The LLM engine's live figures (the ``llm`` list of ``GET /api/live``).

Read from the ``vllm:*`` families (label ``model_name``) the same way the per-model
figures are: gauges as they are now, counters and histogram buckets as increases between
two snapshots ``window_s`` apart, so tokens/s, the prefix-cache hit rate and the latency
quantiles describe the window, not the server's whole life. Schema in docs/monitoring.md.
"""

from __future__ import annotations

import math
from typing import Any

from kiln.metrics import names
from kiln.monitoring.promql_eval import histogram_quantile
from kiln.monitoring.snapshot import Labels, Snapshot

_GAUGES = {
    "running": names.VLLM_NUM_REQUESTS_RUNNING,
    "waiting": names.VLLM_NUM_REQUESTS_WAITING,
    "kv_cache_usage": names.VLLM_KV_CACHE_USAGE_PERC,
}
_COUNTERS = {
    "preemptions": names.VLLM_NUM_PREEMPTIONS_TOTAL,
    "prompt_tokens": names.VLLM_PROMPT_TOKENS_TOTAL,
    "generation_tokens": names.VLLM_GENERATION_TOKENS_TOTAL,
    "prefix_queries": names.VLLM_PREFIX_CACHE_QUERIES_TOTAL,
    "prefix_hits": names.VLLM_PREFIX_CACHE_HITS_TOTAL,
}
# (figure name, histogram family, quantile): what a vLLM user watches first.
_QUANTILES = (
    ("ttft_p50_ms", names.VLLM_TIME_TO_FIRST_TOKEN_SECONDS, 0.5),
    ("ttft_p99_ms", names.VLLM_TIME_TO_FIRST_TOKEN_SECONDS, 0.99),
    ("itl_p50_ms", names.VLLM_INTER_TOKEN_LATENCY_SECONDS, 0.5),
    ("itl_p99_ms", names.VLLM_INTER_TOKEN_LATENCY_SECONDS, 0.99),
    ("e2e_p50_ms", "vllm:e2e_request_latency_seconds", 0.5),
)


def _by_model(snap: Snapshot, metric: str) -> dict[str, float]:
    return {dict(labels).get("model_name", ""): v for labels, v in snap.series(metric).items()}


def _increase(new: float, old: float | None) -> float:
    # A counter that went down was reset (model reloaded): count from zero, as rate() does.
    return new if old is None or new < old else new - old


def bucket_deltas(latest: Snapshot, base: Snapshot, family: str) -> dict[Labels, float]:
    """Per-``le`` increases of a histogram's cumulative buckets over the window."""
    before = base.series(family + "_bucket")
    return {
        labels: _increase(v, before.get(labels))
        for labels, v in latest.series(family + "_bucket").items()
    }


def _ms(seconds: float | None) -> float | None:
    # NaN: no observation in the window (not 0 ms); inf cannot happen with +Inf last.
    return seconds * 1e3 if seconds is not None and math.isfinite(seconds) else None


def _quantiles(latest: Snapshot, base: Snapshot | None) -> dict[str, dict[str, float | None]]:
    """figure name -> model -> value in ms (None when nothing was observed)."""
    out: dict[str, dict[str, float | None]] = {}
    for name, family, q in _QUANTILES:
        if base is None:
            out[name] = {}
            continue
        per_labels = histogram_quantile(q, bucket_deltas(latest, base, family))
        out[name] = {dict(k).get("model_name", ""): _ms(v) for k, v in per_labels.items()}
    return out


def llm_figures(latest: Snapshot, base: Snapshot | None) -> list[dict[str, Any]]:
    gauges = {k: _by_model(latest, m) for k, m in _GAUGES.items()}
    now = {k: _by_model(latest, m) for k, m in _COUNTERS.items()}
    old = {k: _by_model(base, m) for k, m in _COUNTERS.items()} if base is not None else None
    dt = latest.ts - base.ts if base is not None else 0.0
    quantiles = _quantiles(latest, base)
    out = []
    for model in sorted(set(gauges["running"]) | set(now["generation_tokens"])):
        total = {k: now[k].get(model, 0.0) for k in now}
        delta = (
            {k: _increase(total[k], old[k].get(model)) for k in now}
            if old is not None and dt > 0
            else None
        )
        rate = {k: v / dt for k, v in delta.items()} if delta is not None else {}
        queries = delta["prefix_queries"] if delta is not None else 0.0
        hit_rate = delta["prefix_hits"] / queries if delta is not None and queries > 0 else None
        out.append(
            {
                "model": model,
                "running": int(gauges["running"].get(model, 0.0)),
                "waiting": int(gauges["waiting"].get(model, 0.0)),
                "kv_cache_usage": gauges["kv_cache_usage"].get(model),
                "preemptions": int(total["preemptions"]),
                "preemptions_per_s": rate.get("preemptions"),
                "prompt_tokens": int(total["prompt_tokens"]),
                "generation_tokens": int(total["generation_tokens"]),
                "prompt_tokens_per_s": rate.get("prompt_tokens"),
                "generation_tokens_per_s": rate.get("generation_tokens"),
                "prefix_cache_hit_rate": hit_rate,
                **{name: quantiles[name].get(model) for name, _, _ in _QUANTILES},
            }
        )
    return out
