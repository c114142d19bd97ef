"""``kiln.metrics.names``: every name is one the alert rules may use (what the exporters
export), and the vLLM names are the families ``kiln.llm.metrics`` defines."""

from __future__ import annotations

from kiln.llm.metrics import PREFIX
from kiln.llm.stats import HISTOGRAMS
from kiln.metrics import names
from kiln.monitoring.snapshot import KNOWN_METRICS


def _names() -> dict[str, str]:
    return {k: v for k, v in vars(names).items() if k.isupper() and isinstance(v, str)}


def test_every_name_is_an_exported_family() -> None:
    # a histogram is known by its samples (``_bucket``, ``_sum``, ``_count``)
    unknown = {
        k: v
        for k, v in _names().items()
        if v not in KNOWN_METRICS and f"{v}_bucket" not in KNOWN_METRICS
    }
    assert not unknown


def test_names_are_unique_and_spelled_as_the_field_does() -> None:
    values = list(_names().values())
    assert len(values) == len(set(values))
    assert names.INFERENCE_REQUEST_SUCCESS == "nv_inference_request_success"
    assert names.DCGM_FI_DEV_GPU_UTIL == "DCGM_FI_DEV_GPU_UTIL"
    assert all(v.startswith(PREFIX) for k, v in _names().items() if k.startswith("VLLM_"))
    latency = {f"{PREFIX}{h[0]}" for h in HISTOGRAMS}
    assert names.VLLM_TIME_TO_FIRST_TOKEN_SECONDS in latency
    assert names.VLLM_INTER_TOKEN_LATENCY_SECONDS in latency
