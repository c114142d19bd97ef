"""Counting the GPUs a process may use, without a GPU framework (``kiln.backends.gpus``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kiln.backends.gpus import physical_gpu_count, visible_gpu_count
from kiln.backends.python.backend import PythonBackend


def _driver(tmp_path: Path, gpus: int) -> Path:
    """A stand-in for /proc/driver/nvidia/gpus: one folder per GPU, by PCI address."""
    proc = tmp_path / "gpus"
    proc.mkdir()
    for i in range(gpus):
        (proc / f"0000:{i:02x}:00.0").mkdir()
    return proc


def test_the_driver_s_gpus_are_counted(tmp_path: Path) -> None:
    assert physical_gpu_count(_driver(tmp_path, 4)) == 4


def test_no_driver_no_gpus(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(__import__("sys").modules, "pynvml", None)  # NVML not installed
    assert physical_gpu_count(tmp_path / "absent") == 0
    assert visible_gpu_count(tmp_path / "absent", {}) == 0


@pytest.mark.parametrize(
    ("visible", "expected"),
    [
        (None, 4),  # unset: all of them
        ("", 0),
        ("-1", 0),
        ("1", 1),
        ("0,2", 2),
        ("2,7,1", 1),  # CUDA stops at the first invalid entry
        ("GPU-8f6c0d1e-aaaa-bbbb-cccc-0123456789ab,1", 2),  # UUIDs count too
        ("0,1,2,3,0,1", 4),  # never more than the machine has
    ],
)
def test_cuda_visible_devices_narrows_them(
    tmp_path: Path, visible: str | None, expected: int
) -> None:
    env = {} if visible is None else {"CUDA_VISIBLE_DEVICES": visible}
    assert visible_gpu_count(_driver(tmp_path, 4), env) == expected


def test_the_python_backend_offers_the_machine_s_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    """Its model's own code uses the GPU: KIND_GPU needs a GPU to be there, nothing else
    (before, the python backend refused KIND_GPU on every machine)."""
    import kiln.backends.python.backend as python_backend

    monkeypatch.setattr(python_backend, "visible_gpu_count", lambda: 2)
    assert PythonBackend.gpu_count() == 2
    monkeypatch.setattr(python_backend, "visible_gpu_count", lambda: 0)
    assert PythonBackend.gpu_count() == 0


def test_onnxruntime_counts_the_driver_s_gpus_not_its_provider_list(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """onnxruntime-gpu lists the CUDA provider on a machine with no GPU: only the driver
    (or NVML) says how many there are. Before, the provider alone counted as one GPU."""
    import kiln.backends.onnxruntime as ort_backend

    providers = ["CUDAExecutionProvider", "CPUExecutionProvider"]
    monkeypatch.setattr(ort_backend.ort, "get_available_providers", lambda: providers)
    monkeypatch.setattr(ort_backend, "visible_gpu_count", lambda: 0)
    assert ort_backend.OnnxRuntimeBackend.gpu_count() == 0
    monkeypatch.setattr(ort_backend, "visible_gpu_count", lambda: 4)
    assert ort_backend.OnnxRuntimeBackend.gpu_count() == 4
    monkeypatch.setattr(ort_backend.ort, "get_available_providers", lambda: providers[1:])
    assert ort_backend.OnnxRuntimeBackend.gpu_count() == 0


def test_kind_auto_runs_on_the_cpu_when_onnxruntime_gpu_finds_no_driver(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A config with no instance_group (KIND_AUTO) on a GPU-less machine with
    onnxruntime-gpu installed: the instances are CPU ones, as Triton places them."""
    import kiln.backends.onnxruntime as ort_backend
    from kiln.backends.base import instance_specs
    from kiln.config.model_config_pb2 import ModelConfig, ModelInstanceGroup

    providers = ["CUDAExecutionProvider", "CPUExecutionProvider"]
    monkeypatch.setattr(ort_backend.ort, "get_available_providers", lambda: providers)
    monkeypatch.setattr(ort_backend, "visible_gpu_count", lambda: 0)
    config = ModelConfig(name="simple", backend="onnxruntime")
    config.instance_group.add(kind=ModelInstanceGroup.KIND_AUTO, count=2)
    specs = instance_specs(config, ort_backend.OnnxRuntimeBackend.gpu_count())
    assert [s.kind for s in specs] == ["cpu", "cpu"]
