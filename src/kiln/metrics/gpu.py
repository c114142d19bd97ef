"""Per-GPU telemetry through NVML (``nvidia-ml-py``, imported as ``pynvml``).

Triton's families (``nv_gpu_*``, ``nv_energy_consumption``, label ``gpu_uuid``) plus
kiln's own (``kiln_gpu_*``): temperature, clocks, clock-event (throttle) reasons, PCIe
throughput and this process's GPU memory. With no ``pynvml``, no driver or no GPU the
collector is not created (one log line); a field a GPU does not support is skipped for
that GPU only. The NVML module is injectable so the path is testable without a GPU.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, cast

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kiln.metrics import names
from kiln.metrics.exposition import counter

log = logging.getLogger(__name__)

# NVML's C enum values (stable ABI), so the module needs only its functions.
NVML_ERROR_NOT_SUPPORTED = 3
NVML_TEMPERATURE_GPU = 0
NVML_CLOCK_SM = 1
NVML_CLOCK_MEM = 2
NVML_PCIE_UTIL_TX_BYTES = 0
NVML_PCIE_UTIL_RX_BYTES = 1
# nvmlClocksEventReason* bits (formerly nvmlClocksThrottleReason*).
CLOCK_EVENT_REASONS = {
    "gpu_idle": 0x1,
    "applications_clocks_setting": 0x2,
    "sw_power_cap": 0x4,
    "hw_slowdown": 0x8,
    "sync_boost": 0x10,
    "sw_thermal_slowdown": 0x20,
    "hw_thermal_slowdown": 0x40,
    "hw_power_brake_slowdown": 0x80,
    "display_clock_setting": 0x100,
}


@dataclass(slots=True)
class Device:
    handle: Any
    uuid: str
    energy_start_mj: int | None = None
    unsupported: set[str] = field(default_factory=set)
    values: dict[str, float] = field(default_factory=dict)


# (key, family, help, counter?) in exposition order; values are already in the family's unit.
FAMILIES = (
    ("utilization", names.GPU_UTILIZATION, "GPU utilization rate [0.0 - 1.0]", False),
    ("memory_total", names.GPU_MEMORY_TOTAL_BYTES, "GPU total memory, in bytes", False),
    ("memory_used", names.GPU_MEMORY_USED_BYTES, "GPU used memory, in bytes", False),
    ("power_usage", names.GPU_POWER_USAGE, "GPU power usage in watts", False),
    ("power_limit", names.GPU_POWER_LIMIT, "GPU power management limit in watts", False),
    (
        "energy",
        names.ENERGY_CONSUMPTION,
        "GPU energy consumption in joules since kiln started",
        True,
    ),
    (
        "temperature",
        names.KILN_GPU_TEMPERATURE_CELSIUS,
        "GPU core temperature in degrees Celsius",
        False,
    ),
    ("sm_clock", names.KILN_GPU_SM_CLOCK_MHZ, "GPU SM clock in MHz", False),
    ("memory_clock", "kiln_gpu_memory_clock_mhz", "GPU memory clock in MHz", False),
    (
        "pcie_tx",
        "kiln_gpu_pcie_tx_bytes_per_second",
        "GPU PCIe transmit throughput, bytes/s",
        False,
    ),
    (
        "pcie_rx",
        "kiln_gpu_pcie_rx_bytes_per_second",
        "GPU PCIe receive throughput, bytes/s",
        False,
    ),
    (
        "process_memory",
        names.KILN_GPU_PROCESS_MEMORY_USED_BYTES,
        "GPU memory used by this kiln process, in bytes",
        False,
    ),
)


def load_nvml() -> ModuleType | None:
    try:
        import pynvml
    except ImportError:
        log.info(
            "GPU metrics disabled: nvidia-ml-py is not installed (pip install kiln-serve[gpu])"
        )
        return None
    return cast("ModuleType", pynvml)


class GpuCollector(Collector):
    def __init__(self, nvml: Any, devices: list[Device], pid: int) -> None:
        self.nvml = nvml
        self.devices = devices
        self.pid = pid
        self.reasons: dict[str, dict[str, int]] = {}  # uuid -> reason -> 0/1

    @classmethod
    def create(cls, nvml: Any | None = None, pid: int | None = None) -> GpuCollector | None:
        """The collector, or None (logged once) when there is no usable GPU."""
        nvml = nvml if nvml is not None else load_nvml()
        if nvml is None:
            return None
        try:
            nvml.nvmlInit()
        except nvml.NVMLError as exc:
            log.info("GPU metrics disabled: NVML is not available (%s)", exc)
            return None
        try:
            devices = []
            for i in range(nvml.nvmlDeviceGetCount()):
                handle = nvml.nvmlDeviceGetHandleByIndex(i)
                uuid = nvml.nvmlDeviceGetUUID(handle)
                devices.append(Device(handle, uuid.decode() if isinstance(uuid, bytes) else uuid))
        except nvml.NVMLError as exc:
            log.warning("GPU metrics disabled: NVML failed listing GPUs (%s)", exc)
            nvml.nvmlShutdown()
            return None
        if not devices:
            log.info("GPU metrics disabled: NVML reports no GPU")
            nvml.nvmlShutdown()
            return None
        collector = cls(nvml, devices, os.getpid() if pid is None else pid)
        for dev in devices:
            dev.energy_start_mj = collector._read(
                dev, "energy", nvml.nvmlDeviceGetTotalEnergyConsumption
            )
        log.info("GPU metrics enabled for %d GPU(s): %s", len(devices), [d.uuid for d in devices])
        return collector

    def _read(self, dev: Device, key: str, fn: Callable[..., Any], *args: Any) -> Any:
        if key in dev.unsupported:
            return None
        try:
            return fn(dev.handle, *args)
        except self.nvml.NVMLError as exc:
            if getattr(exc, "value", None) == NVML_ERROR_NOT_SUPPORTED:
                # Permanently absent on this GPU: stop asking.
                dev.unsupported.add(key)
                log.debug("GPU %s does not support %s", dev.uuid, key)
            else:
                log.debug("GPU %s: reading %s failed: %s", dev.uuid, key, exc)
            return None

    def sample(self) -> None:
        for dev in self.devices:
            self._sample(dev)

    def _sample(self, dev: Device) -> None:
        nvml, read, v = self.nvml, self._read, {}
        util = read(dev, "utilization", nvml.nvmlDeviceGetUtilizationRates)
        if util is not None:
            v["utilization"] = util.gpu / 100.0
        mem = read(dev, "memory", nvml.nvmlDeviceGetMemoryInfo)
        if mem is not None:
            v["memory_total"], v["memory_used"] = float(mem.total), float(mem.used)
        for key, fn, scale in (
            ("power_usage", nvml.nvmlDeviceGetPowerUsage, 1e-3),  # mW
            ("power_limit", nvml.nvmlDeviceGetPowerManagementLimit, 1e-3),
            (
                "temperature",
                lambda h: nvml.nvmlDeviceGetTemperature(h, NVML_TEMPERATURE_GPU),
                1.0,
            ),
            ("sm_clock", lambda h: nvml.nvmlDeviceGetClockInfo(h, NVML_CLOCK_SM), 1.0),
            ("memory_clock", lambda h: nvml.nvmlDeviceGetClockInfo(h, NVML_CLOCK_MEM), 1.0),
            (
                "pcie_tx",
                lambda h: nvml.nvmlDeviceGetPcieThroughput(h, NVML_PCIE_UTIL_TX_BYTES),
                1024.0,
            ),
            (
                "pcie_rx",
                lambda h: nvml.nvmlDeviceGetPcieThroughput(h, NVML_PCIE_UTIL_RX_BYTES),
                1024.0,
            ),
        ):
            raw = read(dev, key, fn)
            if raw is not None:
                v[key] = raw * scale
        if dev.energy_start_mj is not None:
            energy = read(dev, "energy", nvml.nvmlDeviceGetTotalEnergyConsumption)
            if energy is not None:
                v["energy"] = (energy - dev.energy_start_mj) / 1000.0
        reasons_fn = getattr(nvml, "nvmlDeviceGetCurrentClocksEventReasons", None) or getattr(
            nvml, "nvmlDeviceGetCurrentClocksThrottleReasons", None
        )
        mask = read(dev, "clock_events", reasons_fn) if reasons_fn is not None else None
        if mask is not None:
            self.reasons[dev.uuid] = {
                r: int(bool(mask & bit)) for r, bit in CLOCK_EVENT_REASONS.items()
            }
        procs = read(dev, "processes", nvml.nvmlDeviceGetComputeRunningProcesses)
        if procs is not None:
            # Host PIDs: inside a container without --pid=host kiln is not listed.
            mine = [p.usedGpuMemory for p in procs if p.pid == self.pid and p.usedGpuMemory]
            if mine:
                v["process_memory"] = float(sum(mine))
        dev.values = v

    def collect(self) -> Iterator[Metric]:
        for key, name, doc, is_counter in FAMILIES:
            samples = [(d.uuid, d.values[key]) for d in self.devices if key in d.values]
            if not samples:
                continue
            if is_counter:
                family: Metric = counter(name, doc)
                for uuid, value in samples:
                    family.add_sample(name, {"gpu_uuid": uuid}, value)
            else:
                family = GaugeMetricFamily(name, doc, labels=["gpu_uuid"])
                for uuid, value in samples:
                    family.add_metric([uuid], value)
            yield family
        if self.reasons:
            events = GaugeMetricFamily(
                names.KILN_GPU_CLOCK_EVENT_ACTIVE,
                "1 while NVML reports this clock-event (throttle) reason for the GPU",
                labels=["gpu_uuid", "reason"],
            )
            for uuid, reasons in self.reasons.items():
                for reason, active in reasons.items():
                    events.add_metric([uuid, reason], active)
            yield events

    def close(self) -> None:
        try:
            self.nvml.nvmlShutdown()
        except self.nvml.NVMLError as exc:
            log.debug("nvmlShutdown failed: %s", exc)
