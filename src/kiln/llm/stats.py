"""What the engine counts and ``/metrics`` exposes as vLLM's ``vllm:*`` families: the
same names, buckets and meaning, so dashboards and alert rules written for vLLM read
kiln's figures as they are.

The engine thread observes; the metrics thread reads at scrape time. Each histogram takes a
lock for both, so a scrape never sees a count that disagrees with its buckets. Importing
this module does not import torch.
"""

from __future__ import annotations

import bisect
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kiln.llm.kv_cache_metrics import KVCacheResidency

#: vLLM's ``time_to_first_token_seconds`` buckets
TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
#: vLLM's ``inter_token_latency_seconds`` and ``request_time_per_output_token_seconds``
ITL_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
#: vLLM's buckets for whole-request intervals (e2e, queue, prefill, decode, inference)
REQUEST_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
    60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
#: vLLM's ``iteration_tokens_total`` buckets
ITERATION_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
#: vLLM's ``request_params_n`` buckets
N_BUCKETS = (1, 2, 5, 10, 20)
#: vLLM's ``request_num_preemptions`` buckets (the first holds never-preempted requests too)
PREEMPTION_BUCKETS = (1, 2, 3, 4, 5, 10, 20)
#: the ``finished_reason`` values of ``vllm:request_success`` (vLLM's ``FinishReason``)
FINISH_REASONS = ("stop", "length", "abort", "error")


def buckets_1_2_5(max_value: int) -> tuple[int, ...]:
    """vLLM's token-count buckets: 1, 2, 5, 10, 20, 50, ... up to ``max_value``."""
    out: list[int] = []
    scale = 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_value:
                return tuple(out)
            out.append(m * scale)
        scale *= 10


@dataclass(slots=True)
class Histogram:
    """Prometheus-style: per-bucket counts (non-cumulative here), sum and count."""

    buckets: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    count: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        self.counts = [0] * (len(self.buckets) + 1)  # the last one is +Inf

    def observe(self, value: float) -> None:
        with self.lock:
            # ``le`` is inclusive: a value equal to a bound belongs to that bucket
            self.counts[bisect.bisect_left(self.buckets, value)] += 1
            self.total += value
            self.count += 1

    def snapshot(self) -> tuple[list[tuple[str, float]], float]:
        """Cumulative ``(le, count)`` pairs ending with ``+Inf``, and the sum."""
        with self.lock:
            counts, total = list(self.counts), self.total
        out: list[tuple[str, float]] = []
        running = 0
        for bound, n in zip((*(_le(b) for b in self.buckets), "+Inf"), counts, strict=True):
            running += n
            out.append((bound, float(running)))
        return out, total


def _le(bound: float) -> str:
    # prometheus_client writes every bound as a float ("1.0", "0.005"): so does vLLM
    return repr(float(bound))


#: (vLLM family after ``vllm:``, help, the ``RequestHistograms`` field it reads)
HISTOGRAMS = (
    ("time_to_first_token_seconds", "Histogram of time to first token in seconds.",
     "time_to_first_token"),
    ("inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
     "inter_token_latency"),
    ("request_time_per_output_token_seconds",
     "Histogram of time_per_output_token_seconds per request.", "time_per_output_token"),
    ("e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
     "e2e_request_latency"),
    ("request_queue_time_seconds", "Histogram of time spent in WAITING phase for request.",
     "queue_time"),
    ("request_inference_time_seconds",
     "Histogram of time spent in RUNNING phase for request.", "inference_time"),
    ("request_prefill_time_seconds", "Histogram of time spent in PREFILL phase for request.",
     "prefill_time"),
    ("request_decode_time_seconds", "Histogram of time spent in DECODE phase for request.",
     "decode_time"),
    ("request_prompt_tokens", "Number of prefill tokens processed.", "prompt_tokens"),
    ("request_generation_tokens", "Number of generation tokens processed.",
     "generation_tokens"),
    ("request_prefill_kv_computed_tokens",
     "Histogram of new KV tokens computed during prefill (excluding cached tokens).",
     "prefill_kv_computed_tokens"),
    ("request_max_num_generation_tokens",
     "Histogram of maximum number of requested generation tokens.",
     "max_num_generation_tokens"),
    ("request_params_n", "Histogram of the n request parameter.", "params_n"),
    ("request_params_max_tokens", "Histogram of the max_tokens request parameter.",
     "params_max_tokens"),
    ("iteration_tokens_total", "Histogram of number of tokens per engine_step.",
     "iteration_tokens"),
    ("request_num_preemptions", "Histogram of the number of times a request was preempted.",
     "num_preemptions"),
)  # fmt: skip


@dataclass(slots=True)
class RequestHistograms:
    """One engine's histograms. A "request" is one of the ``n`` samples of an API request,
    as in vLLM, whose parallel sampling runs each sample as a child request; ``params_n``
    and ``max_num_generation_tokens`` are observed once per API request."""

    time_to_first_token: Histogram
    inter_token_latency: Histogram
    time_per_output_token: Histogram
    e2e_request_latency: Histogram
    queue_time: Histogram
    inference_time: Histogram
    prefill_time: Histogram
    decode_time: Histogram
    prompt_tokens: Histogram
    generation_tokens: Histogram
    prefill_kv_computed_tokens: Histogram
    max_num_generation_tokens: Histogram
    params_n: Histogram
    params_max_tokens: Histogram
    iteration_tokens: Histogram
    num_preemptions: Histogram

    @classmethod
    def for_model(cls, max_model_len: int) -> RequestHistograms:
        tokens = buckets_1_2_5(max_model_len)
        fields = {
            "time_to_first_token": TTFT_BUCKETS,
            "inter_token_latency": ITL_BUCKETS,
            "time_per_output_token": ITL_BUCKETS,
            "params_n": N_BUCKETS,
            "iteration_tokens": ITERATION_BUCKETS,
            "num_preemptions": PREEMPTION_BUCKETS,
            **dict.fromkeys(
                ("e2e_request_latency", "queue_time", "inference_time", "prefill_time",
                 "decode_time"), REQUEST_BUCKETS,
            ),
            **dict.fromkeys(
                ("prompt_tokens", "generation_tokens", "prefill_kv_computed_tokens",
                 "max_num_generation_tokens", "params_max_tokens"), tokens,
            ),
        }  # fmt: skip
        return cls(**{name: Histogram(buckets) for name, buckets in fields.items()})


@dataclass(slots=True)
class EngineStats:
    """Counters (read without a lock: each is one int the engine thread alone writes) and
    the histograms."""

    histograms: RequestHistograms
    num_steps: int = 0
    #: prompt tokens of the requests that produced their first token (vLLM's
    #: ``prompt_tokens``); of them, found in the prefix cache (``prompt_tokens_cached``)
    num_prompt_tokens: int = 0
    num_prompt_tokens_cached: int = 0
    num_generation_tokens: int = 0
    #: the most tokens one step ran (the budget bounds it)
    max_step_tokens: int = 0
    #: finished samples per ``finished_reason``
    request_success: dict[str, int] = field(
        default_factory=lambda: dict.fromkeys(FINISH_REASONS, 0)
    )
    #: vLLM's ``--kv-cache-metrics`` histograms (None: the switch is off)
    kv_residency: KVCacheResidency | None = None
    #: vLLM's ``--enable-mfu-metrics`` estimates, summed over the steps (per GPU)
    estimated_flops: int = 0
    estimated_read_bytes: int = 0
    estimated_write_bytes: int = 0
    #: finished samples whose logits held a NaN (``VLLM_COMPUTE_NANS_IN_LOGITS``)
    num_corrupted_reqs: int = 0
