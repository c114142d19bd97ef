"""ONNX Runtime execution providers from a model config, as Triton's onnxruntime backend reads them.

``optimization.execution_accelerators.gpu_execution_accelerator`` names ``tensorrt`` and/or
``cuda``; each one's ``parameters`` carry Triton's keys, translated here to ONNX Runtime's
provider options. A pure function of (config, instance, available providers), so every
combination is testable without a GPU.
"""

from __future__ import annotations

import logging
from typing import Any

from kiln.config.model_config_pb2 import ModelConfig
from kiln.core.errors import KilnError, Status

Provider = str | tuple[str, dict[str, Any]]

log = logging.getLogger("kiln.onnxruntime")
_preloaded = False

CPU = "CPUExecutionProvider"
CUDA = "CUDAExecutionProvider"
TENSORRT = "TensorrtExecutionProvider"

# Triton's TensorRT accelerator keys -> ORT TensorRT EP options ("precision_mode" apart).
_TRT_KEYS = {
    "max_workspace_size_bytes": ("trt_max_workspace_size", int),
    "trt_max_partition_iterations": ("trt_max_partition_iterations", int),
    "trt_min_subgraph_size": ("trt_min_subgraph_size", int),
    "trt_engine_cache_enable": ("trt_engine_cache_enable", "bool"),
    "trt_engine_cache_path": ("trt_engine_cache_path", str),
    "trt_timing_cache_enable": ("trt_timing_cache_enable", "bool"),
    "trt_timing_cache_path": ("trt_timing_cache_path", str),
    "trt_layer_norm_fp32_fallback": ("trt_layer_norm_fp32_fallback", "bool"),
}
# Triton's CUDA accelerator keys -> ORT CUDA EP options.
_CUDA_KEYS = {
    "gpu_mem_limit": ("gpu_mem_limit", int),
    "arena_extend_strategy": ("arena_extend_strategy", int),
    "cudnn_conv_algo_search": ("cudnn_conv_algo_search", int),
    "cudnn_conv_use_max_workspace": ("cudnn_conv_use_max_workspace", "bool"),
    "do_copy_in_default_stream": ("do_copy_in_default_stream", "bool"),
    "use_ep_level_unified_stream": ("use_ep_level_unified_stream", "bool"),
}
# Triton passes cudnn_conv_algo_search as 0/1/2; ORT's Python API takes the names.
_CONV_SEARCH = {0: "EXHAUSTIVE", 1: "HEURISTIC", 2: "DEFAULT"}
_ARENA = {0: "kNextPowerOfTwo", 1: "kSameAsRequested"}
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def execution_providers(
    config: ModelConfig, kind: str, device_id: int, available: list[str]
) -> list[Provider]:
    """The ``providers=`` list for one instance (``kind`` ``"cpu"`` or ``"gpu"``)."""
    if kind != "gpu":
        return [CPU]
    if CUDA not in available:
        raise KilnError(
            f"model '{config.name}' asks for KIND_GPU but onnxruntime has no CUDA execution "
            "provider (install kiln-serve[gpu] on a machine with an NVIDIA GPU)",
            Status.UNAVAILABLE,
        )
    providers: list[Provider] = []
    cuda: dict[str, Any] = {"device_id": device_id}
    for acc in config.optimization.execution_accelerators.gpu_execution_accelerator:
        params = dict(acc.parameters)
        if acc.name == "tensorrt":
            if TENSORRT not in available:
                raise KilnError(
                    f"model '{config.name}' asks for the tensorrt execution accelerator, but "
                    f"this onnxruntime has no TensorRT execution provider (it has "
                    f"{', '.join(available)}); install onnxruntime-gpu with TensorRT",
                    Status.UNAVAILABLE,
                )
            providers.append((TENSORRT, _tensorrt_options(config.name, device_id, params)))
        elif acc.name == "cuda":
            cuda.update(_options(config.name, "cuda", params, _CUDA_KEYS))
        else:
            raise KilnError(
                f"model '{config.name}': unknown Execution Accelerator '{acc.name}' is "
                "requested (gpu_execution_accelerator takes tensorrt, cuda)",
                Status.INVALID_ARG,
            )
    if "cudnn_conv_algo_search" in cuda:
        cuda["cudnn_conv_algo_search"] = _named(
            config.name, "cudnn_conv_algo_search", cuda["cudnn_conv_algo_search"], _CONV_SEARCH
        )
    if "arena_extend_strategy" in cuda:
        cuda["arena_extend_strategy"] = _named(
            config.name, "arena_extend_strategy", cuda["arena_extend_strategy"], _ARENA
        )
    providers.append((CUDA, cuda))
    providers.append(CPU)
    return providers


def preload_cuda_libraries(ort: Any) -> None:
    """Load the CUDA and cuDNN libraries of NVIDIA's pip wheels before a CUDA session.

    onnxruntime-gpu finds ``libcudart``/``libcublas``/``libcudnn`` through the loader's path
    only, so with CUDA installed as pip wheels (``nvidia-*``, what torch brings) its CUDA EP
    fails to start unless torch happens to be imported first. ``onnxruntime.preload_dlls``
    (1.21+) loads them from those wheels; once per process, and harmless when they are on the
    loader's path already.
    """
    global _preloaded
    if _preloaded or not hasattr(ort, "preload_dlls"):
        return
    _preloaded = True
    try:
        ort.preload_dlls()
    except Exception as exc:  # a failed preload leaves the loader's own search to try
        log.warning("onnxruntime.preload_dlls() failed: %s", exc)


def check_session_providers(
    model: str, device_id: int, asked: list[Provider], got: list[str]
) -> None:
    """Refuse a session that dropped a GPU provider it was given.

    ONNX Runtime logs an error and falls back to the next provider when one fails to start
    (the CUDA EP without its cuDNN or cuBLAS, the TensorRT EP without libnvinfer): a KIND_GPU
    instance would then run on the CPU, silently and many times slower.
    """
    names = [p if isinstance(p, str) else p[0] for p in asked]
    missing = [n for n in names if n != CPU and n not in got]
    if missing:
        raise KilnError(
            f"model '{model}': onnxruntime could not start the {' and '.join(missing)} on GPU "
            f"{device_id} and fell back to {', '.join(got)} (onnxruntime's log above says why: "
            "usually a CUDA, cuDNN or TensorRT library that onnxruntime-gpu needs is missing)",
            Status.UNAVAILABLE,
        )


def _tensorrt_options(model: str, device_id: int, params: dict[str, str]) -> dict[str, Any]:
    options: dict[str, Any] = {"device_id": device_id}
    precision = params.pop("precision_mode", "FP32").upper()
    if precision == "FP16":
        options["trt_fp16_enable"] = True
    elif precision == "INT8":
        options["trt_int8_enable"] = True
    elif precision != "FP32":
        raise KilnError(
            f"model '{model}': tensorrt precision_mode '{precision}' is not one of "
            "FP32, FP16, INT8",
            Status.INVALID_ARG,
        )
    options.update(_options(model, "tensorrt", params, _TRT_KEYS))
    if "trt_engine_cache_path" in options:
        # A cache path with the cache off would silently rebuild every load.
        options.setdefault("trt_engine_cache_enable", True)
    return options


def _options(
    model: str, accelerator: str, params: dict[str, str], keys: dict[str, tuple[str, Any]]
) -> dict[str, Any]:
    options: dict[str, Any] = {}
    for key, raw in params.items():
        if key not in keys:
            raise KilnError(
                f"model '{model}': unknown parameter '{key}' for the {accelerator} execution "
                f"accelerator (known: {', '.join(sorted(keys))})",
                Status.INVALID_ARG,
            )
        option, kind = keys[key]
        options[option] = _convert(model, accelerator, key, raw, kind)
    return options


def _convert(model: str, accelerator: str, key: str, raw: str, kind: Any) -> Any:
    text = raw.strip()
    if kind == "bool":
        if text.lower() in _TRUE:
            return True
        if text.lower() in _FALSE:
            return False
    elif kind is int:
        try:
            return int(text)
        except ValueError:
            pass
    else:
        return text
    expected = "true or false" if kind == "bool" else "an integer"
    raise KilnError(
        f"model '{model}': {accelerator} accelerator parameter '{key}' must be {expected}, "
        f"got '{raw}'",
        Status.INVALID_ARG,
    )


def _named(model: str, key: str, value: int, names: dict[int, str]) -> str:
    if value not in names:
        raise KilnError(
            f"model '{model}': cuda accelerator parameter '{key}' must be one of "
            f"{', '.join(str(k) for k in names)}, got {value}",
            Status.INVALID_ARG,
        )
    return names[value]
