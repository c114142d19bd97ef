"""vLLM's observability switches on ``kiln serve`` (``--kv-cache-metrics``,
``--kv-cache-metrics-sample``, ``--enable-mfu-metrics``): engine flags like the others, a
config.pbtxt's parameters of the same names (docs/metrics.md)."""

from __future__ import annotations

import click

#: flag (its Python name) -> the llm backend's parameter key
OBSERVABILITY_FLAGS = {
    "kv_cache_metrics": "kv_cache_metrics",
    "kv_cache_metrics_sample": "kv_cache_metrics_sample",
    "enable_mfu_metrics": "enable_mfu_metrics",
}

OBSERVABILITY_OPTIONS = [
    click.option(
        "--kv-cache-metrics",
        is_flag=True,
        default=None,
        help="Export vLLM's KV-cache residency histograms (vllm:kv_block_lifetime_seconds, "
        "vllm:kv_block_idle_before_evict_seconds, vllm:kv_block_reuse_gap_seconds) for a "
        "sample of the blocks.",
    ),
    click.option(
        "--kv-cache-metrics-sample",
        type=click.FloatRange(0, 1, min_open=True),
        default=None,
        help="The share of KV blocks --kv-cache-metrics follows, in (0, 1] [default: 0.01].",
    ),
    click.option(
        "--enable-mfu-metrics",
        is_flag=True,
        default=None,
        help="Count vLLM's per-step FLOPs and memory-traffic estimates "
        "(vllm:estimated_{flops,read_bytes,write_bytes}_per_gpu_total).",
    ),
]
