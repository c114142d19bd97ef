"""``kiln_llm_*`` families (vLLM's names under kiln's prefix), read at scrape time from the
engines of the loaded llm models. Importing this module does not import torch."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from kiln.backends.registry import LLM_BACKENDS

LABELS = ("model_name",)
#: (family name, help, the ``LatencyStats`` field it reads)
HISTOGRAMS = (
    (
        "kiln_llm_time_to_first_token_seconds",
        "Time from a request's arrival to its first generated token",
        "time_to_first_token",
    ),
    (
        "kiln_llm_inter_token_latency_seconds",
        "Time between two consecutive tokens of one sequence",
        "inter_token_latency",
    ),
    (
        "kiln_llm_e2e_request_latency_seconds",
        "Time from a request's arrival to its last sample leaving the engine",
        "e2e_request_latency",
    ),
    (
        "kiln_llm_request_queue_time_seconds",
        "Time a request waited before it was first scheduled",
        "request_queue_time",
    ),
)


def _engines(runtimes: Iterable[Any]) -> Iterator[tuple[str, Any]]:
    for rt in runtimes:
        for instance in getattr(getattr(rt, "scheduler", None), "instances", ()):
            if getattr(instance.backend, "name", "") in LLM_BACKENDS:
                yield rt.name, instance.backend.engine


class LLMCollector(Collector):
    def __init__(self, runtimes: Callable[[], Iterable[Any]]) -> None:
        self.runtimes = runtimes

    def collect(self) -> Iterator[Metric]:
        running = GaugeMetricFamily(
            "kiln_llm_num_requests_running", "Requests in the running batch", labels=LABELS
        )
        waiting = GaugeMetricFamily(
            "kiln_llm_num_requests_waiting", "Requests waiting to be scheduled", labels=LABELS
        )
        usage = GaugeMetricFamily(
            "kiln_llm_kv_cache_usage_perc",
            "KV-cache usage: 1 means all blocks are held by sequences",
            labels=LABELS,
        )
        preemptions = CounterMetricFamily(
            "kiln_llm_num_preemptions", "Cumulative number of preemptions", labels=LABELS
        )
        prompt = CounterMetricFamily(
            "kiln_llm_prompt_tokens", "Prefill tokens processed", labels=LABELS
        )
        generation = CounterMetricFamily(
            "kiln_llm_generation_tokens", "Generation tokens processed", labels=LABELS
        )
        queries = CounterMetricFamily(
            "kiln_llm_prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache at admission",
            labels=LABELS,
        )
        hits = CounterMetricFamily(
            "kiln_llm_prefix_cache_hits",
            "Prompt tokens found in the prefix cache (not recomputed)",
            labels=LABELS,
        )
        histograms = [HistogramMetricFamily(n, doc, labels=LABELS) for n, doc, _ in HISTOGRAMS]
        for name, engine in _engines(self.runtimes()):
            sched = engine.scheduler
            running.add_metric([name], len(sched.running))
            waiting.add_metric([name], len(sched.waiting))
            usage.add_metric([name], engine.block_manager.usage())
            preemptions.add_metric([name], sched.num_preemptions)
            prompt.add_metric([name], engine.stats.num_prompt_tokens)
            generation.add_metric([name], engine.stats.num_generation_tokens)
            queries.add_metric([name], engine.block_manager.stats.queries)
            hits.add_metric([name], engine.block_manager.stats.hits)
            for family, (_, _, attr) in zip(histograms, HISTOGRAMS, strict=True):
                buckets, total = getattr(engine.stats.latency, attr).snapshot()
                family.add_metric([name], buckets, total)
        yield from (running, waiting, usage, preemptions, prompt, generation, queries, hits)
        yield from histograms
