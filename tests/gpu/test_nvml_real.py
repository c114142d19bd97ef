"""The NVML path for real (needs a GPU, its driver and ``pip install nvidia-ml-py``)."""

from __future__ import annotations

import urllib.request
from pathlib import Path

import pytest
from prometheus_client.core import Metric
from prometheus_client.parser import text_string_to_metric_families

from kiln.metrics.exposition import render
from kiln.metrics.gpu import GpuCollector
from tests.conftest import KilnProcess

pytestmark = pytest.mark.gpu

TRITON_GPU = [
    "nv_gpu_utilization",
    "nv_gpu_memory_total_bytes",
    "nv_gpu_memory_used_bytes",
    "nv_gpu_power_usage",
    "nv_gpu_power_limit",
]


def _by_gpu(fams: dict[str, Metric], name: str) -> dict[str, float]:
    return {s.labels["gpu_uuid"]: float(s.value) for s in fams[name].samples}


def test_real_nvml_reports_every_gpu() -> None:
    import pynvml

    collector = GpuCollector.create(pynvml)
    assert collector is not None, "NVML did not initialise on a GPU machine"
    try:
        collector.sample()
        text = render(collector.collect()).decode()
    finally:
        collector.close()
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    uuids = {d.uuid for d in collector.devices}
    assert uuids and all(u.startswith(("GPU-", "MIG-")) for u in uuids)
    for name in TRITON_GPU:
        assert set(_by_gpu(fams, name)) == uuids, name
    for uuid in uuids:
        assert 0.0 <= _by_gpu(fams, "nv_gpu_utilization")[uuid] <= 1.0
        total = _by_gpu(fams, "nv_gpu_memory_total_bytes")[uuid]
        assert 0 < _by_gpu(fams, "nv_gpu_memory_used_bytes")[uuid] <= total
        assert (
            0
            < _by_gpu(fams, "nv_gpu_power_usage")[uuid]
            <= 2 * _by_gpu(fams, "nv_gpu_power_limit")[uuid]
        )
        assert 0 < _by_gpu(fams, "kiln_gpu_temperature_celsius")[uuid] < 120
        assert _by_gpu(fams, "kiln_gpu_sm_clock_mhz")[uuid] > 0


def test_kiln_serve_exposes_gpu_metrics(example_repo: Path, make_server: type[KilnProcess]) -> None:
    server = make_server(example_repo, args=["--metrics-interval-ms", "200"]).start()
    with urllib.request.urlopen(server.metrics_url, timeout=10) as resp:
        text = resp.read().decode()
    for name in [*TRITON_GPU, "nv_energy_consumption"]:
        assert f"# TYPE {name} " in text, name
        assert f'{name}{{gpu_uuid="' in text, name
