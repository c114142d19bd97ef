"""One reading of every exported series, for history and alert evaluation.

A snapshot is taken from the same collectors that serve ``/metrics``, so history, alert
rules and a Prometheus scrape see exactly the same names, labels and values. It is taken
on a background thread (history sampler, alert evaluator), never on the event loop.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass

from prometheus_client.core import Metric

from kiln.llm.stats import HISTOGRAMS as LLM_HISTOGRAMS
from kiln.metrics.dcgm import FIELDS as DCGM_FIELDS
from kiln.metrics.dcgm import PROCESS_MEMORY
from kiln.metrics.gpu import FAMILIES as GPU_FAMILIES

Labels = tuple[tuple[str, str], ...]  # sorted (name, value) pairs: hashable and canonical

_HISTOGRAMS = (
    "kiln_request_duration_seconds",
    "kiln_batch_size",
    "nv_inference_first_response_histogram_ms",
    *(f"vllm:{name}" for name, _, _ in LLM_HISTOGRAMS),
)
_SUMMARIES = tuple(
    f"nv_inference_{p}_summary_us"
    for p in ("request", "queue", "compute_input", "compute_infer", "compute_output")
)
# Sample names whose value only grows (until a restart): history stores them raw and
# derives rates; ``rate()`` is meaningful on them.
COUNTERS: frozenset[str] = frozenset(
    {
        "nv_inference_request_success",
        "nv_inference_request_failure",
        "nv_inference_count",
        "nv_inference_exec_count",
        "nv_inference_request_duration_us",
        "nv_inference_queue_duration_us",
        "nv_inference_compute_input_duration_us",
        "nv_inference_compute_infer_duration_us",
        "nv_inference_compute_output_duration_us",
        "nv_cache_num_hits_per_model",
        "nv_cache_num_misses_per_model",
        "nv_cache_hit_duration_per_model",
        "nv_cache_miss_duration_per_model",
        "nv_energy_consumption",
        "process_cpu_seconds_total",
        "vllm:num_preemptions_total",
        "vllm:prompt_tokens_total",
        "vllm:prompt_tokens_by_source_total",
        "vllm:prompt_tokens_cached_total",
        "vllm:generation_tokens_total",
        "vllm:prefix_cache_queries_total",
        "vllm:prefix_cache_hits_total",
        "vllm:request_success_total",
        *(f"{h}_{s}" for h in _HISTOGRAMS for s in ("bucket", "sum", "count")),
        *(f"{h}_{s}" for h in _SUMMARIES for s in ("sum", "count")),
        # dcgm-exporter's counters, from GPU agents (kiln monitor agent) in the fleet
        *(name for name, kind, _ in DCGM_FIELDS if kind == "counter"),
    }
)
GAUGES: frozenset[str] = frozenset(
    {
        "nv_inference_pending_request_count",
        "nv_model_load_duration_secs",
        "kiln_model_ready",
        "nv_cpu_utilization",
        "nv_cpu_memory_total_bytes",
        "nv_cpu_memory_used_bytes",
        "process_resident_memory_bytes",
        "process_virtual_memory_bytes",
        "process_open_fds",
        "process_max_fds",
        "process_start_time_seconds",
        "kiln_gpu_clock_event_active",
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:num_requests_waiting_by_reason",
        "vllm:engine_sleep_state",
        "vllm:kv_cache_usage_perc",
        "vllm:cache_config_info",
        *_SUMMARIES,
        *(name for _, name, _, is_counter in GPU_FAMILIES if not is_counter),
        *(name for name, kind, _ in DCGM_FIELDS if kind == "gauge"),
        PROCESS_MEMORY,
        "up",  # per fleet target (kiln serve --monitor-agent), as Prometheus writes it
    }
)
# Every sample name kiln can export (GPU ones included when this machine has no GPU):
# what alert rules may name and what the Grafana dashboard may query.
KNOWN_METRICS: frozenset[str] = COUNTERS | GAUGES


def labels_of(mapping: dict[str, str]) -> Labels:
    return tuple(sorted(mapping.items()))


@dataclass(frozen=True, slots=True)
class Snapshot:
    ts: float  # unix seconds
    values: dict[str, dict[Labels, float]]  # sample name -> labels -> value

    def series(self, metric: str) -> dict[Labels, float]:
        return self.values.get(metric, {})


def take_snapshot(metrics: Iterable[Metric], ts: float | None = None) -> Snapshot:
    values: dict[str, dict[Labels, float]] = {}
    for family in metrics:
        for s in family.samples:
            if s.name.endswith("_created"):
                continue
            labels = labels_of({k: str(v) for k, v in s.labels.items()})
            values.setdefault(s.name, {})[labels] = float(s.value)
    return Snapshot(time.time() if ts is None else ts, values)
