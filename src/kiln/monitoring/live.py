"""The live figures behind ``GET /api/live``: the dashboard and ``kiln monitor URL``.

Rates (throughput, p50/p99, queue vs compute, batch size) are differences between two
snapshots of the same collectors ``/metrics`` serves, ``window_s`` apart, so every viewer
sees the same numbers whatever its own poll rate, and a viewer needs no state of its
own. Snapshots are taken on demand (at most one per ``min_interval_s``, however many
viewers poll) on a worker thread, never on the event loop.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kiln.metrics import names
from kiln.monitoring.fleet import fleet_figures
from kiln.monitoring.llm_live import llm_figures
from kiln.monitoring.promql_eval import histogram_quantile
from kiln.monitoring.snapshot import Labels, Snapshot

WINDOW_S = 10.0  # rates are over (about) the last 10 s, like a short Prometheus rate()
MIN_INTERVAL_S = 0.5

_MODEL_COUNTERS = {
    "success": names.INFERENCE_REQUEST_SUCCESS,
    "failure": names.INFERENCE_REQUEST_FAILURE,
    "inferences": names.INFERENCE_COUNT,
    "executions": names.INFERENCE_EXEC_COUNT,
    "request_us": names.INFERENCE_REQUEST_DURATION_US,
    "queue_us": names.INFERENCE_QUEUE_DURATION_US,
    "input_us": names.INFERENCE_COMPUTE_INPUT_DURATION_US,
    "infer_us": names.INFERENCE_COMPUTE_INFER_DURATION_US,
    "output_us": names.INFERENCE_COMPUTE_OUTPUT_DURATION_US,
}
_GPU_GAUGES = {
    "utilization": names.GPU_UTILIZATION,
    "memory_used_bytes": names.GPU_MEMORY_USED_BYTES,
    "memory_total_bytes": names.GPU_MEMORY_TOTAL_BYTES,
    "temperature_celsius": names.KILN_GPU_TEMPERATURE_CELSIUS,
    "power_watts": names.GPU_POWER_USAGE,
    "power_limit_watts": names.GPU_POWER_LIMIT,
}
_BUCKETS = "kiln_request_duration_seconds_bucket"

ModelKey = tuple[str, str]  # (model, version)


def _per_model(snap: Snapshot, metric: str) -> dict[ModelKey, float]:
    """Sum a per-model family over its other labels (``reason`` on failures)."""
    out: dict[ModelKey, float] = {}
    for labels, v in snap.series(metric).items():
        d = dict(labels)
        key = (d.get("model", ""), d.get("version", ""))
        out[key] = out.get(key, 0.0) + v
    return out


def _increase(new: float, old: float | None) -> float:
    # A counter that went down was reset (model reloaded): count from zero, as rate() does.
    return new if old is None or new < old else new - old


def _ratio(num: float, den: float) -> float | None:
    return num / den if den > 0 else None


def _finite(v: float | None) -> float | None:
    return v if v is not None and math.isfinite(v) else None


def _gauge(snap: Snapshot, metric: str) -> float | None:
    values = list(snap.series(metric).values())
    return values[0] if values else None


@dataclass(slots=True)
class LiveTracker:
    source: Callable[[], Snapshot]
    window_s: float = WINDOW_S
    min_interval_s: float = MIN_INTERVAL_S
    _snaps: deque[Snapshot] = field(default_factory=deque)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def pair(self, now: float | None = None) -> tuple[Snapshot, Snapshot | None]:
        """(latest, baseline about ``window_s`` older or the oldest kept); may sample."""
        now = time.time() if now is None else now
        with self._lock:
            if not self._snaps or now - self._snaps[-1].ts >= self.min_interval_s:
                self._snaps.append(self.source())
            latest = self._snaps[-1]
            while len(self._snaps) > 1 and latest.ts - self._snaps[1].ts >= self.window_s:
                self._snaps.popleft()
            base = self._snaps[0] if self._snaps[0] is not latest else None
            return latest, base

    def summary(self) -> dict[str, Any]:
        latest, base = self.pair()
        return {
            "ts": latest.ts,
            "window_s": latest.ts - base.ts if base is not None else 0.0,
            "models": model_figures(latest, base),
            "host": host_figures(latest, base),
            "gpus": gpu_figures(latest),
            "llm": llm_figures(latest, base),
            "fleet": fleet_figures(latest),
        }


def model_figures(latest: Snapshot, base: Snapshot | None) -> list[dict[str, Any]]:
    now = {k: _per_model(latest, m) for k, m in _MODEL_COUNTERS.items()}
    old = {k: _per_model(base, m) for k, m in _MODEL_COUNTERS.items()} if base else {}
    pending = _per_model(latest, names.INFERENCE_PENDING_REQUEST_COUNT)
    dt = latest.ts - base.ts if base is not None else 0.0
    delta_buckets: dict[Labels, float] = {}
    if base is not None:
        before = base.series(_BUCKETS)
        for labels, v in latest.series(_BUCKETS).items():
            delta_buckets[labels] = _increase(v, before.get(labels))
    quantiles = {q: histogram_quantile(q, delta_buckets) for q in (0.5, 0.99)}
    keys = sorted(set(now["success"]) | set(now["failure"]) | set(now["inferences"]))
    out = []
    for key in keys:
        total = {k: now[k].get(key, 0.0) for k in now}
        d = {k: _increase(total[k], old[k].get(key)) if old else 0.0 for k in now}
        done = d["success"]
        labels = (("model", key[0]), ("version", key[1]))
        p50, p99 = (quantiles[q].get(labels) for q in (0.5, 0.99))
        compute = d["input_us"] + d["infer_us"] + d["output_us"]
        rates = {
            "throughput": d["inferences"] / dt if dt > 0 else None,
            "requests_per_s": (done + d["failure"]) / dt if dt > 0 else None,
            "errors_per_s": d["failure"] / dt if dt > 0 else None,
            "p50_ms": _finite(p50 * 1e3) if p50 is not None else None,
            "p99_ms": _finite(p99 * 1e3) if p99 is not None else None,
            "avg_request_us": _ratio(d["request_us"], done),
            "avg_queue_us": _ratio(d["queue_us"], done),
            "avg_compute_us": _ratio(compute, done),
            "avg_batch_size": _ratio(d["inferences"], d["executions"]),
        }
        out.append(
            {
                "model": key[0],
                "version": key[1],
                "totals": {
                    "requests": int(total["success"] + total["failure"]),
                    "success": int(total["success"]),
                    "failure": int(total["failure"]),
                    "inferences": int(total["inferences"]),
                    "executions": int(total["executions"]),
                    "avg_batch_size": _ratio(total["inferences"], total["executions"]),
                    "pending": int(pending.get(key, 0.0)),
                },
                "rates": rates,
            }
        )
    return out


def host_figures(latest: Snapshot, base: Snapshot | None) -> dict[str, float | None]:
    cpu_now = _gauge(latest, names.PROCESS_CPU_SECONDS_TOTAL)
    cpu_old = _gauge(base, names.PROCESS_CPU_SECONDS_TOTAL) if base is not None else None
    dt = latest.ts - base.ts if base is not None else 0.0
    return {
        "cpu_utilization": _gauge(latest, names.CPU_UTILIZATION),
        "memory_used_bytes": _gauge(latest, names.CPU_MEMORY_USED_BYTES),
        "memory_total_bytes": _gauge(latest, names.CPU_MEMORY_TOTAL_BYTES),
        "process_rss_bytes": _gauge(latest, names.PROCESS_RESIDENT_MEMORY_BYTES),
        # CPU seconds per second: 1.0 = one core busy (can exceed 1 with threads).
        "process_cpu_cores": (cpu_now - cpu_old) / dt
        if cpu_now is not None and cpu_old is not None and dt > 0
        else None,
    }


def gpu_figures(latest: Snapshot) -> list[dict[str, Any]]:
    gpus: dict[str, dict[str, Any]] = {}
    for key, metric in _GPU_GAUGES.items():
        for labels, v in latest.series(metric).items():
            uuid = dict(labels).get("gpu_uuid", "")
            gpus.setdefault(uuid, {"uuid": uuid})[key] = v
    return [gpus[u] for u in sorted(gpus)]
