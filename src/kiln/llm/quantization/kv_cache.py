"""vLLM's ``--kv-cache-dtype``: the KV cache in the model's dtype (``auto``) or in fp8.

The cache holds K and V cast to fp8 with scale 1.0 (vLLM's default when a checkpoint
carries no calibrated ``k_scale``/``v_scale``); attention reads them back in the model's
dtype. Only the portable ``torch`` attention backend reads an fp8 cache: ``auto`` picks it,
an explicit ``cpu`` or ``flex`` backend is refused.
"""

from __future__ import annotations

import torch

from kiln.core.errors import KilnError, Status

KV_CACHE_DTYPES: dict[str, torch.dtype | None] = {
    "auto": None,
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}


def cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    if name not in KV_CACHE_DTYPES:
        raise KilnError(
            f"llm backend: kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, "
            f"got '{name}'",
            Status.INVALID_ARG,
        )
    return KV_CACHE_DTYPES[name] or model_dtype


def attention_backend(requested: str, resolved: str, dtype: torch.dtype) -> str:
    """The attention backend for a cache of ``dtype``: fp8 caches take ``torch``."""
    if dtype not in (torch.float8_e4m3fn, torch.float8_e5m2):
        return resolved
    if requested not in ("auto", "torch"):
        raise KilnError(
            f"llm backend: attention_backend '{requested}' cannot read an fp8 KV cache "
            "(kv_cache_dtype fp8); use attention_backend torch or auto",
            Status.INVALID_ARG,
        )
    return "torch"
