"""Which backend serves a config: by ``backend``, by ``platform``, or by the file present."""

from __future__ import annotations

import importlib
from pathlib import Path

from kiln.backends.base import Backend
from kiln.config.model_config_pb2 import ModelConfig
from kiln.core.errors import KilnError, Status

# backend name -> (module, class, pip extra that provides it)
_BACKENDS: dict[str, tuple[str, str, str]] = {
    "onnxruntime": ("kiln.backends.onnxruntime", "OnnxRuntimeBackend", ""),
    # no compute of its own: its runtime schedules the composing models' steps
    "ensemble": ("kiln.scheduling.ensemble", "EnsembleBackend", ""),
    "python": ("kiln.backends.python.backend", "PythonBackend", ""),
    # importing it imports torch: a missing torch becomes the install hint below
    "pytorch": ("kiln.backends.pytorch", "PyTorchBackend", "torch"),
    # imports tensorrt only when an engine loads, so its refusals can name the GPU too
    "tensorrt": ("kiln.backends.tensorrt", "TensorRTBackend", "tensorrt"),
    # kiln's LLM engine over a Hugging Face folder; served on /v1/* (frontends/openai)
    "llm": ("kiln.llm.backend", "LLMBackend", "llm"),
    # a Triton vLLM-backend folder (1/model.json of vLLM engine arguments), same engine
    "vllm": ("kiln.llm.backend", "VLLMBackend", "llm"),
}
#: the backends served by kiln's LLM engine (the OpenAI and generate routes find them)
LLM_BACKENDS = frozenset(("llm", "vllm"))
_PLATFORMS = {
    "onnxruntime_onnx": "onnxruntime",
    "ensemble": "ensemble",
    "pytorch_libtorch": "pytorch",
    "tensorrt_plan": "tensorrt",
}
# file in a version folder -> backend, for configs that name neither
_FILES = {
    "model.onnx": "onnxruntime",
    "model.py": "python",
    "model.pt": "pytorch",
    "model.pt2": "pytorch",
    "model.plan": "tensorrt",
}


def register(
    name: str,
    module: str,
    cls: str,
    extra: str = "",
    *,
    platforms: tuple[str, ...] = (),
    files: tuple[str, ...] = (),
) -> None:
    _BACKENDS[name] = (module, cls, extra)
    for p in platforms:
        _PLATFORMS[p] = name
    for f in files:
        _FILES[f] = name


def backend_name(config: ModelConfig, model_dir: Path) -> str:
    if config.backend:
        return config.backend
    if config.platform:
        if config.platform in _PLATFORMS:
            return _PLATFORMS[config.platform]
        raise KilnError(
            f"model '{config.name}': unknown platform '{config.platform}' "
            f"(kiln serves {sorted(_PLATFORMS)})",
            Status.INVALID_ARG,
        )
    for version_dir in sorted(p for p in model_dir.iterdir() if p.is_dir()):
        for filename, name in _FILES.items():
            if (version_dir / filename).exists():
                return name
    raise KilnError(
        f"model '{config.name}': config names no backend or platform and no version folder "
        f"holds a known model file ({', '.join(_FILES)})",
        Status.INVALID_ARG,
    )


def backend_class(name: str) -> type[Backend]:
    try:
        module, cls, extra = _BACKENDS[name]
    except KeyError:
        raise KilnError(
            f"unknown backend '{name}' (kiln serves {sorted(_BACKENDS)})", Status.INVALID_ARG
        ) from None
    try:
        mod = importlib.import_module(module)
    except ImportError as exc:
        hint = f": install kiln-serve[{extra}]" if extra else ""
        raise KilnError(
            f"backend '{name}' is not available ({exc}){hint}", Status.UNAVAILABLE
        ) from exc
    backend: type[Backend] = getattr(mod, cls)
    return backend


def platform_for(name: str) -> str:
    for platform, backend in _PLATFORMS.items():
        if backend == name:
            return platform
    return ""
