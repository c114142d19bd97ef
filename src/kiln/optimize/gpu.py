"""The GPU candidates, what each needs, and why it is skipped where that is missing.

The facts about this machine are gathered once (:func:`probe`) into :class:`GpuFacts`;
:func:`skip_reasons` is a pure function of them, so every reason is testable on a machine
without a GPU, and the reasons say exactly what to install or change.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from kiln.optimize.types import Candidate

CUDA_EP = "CUDAExecutionProvider"
TRT_EP = "TensorrtExecutionProvider"
MIN_TENSORRT = 10  # the strongly typed network path; TensorRT 11 removed the INT8/FP16 flags


@dataclass(frozen=True, slots=True)
class GpuFacts:
    providers: tuple[str, ...]  # onnxruntime.get_available_providers()
    nvml: str | None  # None: NVML sees at least one GPU; else why it does not
    tensorrt: str | None  # the tensorrt package's version; None: not importable
    torch_cuda: str | None  # None: torch sees a CUDA device; else why not (kiln's TRT backend)
    fp16_converter: str | None  # None: an ONNX float16 converter imports; else why not


@dataclass(frozen=True, slots=True)
class GpuCandidate:
    name: str
    kind: str
    runtime: str  # see Candidate.runtime
    description: str
    precision: str = "fp32"


GPU_CANDIDATES = (
    GpuCandidate("fp16", "fp16", "cuda",
                 "FP16 weights and compute (float32 I/O kept), ONNX Runtime CUDA EP", "fp16"),
    GpuCandidate("ort-cuda", "ort-cuda", "cuda", "FP32, ONNX Runtime CUDA execution provider"),
    GpuCandidate("ort-tensorrt-fp32", "ort-trt", "ort-tensorrt",
                 "ONNX Runtime TensorRT execution provider, FP32"),
    GpuCandidate("ort-tensorrt-fp16", "ort-trt", "ort-tensorrt",
                 "ONNX Runtime TensorRT execution provider, FP16 enabled", "fp16"),
    GpuCandidate("tensorrt-fp32", "tensorrt", "tensorrt",
                 "TensorRT engine, strongly typed FP32 network"),
    GpuCandidate("tensorrt-fp16", "tensorrt", "tensorrt",
                 "TensorRT engine, strongly typed network from the FP16 ONNX model", "fp16"),
    GpuCandidate("tensorrt-int8-qdq", "tensorrt", "tensorrt",
                 "TensorRT engine, strongly typed network from the INT8 QDQ model", "int8"),
)  # fmt: skip

CPU_REASON = "needs an NVIDIA GPU (--device cuda); this run is --device cpu"


def _nvml_reason() -> str | None:
    from kiln.metrics.gpu import load_nvml

    nvml = load_nvml()
    if nvml is None:
        return "nvidia-ml-py is not installed (install kiln-serve[gpu])"
    try:
        nvml.nvmlInit()
    except Exception as exc:  # NVMLError_LibraryNotFound / DriverNotLoaded and kin
        return f"no NVIDIA GPU visible to NVML ({exc})"
    try:
        count = int(nvml.nvmlDeviceGetCount())
    finally:
        nvml.nvmlShutdown()
    return None if count > 0 else "no NVIDIA GPU visible to NVML (it reports 0 devices)"


def _tensorrt_version() -> str | None:
    try:
        import tensorrt
    except ImportError:
        return None
    return str(getattr(tensorrt, "__version__", "0"))


def _torch_cuda_reason() -> str | None:
    try:
        import torch
    except ImportError:
        return "torch is not installed (install kiln-serve[tensorrt])"
    if not torch.cuda.is_available():
        return f"torch {torch.__version__} sees no CUDA device (a CUDA build of torch is needed)"
    return None


def _converter_reason() -> str | None:
    try:
        from onnxruntime.transformers.float16 import convert_float_to_float16  # noqa: F401
    except ImportError as exc:
        return f"onnxruntime's float16 converter does not import ({exc})"
    return None


def probe() -> GpuFacts:
    import onnxruntime as ort

    return GpuFacts(
        providers=tuple(ort.get_available_providers()),
        nvml=_nvml_reason(),
        tensorrt=_tensorrt_version(),
        torch_cuda=_torch_cuda_reason(),
        fp16_converter=_converter_reason(),
    )


def _missing(spec: GpuCandidate, facts: GpuFacts) -> list[str]:
    missing = [facts.nvml] if facts.nvml else []
    if spec.runtime in ("cuda", "ort-tensorrt") and CUDA_EP not in facts.providers:
        missing.append(f"onnxruntime has no {CUDA_EP} (install kiln-serve[gpu])")
    if spec.runtime == "ort-tensorrt" and TRT_EP not in facts.providers:
        missing.append(f"onnxruntime has no {TRT_EP} (onnxruntime-gpu with the TensorRT libraries)")
    if spec.runtime == "tensorrt":
        if facts.tensorrt is None:
            missing.append("tensorrt not installed (install kiln-serve[tensorrt])")
        elif _major(facts.tensorrt) < MIN_TENSORRT:
            missing.append(
                f"tensorrt {facts.tensorrt} is too old: strongly typed networks need "
                f"TensorRT >= {MIN_TENSORRT}"
            )
        if facts.torch_cuda:
            missing.append(facts.torch_cuda)
    if spec.precision == "fp16" and spec.runtime != "ort-tensorrt" and facts.fp16_converter:
        missing.append(facts.fp16_converter)
    return missing


def _major(version: str) -> int:
    head = version.split(".")[0]
    return int(head) if head.isdigit() else 0


def skip_reasons(device: str, facts: GpuFacts | None) -> dict[str, str | None]:
    """Each GPU candidate's skip reason (None: it can be built here)."""
    if device != "cuda" or facts is None:
        return {c.name: CPU_REASON for c in GPU_CANDIDATES}
    reasons: dict[str, str | None] = {}
    for spec in GPU_CANDIDATES:
        missing = _missing(spec, facts)
        reasons[spec.name] = "; ".join(missing) if missing else None
    return reasons


def candidate(spec: GpuCandidate, skipped: str | None = None) -> Candidate:
    return Candidate(
        spec.name,
        spec.kind,
        spec.description,
        runtime=spec.runtime,
        precision=spec.precision,
        skipped=skipped,
    )


class GpuMemory:
    """This process's GPU memory through kiln's NVML collector (kiln.metrics.gpu)."""

    def __init__(self, collector: Any) -> None:
        self._collector = collector

    @classmethod
    def open(cls) -> GpuMemory | None:
        from kiln.metrics.gpu import GpuCollector

        collector = GpuCollector.create(pid=os.getpid())
        return None if collector is None else cls(collector)

    def read_mb(self) -> float | None:
        self._collector.sample()
        values = self._collector.devices[0].values
        # Process memory is missing in containers without the host PID namespace: the
        # device's used memory is the fallback (other processes' memory cancels out in the
        # before/after difference as long as it holds steady).
        used = values.get("process_memory", values.get("memory_used"))
        return None if used is None else float(used) / (1024.0 * 1024.0)

    def close(self) -> None:
        self._collector.close()
