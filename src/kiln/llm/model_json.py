"""``1/model.json`` of a Triton vLLM-backend model folder -> kiln's engine settings.

Triton's vLLM backend passes the file's keys to vLLM's ``AsyncEngineArgs``. kiln honours the
engine arguments its engine has, under vLLM's names, and refuses every other one by name at
load: a setting that changes what a model computes must never be dropped in silence.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kiln.core.errors import KilnError, Status
from kiln.llm.config import EngineConfig
from kiln.llm.lora import LoRAConfig, LoRAModulePath
from kiln.llm.profiler_config import ProfilerConfig
from kiln.llm.spec_config import SpeculativeConfig

log = logging.getLogger("kiln.llm")

FILENAME = "model.json"
#: the adapters of a model with ``enable_lora``, beside model.json (Triton's vLLM backend)
LORA_FILENAME = "multi_lora.json"
#: vLLM's LoRA engine arguments (read with ``enable_lora``)
_LORA_INTS = ("max_loras", "max_lora_rank", "max_cpu_loras")
#: vLLM's ``dtype`` spellings -> kiln's (``auto``: the engine's default, float32)
_DTYPES = {
    "float32": "float32",
    "float": "float32",
    "float16": "float16",
    "half": "float16",
    "bfloat16": "bfloat16",
}
#: vLLM engine arguments that change nothing kiln computes (logging, statistics)
_LOGGING_ONLY = frozenset(
    ("disable_log_requests", "enable_log_requests", "disable_log_stats", "max_log_len")
)
_BOOLEANS = {"true": True, "1": True, "false": False, "0": False}


@dataclass(frozen=True, slots=True)
class VLLMModel:
    """What ``model.json`` says: the weights' folder, the tokenizer's, the engine's limits."""

    folder: Path
    tokenizer: Path
    engine: EngineConfig


def _error(model: str, message: str) -> KilnError:
    return KilnError(f"model '{model}': {FILENAME}: {message}", Status.INVALID_ARG)


def _integer(model: str, key: str, value: Any) -> int:
    if isinstance(value, str) and value.strip().lstrip("-").isdigit():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise _error(model, f"'{key}' must be an integer, got {value!r}")
    return value


def _boolean(model: str, key: str, value: Any) -> bool:
    if isinstance(value, str) and value.strip().lower() in _BOOLEANS:
        return _BOOLEANS[value.strip().lower()]
    if not isinstance(value, bool):
        raise _error(model, f"'{key}' must be true or false, got {value!r}")
    return value


def _watermark(model: str, key: str, value: Any) -> float:
    try:
        number = float(value) if not isinstance(value, bool) else -1.0
    except (TypeError, ValueError):
        number = -1.0
    if not 0 <= number < 1:
        raise _error(model, f"'{key}' must be a number in [0, 1), got {value!r}")
    return number


def _fraction(model: str, key: str, value: Any) -> float:
    try:
        number = float(value) if not isinstance(value, bool) else -1.0
    except (TypeError, ValueError):
        number = -1.0
    if not 0 < number <= 1:
        raise _error(model, f"'{key}' must be a number in (0, 1], got {value!r}")
    return number


def _folder(model: str, key: str, value: Any, version_dir: Path) -> Path:
    if not isinstance(value, str) or not value:
        raise _error(model, f"'{key}' must be a path, got {value!r}")
    path = Path(value).expanduser()
    if not path.is_absolute():
        path = version_dir / path  # a relative path: beside model.json, not the cwd
    if not path.is_dir():
        # vLLM would download a hub id; kiln serves what is on disk
        raise _error(
            model,
            f"'{key}' is '{value}', which is not a local folder: kiln serves a Hugging Face "
            "folder on disk (download it first, e.g. `huggingface-cli download NAME "
            "--local-dir DIR`, and give DIR)",
        )
    return path


def _single(model: str, key: str, value: Any) -> None:
    if _integer(model, key, value) != 1:
        raise _error(
            model, f"'{key}' is {value}: kiln has no pipeline parallelism (1 only; docs/scaling.md)"
        )


def _at_least_one(model: str, key: str, value: Any) -> int:
    number = _integer(model, key, value)
    if number < 1:
        raise _error(model, f"'{key}' must be at least 1, got {value!r}")
    return number


def _not_true(model: str, key: str, value: Any) -> None:
    if _boolean(model, key, value):
        raise _error(model, f"'{key}': true is not supported (kiln runs no model code)")


def _speculative(model: str, value: Any) -> SpeculativeConfig:
    raw = value if isinstance(value, str) else json.dumps(value)
    try:
        return SpeculativeConfig.from_json(raw)
    except KilnError as exc:
        raise _error(model, str(exc).removeprefix("llm backend: ")) from None


def _profiler(model: str, value: Any) -> ProfilerConfig | None:
    try:
        return ProfilerConfig.parse(value if isinstance(value, str | dict) else json.dumps(value))
    except KilnError as exc:
        raise _error(model, str(exc).removeprefix("llm backend: ")) from None


#: vLLM engine argument -> (EngineConfig attribute, converter)
_SETTINGS: dict[str, tuple[str, Callable[[str, str, Any], Any]]] = {
    "max_model_len": ("max_model_len", lambda m, k, v: _integer(m, k, v)),
    "max_num_seqs": ("max_num_seqs", lambda m, k, v: _integer(m, k, v)),
    "max_num_batched_tokens": ("max_num_batched_tokens", lambda m, k, v: _integer(m, k, v)),
    "block_size": ("block_size", lambda m, k, v: _integer(m, k, v)),
    "num_gpu_blocks_override": ("num_gpu_blocks", lambda m, k, v: _integer(m, k, v)),
    "kv_cache_memory_bytes": ("kv_cache_memory_bytes", lambda m, k, v: _integer(m, k, v)),
    "tensor_parallel_size": ("tensor_parallel_size", lambda m, k, v: _at_least_one(m, k, v)),
    "stream_interval": ("stream_interval", lambda m, k, v: _at_least_one(m, k, v)),
    "max_logprobs": ("max_logprobs", lambda m, k, v: _integer(m, k, v)),
    "seed": ("seed", lambda m, k, v: _integer(m, k, v)),
    "enable_prefix_caching": ("enable_prefix_caching", lambda m, k, v: _boolean(m, k, v)),
    "enforce_eager": ("enforce_eager", lambda m, k, v: _boolean(m, k, v)),
    "scheduler_reserve_full_isl": (
        "scheduler_reserve_full_isl",
        lambda m, k, v: _boolean(m, k, v),
    ),
    "watermark": ("watermark", lambda m, k, v: _watermark(m, k, v)),
    "scheduling_policy": ("scheduling_policy", lambda m, k, v: str(v).strip().lower()),
    # vLLM's model.json holds it as an object (a JSON string is taken too)
    "speculative_config": (
        "speculative_config",
        lambda m, k, v: _speculative(m, v),
    ),
    "profiler_config": ("profiler_config", lambda m, k, v: _profiler(m, v)),
    "cuda_graph_sizes": (
        "cuda_graph_sizes",
        lambda m, k, v: tuple(_integer(m, k, s) for s in (v if isinstance(v, list) else [v])),
    ),
}


#: vLLM's observability arguments -> their converter (into ``EngineConfig.observability``)
_OBSERVABILITY: dict[str, Callable[[str, str, Any], Any]] = {
    "kv_cache_metrics": _boolean,
    "kv_cache_metrics_sample": _fraction,
    "enable_mfu_metrics": _boolean,
}


def _apply(model: str, raw: dict[str, Any], out: EngineConfig) -> None:
    """The engine arguments kiln has, checked, into ``out``; any other is refused."""
    checks: dict[str, Callable[[Any], None]] = {
        "dtype": lambda v: _dtype(model, v, out),
        "pipeline_parallel_size": lambda v: _single(model, "pipeline_parallel_size", v),
        "trust_remote_code": lambda v: _not_true(model, "trust_remote_code", v),
        "gpu_memory_utilization": lambda v: _memory_utilization(model, v),
    }
    known = (*_SETTINGS, *_OBSERVABILITY, *checks, *_LOGGING_ONLY)
    unknown = sorted(k for k in raw if k not in known)
    if unknown:
        raise _error(
            model,
            f"engine argument '{unknown[0]}' is not supported by kiln's engine "
            f"(supported: model, tokenizer, {', '.join(sorted(known))})",
        )
    for key, value in raw.items():
        if key in _SETTINGS:
            attribute, convert = _SETTINGS[key]
            setattr(out, attribute, convert(model, key, value))
        elif key in _OBSERVABILITY:
            setattr(out.observability, key, _OBSERVABILITY[key](model, key, value))
        elif key in checks:
            checks[key](value)


def _dtype(model: str, value: Any, out: EngineConfig) -> None:
    text = str(value).strip().lower()
    if text == "auto":
        return  # kiln's default (float32) until the checkpoint's own dtype is read
    if text not in _DTYPES:
        raise _error(model, f"'dtype' must be auto or one of {sorted(_DTYPES)}, got {value!r}")
    out.dtype = _DTYPES[text]


def _memory_utilization(model: str, value: Any) -> None:
    # Checked, then not used: kiln sizes the KV cache from kv_cache_memory_bytes (or
    # num_gpu_blocks_override), as vLLM's CPU backend ignores this argument too.
    fraction = _fraction(model, "gpu_memory_utilization", value)
    log.info(
        "model '%s': gpu_memory_utilization %.2f is not used; the KV cache is sized by "
        "kv_cache_memory_bytes",
        model,
        fraction,
    )


def load(model: str, version_dir: Path) -> VLLMModel:
    """Read ``version_dir/model.json``; errors name the file and the key."""
    path = version_dir / FILENAME
    if not path.is_file():
        raise KilnError(
            f"model '{model}': backend vllm needs '{FILENAME}' (vLLM engine arguments) in "
            f"{version_dir}",
            Status.INVALID_ARG,
        )
    try:
        raw = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise _error(model, f"not valid JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise _error(model, "must be a JSON object of vLLM engine arguments")
    raw = dict(raw)
    if "model" not in raw:
        raise _error(model, "'model' (the model's folder) is missing")
    folder = _folder(model, "model", raw.pop("model"), version_dir)
    tokenizer = raw.pop("tokenizer", None)
    tokens = folder if tokenizer is None else _folder(model, "tokenizer", tokenizer, version_dir)
    engine = EngineConfig()
    engine.lora_config = _lora(model, raw, version_dir)
    _apply(model, raw, engine)
    return VLLMModel(folder, tokens, engine)


def _lora(model: str, raw: dict[str, Any], version_dir: Path) -> LoRAConfig | None:
    """``enable_lora`` and vLLM's LoRA limits (taken out of ``raw``), and the adapters
    ``multi_lora.json`` names (``{"name": "folder", ...}``; a relative folder is beside
    model.json), as Triton's vLLM backend reads them; requests pick one by ``lora_name``."""
    enabled = _boolean(model, "enable_lora", raw.pop("enable_lora", False))
    limits = {k: _at_least_one(model, k, raw.pop(k)) for k in _LORA_INTS if k in raw}
    if not enabled:
        if limits:
            raise _error(model, f"'{next(iter(limits))}' needs 'enable_lora': true")
        return None
    path = version_dir / LORA_FILENAME
    if not path.is_file():
        raise _error(model, f"'enable_lora' is true, so the adapters must be named in {path} "
                     '(a JSON object: {"name": "adapter folder", ...})')  # fmt: skip
    try:
        entries = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise _error(model, f"{LORA_FILENAME} is not valid JSON: {exc}") from None
    if not isinstance(entries, dict) or not entries:
        raise _error(model, f"{LORA_FILENAME} must be a JSON object of adapter names to folders")
    modules = []
    for name, folder in entries.items():
        where = _folder(model, f"{LORA_FILENAME}: {name}", folder, version_dir)
        modules.append(LoRAModulePath(name, str(where)))
    config = LoRAConfig(
        max_loras=limits.get("max_loras", 1),
        max_lora_rank=limits.get("max_lora_rank", 16),
        max_cpu_loras=limits.get("max_cpu_loras"),
        lora_modules=tuple(modules),
    )
    try:
        config.check()
    except KilnError as exc:
        raise _error(model, str(exc).removeprefix("llm backend: ")) from None
    return config
