"""GPU telemetry against a fake NVML (no GPU can exist here), and host metrics from /proc."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.core import Metric
from prometheus_client.parser import text_string_to_metric_families

from kiln.metrics.exposition import render
from kiln.metrics.gpu import GpuCollector
from kiln.metrics.host import HostCollector


class NVMLError(Exception):
    def __init__(self, value: int) -> None:
        super().__init__(f"NVML error {value}")
        self.value = value


NOT_SUPPORTED, DRIVER_NOT_LOADED, GPU_IS_LOST = 3, 9, 15


@dataclass
class FakeGpu:
    uuid: str
    fields: dict[str, Any]
    unsupported: set[str] = field(default_factory=set)
    failing: set[str] = field(default_factory=set)
    calls: dict[str, int] = field(default_factory=dict)


@dataclass
class Util:
    gpu: int
    memory: int


@dataclass
class Mem:
    total: int
    used: int
    free: int


@dataclass
class Proc:
    pid: int
    usedGpuMemory: int | None


class FakeNvml:
    """The slice of ``pynvml`` kiln calls; a field listed as unsupported raises error 3."""

    NVMLError = NVMLError

    def __init__(self, gpus: list[FakeGpu], init_error: int | None = None) -> None:
        self.gpus = gpus
        self.init_error = init_error
        self.shutdown = False

    def nvmlInit(self) -> None:
        if self.init_error is not None:
            raise NVMLError(self.init_error)

    def nvmlShutdown(self) -> None:
        self.shutdown = True

    def nvmlDeviceGetCount(self) -> int:
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, i: int) -> FakeGpu:
        return self.gpus[i]

    def nvmlDeviceGetUUID(self, h: FakeGpu) -> bytes:
        return h.uuid.encode()  # older bindings return bytes

    def _get(self, h: FakeGpu, key: str) -> Any:
        h.calls[key] = h.calls.get(key, 0) + 1
        if key in h.unsupported:
            raise NVMLError(NOT_SUPPORTED)
        if key in h.failing:
            raise NVMLError(GPU_IS_LOST)
        return h.fields[key]

    def nvmlDeviceGetUtilizationRates(self, h: FakeGpu) -> Util:
        return self._get(h, "util")  # type: ignore[no-any-return]

    def nvmlDeviceGetMemoryInfo(self, h: FakeGpu) -> Mem:
        return self._get(h, "mem")  # type: ignore[no-any-return]

    def nvmlDeviceGetPowerUsage(self, h: FakeGpu) -> int:
        return self._get(h, "power_mw")  # type: ignore[no-any-return]

    def nvmlDeviceGetPowerManagementLimit(self, h: FakeGpu) -> int:
        return self._get(h, "limit_mw")  # type: ignore[no-any-return]

    def nvmlDeviceGetTotalEnergyConsumption(self, h: FakeGpu) -> int:
        return self._get(h, "energy_mj")  # type: ignore[no-any-return]

    def nvmlDeviceGetTemperature(self, h: FakeGpu, sensor: int) -> int:
        assert sensor == 0  # NVML_TEMPERATURE_GPU
        return self._get(h, "temp")  # type: ignore[no-any-return]

    def nvmlDeviceGetClockInfo(self, h: FakeGpu, clock: int) -> int:
        return self._get(h, {1: "sm_clock", 2: "mem_clock"}[clock])  # type: ignore[no-any-return]

    def nvmlDeviceGetPcieThroughput(self, h: FakeGpu, counter: int) -> int:
        return self._get(h, {0: "pcie_tx_kb", 1: "pcie_rx_kb"}[counter])  # type: ignore[no-any-return]

    def nvmlDeviceGetCurrentClocksEventReasons(self, h: FakeGpu) -> int:
        return self._get(h, "reasons")  # type: ignore[no-any-return]

    def nvmlDeviceGetComputeRunningProcesses(self, h: FakeGpu) -> list[Proc]:
        return self._get(h, "procs")  # type: ignore[no-any-return]


GiB = 1024**3


def full_gpu(uuid: str) -> FakeGpu:
    return FakeGpu(
        uuid,
        {
            "util": Util(gpu=37, memory=10),
            "mem": Mem(total=80 * GiB, used=10 * GiB, free=70 * GiB),
            "power_mw": 250_500,
            "limit_mw": 700_000,
            "energy_mj": 5_000_000,
            "temp": 61,
            "sm_clock": 1980,
            "mem_clock": 2619,
            "pcie_tx_kb": 100,
            "pcie_rx_kb": 2000,
            "reasons": 0x4 | 0x20,  # sw power cap + sw thermal slowdown
            "procs": [Proc(pid=4242, usedGpuMemory=3 * GiB), Proc(pid=1, usedGpuMemory=GiB)],
        },
    )


def scrape(collector: Any) -> dict[str, Metric]:
    text = render(collector.collect()).decode()
    return {f.name: f for f in text_string_to_metric_families(text)}


def value(fams: dict[str, Metric], family: str, uuid: str, **labels: str) -> float | None:
    for s in fams[family].samples if family in fams else []:
        if s.labels.get("gpu_uuid") == uuid and all(s.labels[k] == v for k, v in labels.items()):
            return float(s.value)
    return None


def test_triton_and_kiln_gpu_families_per_gpu() -> None:
    nvml = FakeNvml([full_gpu("GPU-a"), full_gpu("GPU-b")])
    collector = GpuCollector.create(nvml, pid=4242)
    assert collector is not None
    nvml.gpus[0].fields["energy_mj"] = 5_012_000  # 12 J used since kiln started
    collector.sample()
    text = render(collector.collect()).decode()
    assert "# TYPE nv_energy_consumption counter\n" in text
    assert 'nv_energy_consumption{gpu_uuid="GPU-a"} 12\n' in text
    fams = scrape(collector)
    assert value(fams, "nv_gpu_utilization", "GPU-a") == 0.37
    assert value(fams, "nv_gpu_memory_total_bytes", "GPU-a") == 80 * GiB
    assert value(fams, "nv_gpu_memory_used_bytes", "GPU-b") == 10 * GiB
    assert value(fams, "nv_gpu_power_usage", "GPU-a") == 250.5
    assert value(fams, "nv_gpu_power_limit", "GPU-a") == 700.0
    assert value(fams, "kiln_gpu_temperature_celsius", "GPU-a") == 61
    assert value(fams, "kiln_gpu_sm_clock_mhz", "GPU-a") == 1980
    assert value(fams, "kiln_gpu_memory_clock_mhz", "GPU-a") == 2619
    assert value(fams, "kiln_gpu_pcie_tx_bytes_per_second", "GPU-a") == 100 * 1024
    assert value(fams, "kiln_gpu_pcie_rx_bytes_per_second", "GPU-a") == 2000 * 1024
    assert value(fams, "kiln_gpu_process_memory_used_bytes", "GPU-a") == 3 * GiB
    active = {
        s.labels["reason"]
        for s in fams["kiln_gpu_clock_event_active"].samples
        if s.labels["gpu_uuid"] == "GPU-a" and s.value == 1
    }
    assert active == {"sw_power_cap", "sw_thermal_slowdown"}


def test_unsupported_fields_are_skipped_for_that_gpu_only() -> None:
    old = full_gpu("GPU-old")
    old.unsupported = {"temp", "energy_mj", "pcie_tx_kb", "pcie_rx_kb", "reasons", "procs"}
    nvml = FakeNvml([old, full_gpu("GPU-new")])
    collector = GpuCollector.create(nvml, pid=4242)
    assert collector is not None
    for _ in range(3):
        collector.sample()
    fams = scrape(collector)
    assert value(fams, "kiln_gpu_temperature_celsius", "GPU-old") is None
    assert value(fams, "nv_energy_consumption", "GPU-old") is None
    assert value(fams, "kiln_gpu_pcie_tx_bytes_per_second", "GPU-old") is None
    assert value(fams, "kiln_gpu_temperature_celsius", "GPU-new") == 61
    assert value(fams, "nv_gpu_utilization", "GPU-old") == 0.37  # other fields still there
    # "Not supported" is permanent: NVML is not asked again on every sample.
    assert old.calls["temp"] == 1
    assert old.calls["energy_mj"] == 1


def test_a_transient_error_skips_one_sample_and_is_retried() -> None:
    gpu = full_gpu("GPU-a")
    collector = GpuCollector.create(FakeNvml([gpu]), pid=4242)
    assert collector is not None
    gpu.failing = {"temp"}
    collector.sample()
    assert value(scrape(collector), "kiln_gpu_temperature_celsius", "GPU-a") is None
    gpu.failing = set()
    collector.sample()
    assert value(scrape(collector), "kiln_gpu_temperature_celsius", "GPU-a") == 61


def test_kiln_absent_from_the_process_list_exposes_no_process_memory() -> None:
    collector = GpuCollector.create(FakeNvml([full_gpu("GPU-a")]), pid=os.getpid() + 10_000)
    assert collector is not None
    collector.sample()
    assert "kiln_gpu_process_memory_used_bytes" not in scrape(collector)


def test_no_driver_means_no_collector_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="kiln.metrics.gpu")
    assert GpuCollector.create(FakeNvml([], init_error=DRIVER_NOT_LOADED)) is None
    assert [r.getMessage() for r in caplog.records] == [
        "GPU metrics disabled: NVML is not available (NVML error 9)"
    ]


def test_no_gpu_means_no_collector() -> None:
    nvml = FakeNvml([])
    assert GpuCollector.create(nvml) is None
    assert nvml.shutdown


def test_close_shuts_nvml_down() -> None:
    nvml = FakeNvml([full_gpu("GPU-a")])
    collector = GpuCollector.create(nvml)
    assert collector is not None
    collector.close()
    assert nvml.shutdown


def _write_proc(root: Path, busy: int, idle: int) -> None:
    root.mkdir(exist_ok=True)
    # user nice system idle iowait irq softirq steal guest guest_nice
    (root / "stat").write_text(f"cpu  {busy} 0 0 {idle} 0 0 0 0 0 0\ncpu0 1 0 0 1 0 0 0 0 0 0\n")
    (root / "meminfo").write_text(
        "MemTotal:       16000000 kB\nMemFree:         1000000 kB\nMemAvailable:    4000000 kB\n"
    )


def test_host_metrics_from_proc(tmp_path: Path) -> None:
    proc = tmp_path / "proc"
    _write_proc(proc, busy=100, idle=300)
    host = HostCollector(proc)
    host.sample()
    _write_proc(proc, busy=175, idle=325)  # 75 busy of 100 jiffies since the last sample
    host.sample()
    fams = {
        f.name: f.samples[0].value
        for f in text_string_to_metric_families(render(host.collect()).decode())
    }
    assert fams == {
        "nv_cpu_utilization": 0.75,
        "nv_cpu_memory_total_bytes": 16000000 * 1024,
        "nv_cpu_memory_used_bytes": 12000000 * 1024,
    }


def test_host_metrics_absent_without_proc(tmp_path: Path) -> None:
    host = HostCollector(tmp_path / "missing")
    host.sample()
    assert list(host.collect()) == []


def test_host_metrics_from_the_real_proc() -> None:
    host = HostCollector()
    host.sample()
    host.sample()
    assert host.latest is not None
    assert 0.0 <= host.latest.cpu_utilization <= 1.0
    assert 0 < host.latest.memory_used_bytes <= host.latest.memory_total_bytes
