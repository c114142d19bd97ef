"""vLLM's ``ObservabilityConfig`` switches that kiln's engine acts on: the KV-cache residency
histograms (``--kv-cache-metrics``, ``--kv-cache-metrics-sample``), the FLOPs and bytes
estimates (``--enable-mfu-metrics``) and the NaN-in-logits check
(``VLLM_COMPUTE_NANS_IN_LOGITS``). Importing this module does not import torch."""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field

from kiln.core.errors import KilnError, Status

#: vLLM's default ``--kv-cache-metrics-sample``: 1% of the blocks allocated
DEFAULT_KV_CACHE_METRICS_SAMPLE = 0.01
_TRUE = ("1", "true", "yes")
_FALSE = ("0", "false", "no")


def compute_nans_env() -> bool:
    """vLLM's ``VLLM_COMPUTE_NANS_IN_LOGITS=1`` (or ``VLLM_RAISE_ON_LOGIT_NANS=1``, which
    needs the count): count the NaNs in each sampled row of logits."""
    return any(
        os.environ.get(name, "0").strip().lower() in _TRUE
        for name in ("VLLM_COMPUTE_NANS_IN_LOGITS", "VLLM_RAISE_ON_LOGIT_NANS")
    )


def raise_on_nans_env() -> bool:
    """vLLM's ``VLLM_RAISE_ON_LOGIT_NANS=1``: a step whose logits hold a NaN fails."""
    return os.environ.get("VLLM_RAISE_ON_LOGIT_NANS", "0").strip().lower() in _TRUE


@dataclass(slots=True)
class ObservabilityConfig:
    """The switches, named as vLLM names them (all off by default, as in vLLM)."""

    #: ``vllm:kv_block_{lifetime,idle_before_evict,reuse_gap}_seconds``
    kv_cache_metrics: bool = False
    #: the share of allocated blocks those histograms follow, in (0, 1]
    kv_cache_metrics_sample: float = DEFAULT_KV_CACHE_METRICS_SAMPLE
    #: count ``vllm:estimated_{flops,read_bytes,write_bytes}_per_gpu_total``
    enable_mfu_metrics: bool = False
    #: ``vllm:corrupted_requests`` (read from the environment, as vLLM reads it)
    compute_nans_in_logits: bool = field(default_factory=compute_nans_env)

    def check(self) -> None:
        sample = self.kv_cache_metrics_sample
        if not (math.isfinite(sample) and 0 < sample <= 1):
            raise KilnError(
                f"llm backend: kv_cache_metrics_sample must be in (0, 1], got {sample}",
                Status.INVALID_ARG,
            )

    @classmethod
    def from_parameters(cls, read: Callable[[str], str | None], model: str) -> ObservabilityConfig:
        """From a model's parameters (``read``: a key's raw value, None when absent):
        ``kv_cache_metrics``, ``kv_cache_metrics_sample``, ``enable_mfu_metrics``."""
        out = cls()
        for key in ("kv_cache_metrics", "enable_mfu_metrics"):
            raw = read(key)
            if raw is None:
                continue
            text = raw.strip().lower()
            if text not in (*_TRUE, *_FALSE):
                raise KilnError(
                    f"model '{model}': parameter {key} must be true or false, got '{raw}'",
                    Status.INVALID_ARG,
                )
            setattr(out, key, text in _TRUE)
        raw = read("kv_cache_metrics_sample")
        if raw is not None:
            try:
                out.kv_cache_metrics_sample = float(raw)
            except ValueError:
                out.kv_cache_metrics_sample = math.nan
            if not (math.isfinite(out.kv_cache_metrics_sample)
                    and 0 < out.kv_cache_metrics_sample <= 1):  # fmt: skip
                raise KilnError(
                    f"model '{model}': parameter kv_cache_metrics_sample must be a number "
                    f"in (0, 1], got '{raw}'",
                    Status.INVALID_ARG,
                )
        return out
