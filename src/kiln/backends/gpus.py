"""How many NVIDIA GPUs this process may use, without importing a GPU framework.

Backends that run their own GPU library ask it (torch's ``device_count``); the others
(onnxruntime, the Python backend, whose GPU work happens in the model's own code) count
here: the driver's ``/proc/driver/nvidia/gpus`` entries, else NVML, narrowed by
``CUDA_VISIBLE_DEVICES`` as CUDA narrows them, so that ``KIND_GPU`` spreads instances over
the same GPUs that Triton would (one group of ``count`` instances on each).
"""

from __future__ import annotations

import os
from pathlib import Path

NVIDIA_PROC = Path("/proc/driver/nvidia/gpus")


def physical_gpu_count(proc: Path = NVIDIA_PROC) -> int:
    """NVIDIA GPUs the driver reports (0 without a driver)."""
    try:
        return sum(1 for entry in proc.iterdir() if entry.is_dir())
    except OSError:
        pass
    try:
        import pynvml  # nvidia-ml-py (kiln-serve[gpu])
    except ImportError:
        return 0
    try:
        pynvml.nvmlInit()
        try:
            return int(pynvml.nvmlDeviceGetCount())
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # NVMLError_LibraryNotFound / DriverNotLoaded and kin
        return 0


def torch_gpu_count() -> int:
    """The GPUs torch sees (0 without torch or without a CUDA build of it)."""
    try:
        import torch
    except ImportError:
        return 0
    return int(torch.cuda.device_count()) if torch.cuda.is_available() else 0


def visible_gpu_count(proc: Path = NVIDIA_PROC, environ: dict[str, str] | None = None) -> int:
    """The GPUs CUDA would show this process: ``CUDA_VISIBLE_DEVICES`` lists them (by index
    or UUID) up to its first invalid entry; unset, all of them."""
    physical = physical_gpu_count(proc)
    visible = (os.environ if environ is None else environ).get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return physical
    count = 0
    for entry in visible.split(","):
        entry = entry.strip()
        if entry.isdigit():
            if int(entry) >= physical:
                break
        elif not entry.startswith(("GPU-", "MIG-")):
            break  # "", "-1", or anything CUDA does not read as a device: the list ends
        count += 1
    return min(count, physical)
