"""One reading of every exported series, for history and alert evaluation.

A snapshot is taken from the same collectors that serve ``/metrics``, so history, alert
rules and a Prometheus scrape see exactly the same names, labels and values. It is taken
on a background thread (history recorder, alert evaluator), never on the event loop.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass

from prometheus_client.core import Metric

from kiln.llm.stats import HISTOGRAMS as LLM_HISTOGRAMS
from kiln.metrics import names
from kiln.metrics.dcgm import FIELDS as DCGM_FIELDS
from kiln.metrics.dcgm import PROCESS_MEMORY
from kiln.metrics.gpu import FAMILIES as GPU_FAMILIES

Labels = tuple[tuple[str, str], ...]  # sorted (name, value) pairs: hashable and canonical

_HISTOGRAMS = (
    names.KILN_REQUEST_DURATION_SECONDS,
    names.KILN_BATCH_SIZE,
    names.INFERENCE_FIRST_RESPONSE_HISTOGRAM_MS,
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
        names.INFERENCE_REQUEST_SUCCESS,
        names.INFERENCE_REQUEST_FAILURE,
        names.INFERENCE_COUNT,
        names.INFERENCE_EXEC_COUNT,
        names.INFERENCE_REQUEST_DURATION_US,
        names.INFERENCE_QUEUE_DURATION_US,
        names.INFERENCE_COMPUTE_INPUT_DURATION_US,
        names.INFERENCE_COMPUTE_INFER_DURATION_US,
        names.INFERENCE_COMPUTE_OUTPUT_DURATION_US,
        names.CACHE_NUM_HITS_PER_MODEL,
        names.CACHE_NUM_MISSES_PER_MODEL,
        names.CACHE_HIT_DURATION_PER_MODEL,
        names.CACHE_MISS_DURATION_PER_MODEL,
        names.ENERGY_CONSUMPTION,
        names.PROCESS_CPU_SECONDS_TOTAL,
        names.VLLM_NUM_PREEMPTIONS_TOTAL,
        names.VLLM_PROMPT_TOKENS_TOTAL,
        "vllm:prompt_tokens_by_source_total",
        "vllm:prompt_tokens_cached_total",
        names.VLLM_GENERATION_TOKENS_TOTAL,
        names.VLLM_PREFIX_CACHE_QUERIES_TOTAL,
        names.VLLM_PREFIX_CACHE_HITS_TOTAL,
        "vllm:request_success_total",
        *(f"{h}_{s}" for h in _HISTOGRAMS for s in ("bucket", "sum", "count")),
        *(f"{h}_{s}" for h in _SUMMARIES for s in ("sum", "count")),
        # dcgm-exporter's counters, from GPU agents (kiln monitor agent) in the fleet
        *(name for name, kind, _ in DCGM_FIELDS if kind == "counter"),
    }
)
GAUGES: frozenset[str] = frozenset(
    {
        names.INFERENCE_PENDING_REQUEST_COUNT,
        names.MODEL_LOAD_DURATION_SECS,
        names.KILN_MODEL_READY,
        names.CPU_UTILIZATION,
        names.CPU_MEMORY_TOTAL_BYTES,
        names.CPU_MEMORY_USED_BYTES,
        names.PROCESS_RESIDENT_MEMORY_BYTES,
        "process_virtual_memory_bytes",
        "process_open_fds",
        "process_max_fds",
        "process_start_time_seconds",
        names.KILN_GPU_CLOCK_EVENT_ACTIVE,
        names.VLLM_NUM_REQUESTS_RUNNING,
        names.VLLM_NUM_REQUESTS_WAITING,
        "vllm:num_requests_waiting_by_reason",
        "vllm:engine_sleep_state",
        names.VLLM_KV_CACHE_USAGE_PERC,
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
