"""The DCGM exporter's families, read through NVML: what ``kiln monitor agent`` serves.

Names, units, metric types and labels are dcgm-exporter's (``gpu``, ``UUID``,
``pci_bus_id``, ``device``, ``modelName``, ``Hostname``), so a Grafana dashboard or an alert
rule written for dcgm-exporter works on the agent unchanged. Reading goes through
``GpuCollector`` (device discovery, and a field NVML reports as not supported on a GPU is
never asked again and never exported, rather than exported as 0). Per-process GPU memory
is kiln's own family, ``kiln_gpu_process_memory_used_bytes``: DCGM has no per-process field.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

from prometheus_client.core import GaugeMetricFamily, Metric

from kiln.metrics import names
from kiln.metrics.exposition import counter
from kiln.metrics.gpu import (
    NVML_CLOCK_MEM,
    NVML_CLOCK_SM,
    NVML_PCIE_UTIL_RX_BYTES,
    NVML_PCIE_UTIL_TX_BYTES,
    NVML_TEMPERATURE_GPU,
    Device,
    GpuCollector,
)

log = logging.getLogger(__name__)

# NVML constants (stable C ABI values), so a fake module needs only functions.
NVML_FI_DEV_MEMORY_TEMP = 82
NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX = 138  # cumulative KiB, all links
NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX = 139
NVML_EVENT_TYPE_XID_CRITICAL_ERROR = 0x8
NVML_ERROR_TIMEOUT = 10
_VALUE_FIELDS = ("dVal", "uiVal", "ulVal", "ullVal", "sllVal", "siVal", "usVal")
MIB = 1024 * 1024

LABELS = ("gpu", "UUID", "pci_bus_id", "device", "modelName", "Hostname")
# (name, dcgm-exporter type, help as dcgm-exporter's default-counters.csv words it)
FIELDS: tuple[tuple[str, str, str], ...] = (
    (names.DCGM_FI_DEV_SM_CLOCK, "gauge", "SM clock frequency (in MHz)."),
    (names.DCGM_FI_DEV_MEM_CLOCK, "gauge", "Memory clock frequency (in MHz)."),
    (names.DCGM_FI_DEV_MEMORY_TEMP, "gauge", "Memory temperature (in C)."),
    (names.DCGM_FI_DEV_GPU_TEMP, "gauge", "GPU temperature (in C)."),
    (names.DCGM_FI_DEV_POWER_USAGE, "gauge", "Power draw (in W)."),
    (
        names.DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION,
        "counter",
        "Total energy consumption since boot (in mJ).",
    ),
    (names.DCGM_FI_DEV_PCIE_REPLAY_COUNTER, "counter", "Total number of PCIe retries."),
    (names.DCGM_FI_DEV_GPU_UTIL, "gauge", "GPU utilization (in %)."),
    (names.DCGM_FI_DEV_MEM_COPY_UTIL, "gauge", "Memory utilization (in %)."),
    (names.DCGM_FI_DEV_ENC_UTIL, "gauge", "Encoder utilization (in %)."),
    (names.DCGM_FI_DEV_DEC_UTIL, "gauge", "Decoder utilization (in %)."),
    (names.DCGM_FI_DEV_XID_ERRORS, "gauge", "Value of the last XID error encountered."),
    (names.DCGM_FI_DEV_FB_FREE, "gauge", "Framebuffer memory free (in MiB)."),
    (names.DCGM_FI_DEV_FB_USED, "gauge", "Framebuffer memory used (in MiB)."),
    (names.DCGM_FI_DEV_FB_TOTAL, "gauge", "Framebuffer memory total (in MiB)."),
    (
        names.DCGM_FI_DEV_ECC_SBE_VOL_TOTAL,
        "counter",
        "Total number of single-bit volatile ECC errors.",
    ),
    (
        names.DCGM_FI_DEV_ECC_DBE_VOL_TOTAL,
        "counter",
        "Total number of double-bit volatile ECC errors.",
    ),
    (
        names.DCGM_FI_DEV_ECC_SBE_AGG_TOTAL,
        "counter",
        "Total number of single-bit persistent ECC errors.",
    ),
    (
        names.DCGM_FI_DEV_ECC_DBE_AGG_TOTAL,
        "counter",
        "Total number of double-bit persistent ECC errors.",
    ),
    (
        names.DCGM_FI_DEV_RETIRED_SBE,
        "counter",
        "Total number of retired pages due to single-bit errors.",
    ),
    (
        names.DCGM_FI_DEV_RETIRED_DBE,
        "counter",
        "Total number of retired pages due to double-bit errors.",
    ),
    (names.DCGM_FI_DEV_RETIRED_PENDING, "counter", "Total number of pages pending retirement."),
    (
        names.DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS,
        "counter",
        "Number of remapped rows for uncorrectable errors",
    ),
    (
        names.DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS,
        "counter",
        "Number of remapped rows for correctable errors",
    ),
    (names.DCGM_FI_DEV_ROW_REMAP_FAILURE, "gauge", "Whether remapping of rows has failed"),
    # The same bitmask under DCGM's old and new names (renamed in DCGM 3.3 / NVML 12.2).
    (
        names.DCGM_FI_DEV_CLOCK_THROTTLE_REASONS,
        "gauge",
        "Current clock throttle reasons (bitmask).",
    ),
    (names.DCGM_FI_DEV_CLOCKS_EVENT_REASONS, "gauge", "Current clock event reasons (bitmask)."),
    (
        names.DCGM_FI_PROF_PCIE_TX_BYTES,
        "gauge",
        "The rate of data transmitted over the PCIe bus (B/s).",
    ),
    (
        names.DCGM_FI_PROF_PCIE_RX_BYTES,
        "gauge",
        "The rate of data received over the PCIe bus (B/s).",
    ),
    (
        names.DCGM_FI_PROF_NVLINK_TX_BYTES,
        "gauge",
        "The rate of data transmitted over NVLink, all links (B/s).",
    ),
    (
        names.DCGM_FI_PROF_NVLINK_RX_BYTES,
        "gauge",
        "The rate of data received over NVLink, all links (B/s).",
    ),
)
PROCESS_MEMORY = names.KILN_GPU_PROCESS_MEMORY_USED_BYTES
PROCESS_LABELS = ("pid", "process_name", "gpu", "UUID", "Hostname")
NAMES: frozenset[str] = frozenset(name for name, _, _ in FIELDS)


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _field_value(fv: Any) -> float | None:
    """One ``c_nvmlFieldValue_t``, or None when NVML returned an error for that field."""
    if getattr(fv, "nvmlReturn", 0) != 0:
        return None
    vtype = int(getattr(fv, "valueType", 3))
    return float(getattr(fv.value, _VALUE_FIELDS[vtype]))


class DcgmCollector(GpuCollector):
    """Every GPU NVML lists, with dcgm-exporter's families and labels."""

    def __init__(self, nvml: Any, devices: list[Device], pid: int) -> None:
        super().__init__(nvml, devices, pid)
        self.hostname = os.environ.get("NODE_NAME") or socket.gethostname()
        self.labels: dict[str, dict[str, str]] = {}  # uuid -> LABELS
        self.procs: dict[str, list[tuple[int, str, float]]] = {}  # uuid -> (pid, name, bytes)
        self.last_xid: dict[str, float] = {}  # uuid -> last XID seen (0: none yet)
        self._nvlink_prev: dict[str, tuple[float, float, float]] = {}  # uuid -> (ts, tx, rx)
        self._names: dict[int, str] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._xid_thread: threading.Thread | None = None
        for i, dev in enumerate(devices):
            self.labels[dev.uuid] = self._device_labels(i, dev)

    def _device_labels(self, index: int, dev: Device) -> dict[str, str]:
        nvml, read = self.nvml, self._read
        name = read(dev, "name", nvml.nvmlDeviceGetName)
        pci = read(dev, "pci", nvml.nvmlDeviceGetPciInfo)
        minor = read(dev, "minor", nvml.nvmlDeviceGetMinorNumber)
        return {
            "gpu": str(index),
            "UUID": dev.uuid,
            "pci_bus_id": _text(pci.busId) if pci is not None else "",
            "device": f"nvidia{minor if minor is not None else index}",
            "modelName": _text(name) if name is not None else "",
            "Hostname": self.hostname,
        }

    # -- sampling (the poller thread) ------------------------------------------------------

    def _sample(self, dev: Device) -> None:
        nvml, read, v = self.nvml, self._read, {}
        for key, name, fn, scale in (
            ("sm_clock", names.DCGM_FI_DEV_SM_CLOCK, lambda h: nvml.nvmlDeviceGetClockInfo(h, NVML_CLOCK_SM), 1.0),  # noqa: E501
            ("memory_clock", names.DCGM_FI_DEV_MEM_CLOCK, lambda h: nvml.nvmlDeviceGetClockInfo(h, NVML_CLOCK_MEM), 1.0),  # noqa: E501
            ("temperature", names.DCGM_FI_DEV_GPU_TEMP, lambda h: nvml.nvmlDeviceGetTemperature(h, NVML_TEMPERATURE_GPU), 1.0),  # noqa: E501
            ("power_usage", names.DCGM_FI_DEV_POWER_USAGE, nvml.nvmlDeviceGetPowerUsage, 1e-3),
            ("energy", names.DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION, nvml.nvmlDeviceGetTotalEnergyConsumption, 1.0),  # noqa: E501
            ("pcie_replay", names.DCGM_FI_DEV_PCIE_REPLAY_COUNTER, nvml.nvmlDeviceGetPcieReplayCounter, 1.0),  # noqa: E501
            # NVML's KB/s over a 20 ms window, as DCGM's PROF_PCIE_* are a rate in B/s.
            ("pcie_tx", names.DCGM_FI_PROF_PCIE_TX_BYTES, lambda h: nvml.nvmlDeviceGetPcieThroughput(h, NVML_PCIE_UTIL_TX_BYTES), 1024.0),  # noqa: E501
            ("pcie_rx", names.DCGM_FI_PROF_PCIE_RX_BYTES, lambda h: nvml.nvmlDeviceGetPcieThroughput(h, NVML_PCIE_UTIL_RX_BYTES), 1024.0),  # noqa: E501
            ("retired_pending", names.DCGM_FI_DEV_RETIRED_PENDING, nvml.nvmlDeviceGetRetiredPagesPendingStatus, 1.0),  # noqa: E501
        ):  # fmt: skip
            raw = read(dev, key, fn)
            if raw is not None:
                v[name] = float(raw) * scale
        util = read(dev, "utilization", nvml.nvmlDeviceGetUtilizationRates)
        if util is not None:
            v[names.DCGM_FI_DEV_GPU_UTIL], v[names.DCGM_FI_DEV_MEM_COPY_UTIL] = (
                util.gpu,
                util.memory,
            )
        for key, name, fn in (
            ("enc", names.DCGM_FI_DEV_ENC_UTIL, nvml.nvmlDeviceGetEncoderUtilization),
            ("dec", names.DCGM_FI_DEV_DEC_UTIL, nvml.nvmlDeviceGetDecoderUtilization),
        ):
            pair = read(dev, key, fn)  # [utilization %, sampling period µs]
            if pair is not None:
                v[name] = float(pair[0])
        mem = read(dev, "memory", nvml.nvmlDeviceGetMemoryInfo)
        if mem is not None:
            v[names.DCGM_FI_DEV_FB_FREE] = mem.free // MIB
            v[names.DCGM_FI_DEV_FB_USED] = mem.used // MIB
            v[names.DCGM_FI_DEV_FB_TOTAL] = mem.total // MIB
        for key, name, error_type, counter_type in (
            ("ecc_sbe_vol", names.DCGM_FI_DEV_ECC_SBE_VOL_TOTAL, 0, 0),
            ("ecc_dbe_vol", names.DCGM_FI_DEV_ECC_DBE_VOL_TOTAL, 1, 0),
            ("ecc_sbe_agg", names.DCGM_FI_DEV_ECC_SBE_AGG_TOTAL, 0, 1),
            ("ecc_dbe_agg", names.DCGM_FI_DEV_ECC_DBE_AGG_TOTAL, 1, 1),
        ):
            raw = read(
                dev,
                key,
                lambda h, e=error_type, c=counter_type: nvml.nvmlDeviceGetTotalEccErrors(h, e, c),
            )
            if raw is not None:
                v[name] = float(raw)
        for key, name, cause in (
            ("retired_sbe", names.DCGM_FI_DEV_RETIRED_SBE, 0),
            ("retired_dbe", names.DCGM_FI_DEV_RETIRED_DBE, 1),
        ):
            pages = read(dev, key, lambda h, c=cause: nvml.nvmlDeviceGetRetiredPages(h, c))
            if pages is not None:
                v[name] = float(len(pages))
        rows = read(dev, "remapped_rows", nvml.nvmlDeviceGetRemappedRows)
        if rows is not None:  # (correctable, uncorrectable, pending, failure occurred)
            v[names.DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS] = float(rows[0])
            v[names.DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS] = float(rows[1])
            v[names.DCGM_FI_DEV_ROW_REMAP_FAILURE] = float(rows[3])
        reasons_fn = getattr(nvml, "nvmlDeviceGetCurrentClocksEventReasons", None) or getattr(
            nvml, "nvmlDeviceGetCurrentClocksThrottleReasons", None
        )
        mask = read(dev, "clock_events", reasons_fn) if reasons_fn is not None else None
        if mask is not None:
            v[names.DCGM_FI_DEV_CLOCK_THROTTLE_REASONS] = float(mask)
            v[names.DCGM_FI_DEV_CLOCKS_EVENT_REASONS] = float(mask)
        self._field_values(dev, v)
        with self._lock:
            if dev.uuid in self.last_xid:
                v[names.DCGM_FI_DEV_XID_ERRORS] = self.last_xid[dev.uuid]
        self.procs[dev.uuid] = self._processes(dev)
        dev.values = v

    def _field_values(self, dev: Device, v: dict[str, float]) -> None:
        ids = [
            NVML_FI_DEV_MEMORY_TEMP,
            NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX,
            NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX,
        ]
        fvs = self._read(dev, "field_values", self.nvml.nvmlDeviceGetFieldValues, ids)
        if fvs is None:
            return
        temp, tx, rx = (_field_value(fv) for fv in fvs)
        if temp is not None:
            v[names.DCGM_FI_DEV_MEMORY_TEMP] = temp
        if tx is None or rx is None:
            return  # no NVLink on this GPU: omitted
        ts = self._clock()
        prev = self._nvlink_prev.get(dev.uuid)
        self._nvlink_prev[dev.uuid] = (ts, tx, rx)
        if prev is not None and ts > prev[0] and tx >= prev[1] and rx >= prev[2]:
            dt = ts - prev[0]
            v[names.DCGM_FI_PROF_NVLINK_TX_BYTES] = (tx - prev[1]) * 1024 / dt
            v[names.DCGM_FI_PROF_NVLINK_RX_BYTES] = (rx - prev[2]) * 1024 / dt

    @staticmethod
    def _clock() -> float:
        return time.monotonic()

    def _processes(self, dev: Device) -> list[tuple[int, str, float]]:
        used: dict[int, float] = {}
        for key, fn_name in (
            ("processes", "nvmlDeviceGetComputeRunningProcesses"),
            ("graphics_processes", "nvmlDeviceGetGraphicsRunningProcesses"),
        ):
            fn = getattr(self.nvml, fn_name, None)
            procs = self._read(dev, key, fn) if fn is not None else None
            for p in procs or []:
                if p.usedGpuMemory:  # None where the driver cannot tell (no permission)
                    used[p.pid] = used.get(p.pid, 0.0) + float(p.usedGpuMemory)
        return [(pid, self._process_name(pid), b) for pid, b in sorted(used.items())]

    def _process_name(self, pid: int) -> str:
        name = self._names.get(pid)
        if name is None:
            try:
                name = os.path.basename(_text(self.nvml.nvmlSystemGetProcessName(pid)))
            except self.nvml.NVMLError:
                name = ""  # another PID namespace: NVML cannot see it
            if len(self._names) > 4096:
                self._names.clear()  # PIDs are reused; keep the cache bounded
            self._names[pid] = name
        return name

    # -- XID errors (NVML events, their own thread) ----------------------------------------

    def start_xid_watch(self) -> None:
        """Record the last XID per GPU from NVML's event API; GPUs without it omit the field."""
        nvml = self.nvml
        try:
            event_set = nvml.nvmlEventSetCreate()
        except (nvml.NVMLError, AttributeError) as exc:
            log.info("XID errors not reported: NVML events unavailable (%s)", exc)
            return
        for dev in self.devices:
            try:
                nvml.nvmlDeviceRegisterEvents(
                    dev.handle, NVML_EVENT_TYPE_XID_CRITICAL_ERROR, event_set
                )
            except nvml.NVMLError as exc:
                log.info("GPU %s: XID events not supported (%s)", dev.uuid, exc)
                continue
            with self._lock:
                self.last_xid[dev.uuid] = 0.0  # DCGM reports 0 until the first XID
        if not self.last_xid:
            return
        self._xid_thread = threading.Thread(
            target=self._watch_xid, args=(event_set,), name="kiln-xid", daemon=True
        )
        self._xid_thread.start()

    def _watch_xid(self, event_set: Any) -> None:
        nvml = self.nvml
        while not self._stop.is_set():
            try:
                event = nvml.nvmlEventSetWait(event_set, 500)
            except nvml.NVMLError as exc:
                if getattr(exc, "value", None) != NVML_ERROR_TIMEOUT:
                    log.warning("XID event wait failed: %s", exc)
                    self._stop.wait(1.0)
                continue
            if not event.eventType & NVML_EVENT_TYPE_XID_CRITICAL_ERROR:
                continue
            try:
                uuid = _text(nvml.nvmlDeviceGetUUID(event.device))
            except nvml.NVMLError:
                continue
            log.warning("GPU %s: XID %d", uuid, event.eventData)
            with self._lock:
                self.last_xid[uuid] = float(event.eventData)
        with contextlib.suppress(nvml.NVMLError, AttributeError):
            nvml.nvmlEventSetFree(event_set)

    # -- exposition --------------------------------------------------------------------------

    def collect(self) -> Iterator[Metric]:
        for name, kind, doc in FIELDS:
            samples = [(d.uuid, d.values[name]) for d in self.devices if name in d.values]
            if not samples:
                continue  # not supported on any GPU here: omitted, as DCGM does
            family: Metric = counter(name, doc) if kind == "counter" else Metric(name, doc, kind)
            for uuid, value in samples:
                family.add_sample(name, self.labels[uuid], value)
            yield family
        procs = GaugeMetricFamily(
            PROCESS_MEMORY,
            "GPU memory used by a process, in bytes (kiln's family; DCGM has none)",
            labels=list(PROCESS_LABELS),
        )
        for dev in self.devices:
            lab = self.labels[dev.uuid]
            for pid, pname, used in self.procs.get(dev.uuid, []):
                procs.add_metric([str(pid), pname, lab["gpu"], dev.uuid, lab["Hostname"]], used)
        if procs.samples:
            yield procs

    def close(self) -> None:
        self._stop.set()
        if self._xid_thread is not None:
            self._xid_thread.join(timeout=2)
        super().close()
