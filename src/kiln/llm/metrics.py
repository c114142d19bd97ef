"""vLLM's ``vllm:*`` families (names, types, labels, buckets, help), read at scrape time
from the engines of the loaded llm models, so a Grafana dashboard or alert rule written for
vLLM works on kiln unchanged. Labels: ``model_name`` (the served name) and ``engine`` (vLLM's
data-parallel engine index: kiln runs one engine per model, ``"0"``). Importing this module
does not import torch."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from kiln.llm.admission import REASONS
from kiln.llm.kv_cache_metrics import RESIDENCY_HISTOGRAMS
from kiln.llm.parser_metrics import MODES, OUTCOMES, REQUEST_TYPES
from kiln.llm.stats import FINISH_REASONS, HISTOGRAMS

if TYPE_CHECKING:
    from kiln.llm.engine_client import EngineClient

PREFIX = "vllm:"
LABELS = ("model_name", "engine")
ENGINE = "0"
#: ``vllm:prompt_tokens_by_source``'s ``source`` values (kiln has no external KV transfer)
PROMPT_SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")
#: ``vllm:prompt_tokens_cached_by_source``'s tiers (vLLM's ``CacheHitSource``): kiln's prefix
#: cache lives on the device alone
CACHE_HIT_SOURCES = ("device", "host", "p2p", "disk", "external_unspecified")
SLEEP_STATES = ("awake", "weights_offloaded", "discard_all")
CACHE_CONFIG_KEYS = (
    "block_size", "cache_dtype", "enable_prefix_caching", "num_gpu_blocks", "num_cpu_blocks",
    "kv_cache_size_tokens", "sliding_window",
)  # fmt: skip


def cache_config_info(engine: Any, blocks: int) -> dict[str, str]:
    """vLLM's ``CacheConfig.metrics_info()`` for the fields kiln has (Python ``str()`` of each
    value, as vLLM writes them); ``blocks``: the KV cache's."""
    config = engine.config
    return {
        "block_size": str(config.block_size),
        "cache_dtype": "auto",  # the KV cache is kept in the model's dtype
        "enable_prefix_caching": str(config.enable_prefix_caching),
        "num_gpu_blocks": str(blocks),
        "num_cpu_blocks": "None",
        "kv_cache_size_tokens": str(blocks * config.block_size),
        "sliding_window": str(engine.args.sliding_window),
    }


def _gauge(name: str, doc: str, extra: tuple[str, ...] = ()) -> GaugeMetricFamily:
    return GaugeMetricFamily(PREFIX + name, doc, labels=(*LABELS, *extra))


def _counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> CounterMetricFamily:
    # rendered ``vllm:<name>_total``, as prometheus_client renders vLLM's counters
    return CounterMetricFamily(PREFIX + name, doc, labels=(*LABELS, *extra))


class LLMCollector(Collector):
    def __init__(self, engines: Callable[[], Mapping[str, EngineClient]]) -> None:
        """``engines``: the ready LLM models' engines by name (``Server.llm_engines``)."""
        self.engines = engines

    def collect(self) -> Iterator[Metric]:
        running = _gauge("num_requests_running", "Number of requests in model execution batches.")
        waiting = _gauge("num_requests_waiting", "Number of requests waiting to be processed.")
        by_reason = _gauge(
            "num_requests_waiting_by_reason",
            "Number of waiting requests by reason. Reason labels: 'capacity' = waiting for "
            "scheduling capacity; 'deferred' = deferred by transient constraints. Sum of all "
            "reasons equals vllm:num_requests_waiting.",
            ("reason",),
        )
        sleep = _gauge(
            "engine_sleep_state",
            "Engine sleep state; awake = 0 means engine is sleeping; awake = 1 means engine is "
            "awake; weights_offloaded = 1 means sleep level 1; discard_all = 1 means sleep "
            "level 2.",
            ("sleep_state",),
        )
        usage = _gauge("kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")
        queries = _counter(
            "prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens."
        )
        hits = _counter(
            "prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens."
        )
        preemptions = _counter(
            "num_preemptions", "Cumulative number of preemption from the engine."
        )
        prompt = _counter("prompt_tokens", "Number of prefill tokens processed.")
        by_source = _counter(
            "prompt_tokens_by_source", "Number of prompt tokens by source.", ("source",)
        )
        cached = _counter(
            "prompt_tokens_cached", "Number of cached prompt tokens (local + external)."
        )
        cached_by_source = _counter(
            "prompt_tokens_cached_by_source",
            "Prefix-cache hit tokens by the cache tier that supplied them: device (local "
            "HBM), host (offloaded to DRAM), disk, p2p (transferred from another instance) or "
            "external_unspecified. Counted at admission; sums to vllm:prefix_cache_hits + "
            "vllm:external_prefix_cache_hits.",
            ("source",),
        )
        # vLLM labels it with model_name alone: the frontend counts it, not an engine
        rejections = CounterMetricFamily(
            PREFIX + "admission_rejections",
            "Number of admission attempts rejected by a queue limit, by reason.",
            labels=("model_name", "reason"),
        )
        generation = _counter("generation_tokens", "Number of generation tokens processed.")
        success = _counter(
            "request_success", "Count of successfully processed requests.", ("finished_reason",)
        )
        histograms = [
            HistogramMetricFamily(PREFIX + name, doc, labels=LABELS) for name, doc, _ in HISTOGRAMS
        ]
        # vLLM serves one model and leaves model_name off; kiln adds it to tell models apart
        info = GaugeMetricFamily(
            PREFIX + "cache_config_info",
            "Information of the LLMEngine CacheConfig",
            labels=(*LABELS, *CACHE_CONFIG_KEYS),
        )
        clients = self.engines()
        engines = [(name, client.engine) for name, client in clients.items()]
        if not engines:
            return  # no llm model: no vllm:* family at all
        for name, engine in engines:
            labels = [name, ENGINE]
            # the engine's own figures, or (its own process) the last it sent
            stats, counts = engine.stats, clients[name].engine_counts()
            running.add_metric(labels, counts.num_running)
            waiting.add_metric(labels, counts.num_waiting)
            by_reason.add_metric([*labels, "capacity"], counts.num_waiting)
            by_reason.add_metric([*labels, "deferred"], 0)
            asleep, level = clients[name].sleep_state
            flags = {"awake": 1 - asleep, "weights_offloaded": int(asleep and level == 1),
                     "discard_all": int(asleep and level == 2)}  # fmt: skip
            for state in SLEEP_STATES:
                sleep.add_metric([*labels, state], flags[state])
            usage.add_metric(labels, counts.kv_cache_usage)
            queries.add_metric(labels, counts.prefix_cache_queries)
            hits.add_metric(labels, counts.prefix_cache_hits)
            for source in CACHE_HIT_SOURCES:
                value = counts.prefix_cache_hits if source == "device" else 0
                cached_by_source.add_metric([*labels, source], value)
            refused = clients[name].admission_rejections()
            for reason in REASONS:
                rejections.add_metric([name, reason], refused.get(reason, 0))
            preemptions.add_metric(labels, counts.num_preemptions)
            prompt.add_metric(labels, stats.num_prompt_tokens)
            computed = stats.num_prompt_tokens - stats.num_prompt_tokens_cached
            for source, value in zip(
                PROMPT_SOURCES, (computed, stats.num_prompt_tokens_cached, 0), strict=True
            ):
                by_source.add_metric([*labels, source], value)
            cached.add_metric(labels, stats.num_prompt_tokens_cached)
            generation.add_metric(labels, stats.num_generation_tokens)
            reasons = dict(stats.request_success)
            for reason in (*FINISH_REASONS, *(r for r in reasons if r not in FINISH_REASONS)):
                success.add_metric([*labels, reason], reasons.get(reason, 0))
            for family, (_, _, attr) in zip(histograms, HISTOGRAMS, strict=True):
                buckets, total = getattr(stats.histograms, attr).snapshot()
                family.add_metric(labels, buckets, total)
            config = cache_config_info(engine, counts.num_blocks)
            info.add_metric([*labels, *(config[k] for k in CACHE_CONFIG_KEYS)], 1)
        yield from (running, waiting, by_reason, sleep, usage, queries, hits, preemptions)
        yield from (prompt, by_source, cached, cached_by_source, generation, success)
        yield rejections
        yield from histograms
        yield info
        yield from _spec_decode(engines)
        yield from _lora(engines)
        yield from _residency(engines)
        yield from _perf(engines)
        yield from _corrupted(engines)
        yield from _tool_parser(clients)


def _spec_decode(engines: list[tuple[str, Any]]) -> Iterator[Metric]:
    """vLLM's ``spec_decode_*`` counters, for the engines with speculative decoding on
    (vLLM has none of these families without it)."""
    speculating = [(n, e.spec_stats) for n, e in engines if e.spec_stats is not None]
    if not speculating:
        return
    drafts = _counter("spec_decode_num_drafts", "Number of spec decoding drafts.")
    draft_tokens = _counter("spec_decode_num_draft_tokens", "Number of draft tokens.")
    accepted = _counter("spec_decode_num_accepted_tokens", "Number of accepted tokens.")
    per_pos = _counter(
        "spec_decode_num_accepted_tokens_per_pos",
        "Accepted tokens per draft position.",
        ("position",),
    )
    for name, stats in speculating:
        labels = [name, ENGINE]
        drafts.add_metric(labels, stats.num_drafts)
        draft_tokens.add_metric(labels, stats.num_draft_tokens)
        accepted.add_metric(labels, stats.num_accepted_tokens)
        for pos, count in enumerate(stats.accepted_per_pos):
            per_pos.add_metric([*labels, str(pos)], count)
    yield from (drafts, draft_tokens, accepted, per_pos)


def _lora(engines: list[tuple[str, Any]]) -> Iterator[Metric]:
    """vLLM's ``lora_requests_info``, for the engines with LoRA enabled: the adapters of
    the running and waiting requests (comma separated), the value the time it was read."""
    serving = [(n, e) for n, e in engines if e.config.lora_config is not None]
    if not serving:
        return
    family = _gauge(
        "lora_requests_info",
        "Running stats on lora requests.",
        ("max_lora", "waiting_lora_adapters", "running_lora_adapters"),
    )
    for name, engine in serving:
        waiting, running = engine.loras_in_use()
        max_lora = str(engine.config.lora_config.max_loras)
        family.add_metric([name, ENGINE, max_lora, waiting, running], time.time())
    yield family


def _residency(engines: list[tuple[str, Any]]) -> Iterator[Metric]:
    """vLLM's KV-cache residency histograms, for the engines with ``--kv-cache-metrics``
    (vLLM has none of these families without it)."""
    following = [(n, e.stats.kv_residency) for n, e in engines if e.stats.kv_residency is not None]
    if not following:
        return
    for family, doc, attr in RESIDENCY_HISTOGRAMS:
        out = HistogramMetricFamily(PREFIX + family, doc, labels=LABELS)
        for name, residency in following:
            buckets, total = getattr(residency, attr).snapshot()
            out.add_metric([name, ENGINE], buckets, total)
        yield out


def _perf(engines: list[tuple[str, Any]]) -> Iterator[Metric]:
    """vLLM's MFU estimates: its logger creates them whatever ``--enable-mfu-metrics``
    says; they count only with it."""
    doc = "(for Model Flops Utilization calculations)."
    flops = _counter(
        "estimated_flops_per_gpu", f"Estimated number of floating point operations per GPU {doc}"
    )
    read = _counter(
        "estimated_read_bytes_per_gpu", f"Estimated number of bytes read from memory per GPU {doc}"
    )
    write = _counter("estimated_write_bytes_per_gpu",
                     f"Estimated number of bytes written to memory per GPU {doc}")  # fmt: skip
    for name, engine in engines:
        stats = engine.stats
        flops.add_metric([name, ENGINE], stats.estimated_flops)
        read.add_metric([name, ENGINE], stats.estimated_read_bytes)
        write.add_metric([name, ENGINE], stats.estimated_write_bytes)
    yield from (flops, read, write)


def _corrupted(engines: list[tuple[str, Any]]) -> Iterator[Metric]:
    """vLLM's ``corrupted_requests``: only with ``VLLM_COMPUTE_NANS_IN_LOGITS=1``."""
    checking = [(n, e) for n, e in engines if e.config.observability.compute_nans_in_logits]
    if not checking:
        return
    family = _counter(
        "corrupted_requests",
        "Corrupted requests, in terms of total number of requests with NaNs in logits.",
    )
    for name, engine in checking:
        family.add_metric([name, ENGINE], engine.stats.num_corrupted_reqs)
    yield family


def _tool_parser(clients: Mapping[str, EngineClient]) -> Iterator[Metric]:
    """vLLM's ``tool_call_parser_invocations``, for the models with a
    ``--tool-call-parser`` (labelled ``model_name``: the frontend counts, not an engine)."""
    parsing = [
        (n, c.tool_parser_invocations)
        for n, c in clients.items()
        if c.tool_parser_invocations is not None
    ]
    if not parsing:
        return
    family = CounterMetricFamily(
        PREFIX + "tool_call_parser_invocations",
        "Total number of ToolParser invocations. Non-streaming increments once per choice; "
        "streaming increments once per delta.",
        labels=("model_name", "mode", "outcome", "request_type"),
    )
    for name, counter in parsing:
        assert counter is not None
        counts = counter.counts()
        for key in ((m, o, r) for m in MODES for o in OUTCOMES for r in REQUEST_TYPES):
            family.add_metric([name, *key], counts.get(key, 0))
    yield family
