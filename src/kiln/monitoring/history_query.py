"""Reading history back: range, step, rates and derived ratios (``GET /api/history``).

Each returned point ``[t, v]`` summarizes the samples in ``[t, t + step)``:

- a gauge is averaged (latency quantiles take the maximum: a p99 must not be diluted);
- a counter (or an alias of one: ``throughput``, ``llm_generation_tokens_per_s``) becomes a
  per-second rate (increase / elapsed time between samples, a restart's reset counted
  from zero), or its last raw value with ``fn=raw``;
- a derived metric is a ratio of counter increases per model version (mean queue µs =
  Δqueue_us / Δsuccess, average batch = Δinference_count / Δexec_count, ...).

Runs on a worker thread with its own read connection (WAL lets it read while the
recorder writes).
"""

from __future__ import annotations

import json
import math
import sqlite3
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path
from typing import Any

from kiln.metrics import names
from kiln.monitoring.history import QUANTILES, STORED_METRICS, connect
from kiln.monitoring.snapshot import COUNTERS

MAX_POINTS = 11000  # per series, as Prometheus's range queries
MAX_TIME = 253402300799.0  # 9999-12-31T23:59:59Z, as unix seconds

# name -> (numerator counters, denominator counters, unit, meaning)
DERIVED: dict[str, tuple[tuple[str, ...], tuple[str, ...], str, str]] = {
    "avg_request_us": (
        (names.INFERENCE_REQUEST_DURATION_US,),
        (names.INFERENCE_REQUEST_SUCCESS,),
        "us",
        "mean end-to-end time of a successful request",
    ),
    "avg_queue_us": (
        (names.INFERENCE_QUEUE_DURATION_US,),
        (names.INFERENCE_REQUEST_SUCCESS,),
        "us",
        "mean queue time per request",
    ),
    "avg_compute_us": (
        (
            names.INFERENCE_COMPUTE_INPUT_DURATION_US,
            names.INFERENCE_COMPUTE_INFER_DURATION_US,
            names.INFERENCE_COMPUTE_OUTPUT_DURATION_US,
        ),
        (names.INFERENCE_REQUEST_SUCCESS,),
        "us",
        "mean compute (input + infer + output) time per request",
    ),
    "avg_batch_size": (
        (names.INFERENCE_COUNT,),
        (names.INFERENCE_EXEC_COUNT,),
        "",
        "inferences per model execution",
    ),
    "error_ratio": (
        (names.INFERENCE_REQUEST_FAILURE,),
        (names.INFERENCE_REQUEST_SUCCESS, names.INFERENCE_REQUEST_FAILURE),
        "",
        "failed / all requests",
    ),
    "llm_prefix_cache_hit_rate": (
        (names.VLLM_PREFIX_CACHE_HITS_TOTAL,),
        (names.VLLM_PREFIX_CACHE_QUERIES_TOTAL,),
        "",
        "LLM prompt tokens found in the prefix cache / looked up",
    ),
}
# name -> (stored counter, unit, meaning): a counter's rate under a readable name.
ALIASES: dict[str, tuple[str, str, str]] = {
    "throughput": (names.INFERENCE_COUNT, "1/s", "inferences/s"),
    "llm_generation_tokens_per_s": (
        names.VLLM_GENERATION_TOKENS_TOTAL,
        "1/s",
        "LLM generated tokens/s",
    ),
    "llm_prompt_tokens_per_s": (names.VLLM_PROMPT_TOKENS_TOTAL, "1/s", "LLM prefill tokens/s"),
}


class HistoryQueryError(ValueError):
    pass


@dataclass(frozen=True, slots=True)
class HistoryQuery:
    metric: str
    start: float
    end: float
    step: float
    model: str = ""
    version: str = ""
    raw: bool = False


def metric_kind(name: str) -> str:
    if name in DERIVED:
        return "ratio"
    if name in ALIASES or name in COUNTERS:
        return "rate"
    return "gauge"


def catalog() -> list[dict[str, str]]:
    out = [{"name": n, "kind": "ratio", "unit": d[2], "help": d[3]} for n, d in DERIVED.items()]
    for name, (_, unit, meaning) in ALIASES.items():
        out.append({"name": name, "kind": "rate", "unit": unit, "help": meaning})
    for name in (*STORED_METRICS, *QUANTILES):
        out.append({"name": name, "kind": metric_kind(name), "unit": "", "help": ""})
    return out


def _validate(q: HistoryQuery) -> None:
    known = {*DERIVED, *ALIASES, *STORED_METRICS, *QUANTILES}
    if q.metric not in known:
        raise HistoryQueryError(
            f"unknown history metric '{q.metric}' (known: {', '.join(sorted(known))})"
        )
    for field, value in (("start", q.start), ("end", q.end)):
        # SQLite keeps milliseconds in an int64: a time beyond year 9999 cannot be asked for
        if not (math.isfinite(value) and 0 <= value <= MAX_TIME):
            raise HistoryQueryError(
                f"'{field}' must be a time between 1970 and 9999 (0 to {MAX_TIME:.0f} unix "
                f"seconds), got {value}"
            )
    if q.end < q.start:
        raise HistoryQueryError(f"'end' ({q.end}) must not be before 'start' ({q.start})")
    if not math.isfinite(q.step) or not 0 < q.step <= MAX_TIME:
        raise HistoryQueryError(
            f"'step' must be a positive number of seconds up to {MAX_TIME:.0f}, got {q.step}"
        )
    if (q.end - q.start) / q.step > MAX_POINTS:
        raise HistoryQueryError(
            f"exceeded maximum resolution of {MAX_POINTS} points per series: "
            "use a larger 'step' or a shorter range"
        )


Points = list[tuple[float, float]]
_AGG: dict[str, Callable[[list[float]], float]] = {
    "avg": lambda xs: sum(xs) / len(xs),
    "max": max,
    "last": lambda xs: xs[-1],
}


def _fetch(
    conn: sqlite3.Connection, metric: str, q: HistoryQuery, lead: float
) -> dict[str, Points]:
    """label-json -> [(ts, value)] for series of ``metric`` matching the model/version."""
    out: dict[str, Points] = {}
    for sid, labels in conn.execute("SELECT id, labels FROM series WHERE metric = ?", (metric,)):
        d = json.loads(labels)
        model = d.get("model", d.get("model_name"))  # LLM engine series: model_name
        if (q.model and model != q.model) or (q.version and d.get("version") != q.version):
            continue
        rows = conn.execute(
            "SELECT ts, value FROM samples WHERE series_id = ? AND ts >= ? AND ts <= ? ORDER BY ts",
            (sid, int((q.start - lead) * 1000), int(q.end * 1000)),
        ).fetchall()
        if rows:
            out[labels] = [(ts / 1000, v) for ts, v in rows]
    return out


def _bucket(q: HistoryQuery, ts: float) -> int | None:
    if ts < q.start or ts > q.end:
        return None
    return min(int((ts - q.start) // q.step), _nbuckets(q) - 1)


def _nbuckets(q: HistoryQuery) -> int:
    return max(1, math.ceil((q.end - q.start) / q.step))


def _increments(q: HistoryQuery, pts: Points) -> dict[int, tuple[float, float]]:
    """bucket -> (increase, elapsed seconds) of a counter."""
    out: dict[int, tuple[float, float]] = {}
    for (t0, v0), (t1, v1) in pairwise(pts):
        b = _bucket(q, t1)
        if b is None:
            continue
        inc, dt = out.get(b, (0.0, 0.0))
        out[b] = (inc + (v1 - v0 if v1 >= v0 else v1), dt + (t1 - t0))
    return out


def _labels_key(labels_json: str) -> str:
    d = json.loads(labels_json)
    keep = ("model", "version", "model_name")
    return json.dumps({k: d[k] for k in keep if k in d}, sort_keys=True)


def _series(q: HistoryQuery, per_bucket: dict[str, dict[int, float]]) -> list[dict[str, Any]]:
    return [
        {
            "labels": json.loads(labels),
            "points": [[q.start + b * q.step, v] for b, v in sorted(buckets.items())],
        }
        for labels, buckets in sorted(per_bucket.items())
        if buckets
    ]


def run_query(path: Path, q: HistoryQuery) -> dict[str, Any]:
    _validate(q)
    kind = "raw" if q.raw and metric_kind(q.metric) == "rate" else metric_kind(q.metric)
    conn = connect(path)
    try:
        conn.execute("PRAGMA query_only = ON")
        lead = q.step  # one sample before the range, so the first bucket has a rate
        result: dict[str, dict[int, float]] = {}
        if kind == "ratio":
            num, den, _, _ = DERIVED[q.metric]
            sums: dict[str, dict[int, list[float]]] = defaultdict(dict)
            for which, metrics in ((0, num), (1, den)):
                for metric in set(metrics):
                    for labels, pts in _fetch(conn, metric, q, lead).items():
                        key = _labels_key(labels)
                        weight = metrics.count(metric)
                        for b, (inc, _) in _increments(q, pts).items():
                            acc = sums[key].setdefault(b, [0.0, 0.0])
                            acc[which] += inc * weight
            for key, buckets in sums.items():
                result[key] = {b: n / d for b, (n, d) in buckets.items() if d > 0}
        else:
            metric = ALIASES[q.metric][0] if q.metric in ALIASES else q.metric
            for labels, pts in _fetch(conn, metric, q, lead).items():
                if kind == "rate":
                    result[labels] = {
                        b: inc / dt for b, (inc, dt) in _increments(q, pts).items() if dt > 0
                    }
                    continue
                groups: dict[int, list[float]] = defaultdict(list)
                for ts, v in pts:
                    bucket = _bucket(q, ts)
                    if bucket is not None:
                        groups[bucket].append(v)
                agg = _AGG["last" if kind == "raw" else "max" if q.metric in QUANTILES else "avg"]
                result[labels] = {b: agg(vs) for b, vs in groups.items()}
    finally:
        conn.close()
    return {
        "metric": q.metric,
        "kind": kind,
        "start": q.start,
        "end": q.end,
        "step": q.step,
        "series": _series(q, result),
    }
