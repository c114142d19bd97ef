"""A fake ``pynvml`` for the GPU agent: no GPU exists on the test machines.

In-process tests build ``FakeNvml([fake_gpu(...)])``. A real ``kiln monitor agent`` process
gets one through the agent's documented hook::

    KILN_FAKE_NVML=tests.fake_nvml:from_env  KILN_FAKE_NVML_SPEC=/path/spec.json

where the spec is ``{"gpus": [{"uuid": ..., "fields": {...}, "unsupported": [...]}]}`` and is
re-read on every call, so a test changes what the agent reads (a temperature rising) by
rewriting the file.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

NOT_SUPPORTED, TIMEOUT, NOT_FOUND = 3, 10, 6
GiB, MiB = 1024**3, 1024**2


class NVMLError(Exception):
    def __init__(self, value: int) -> None:
        super().__init__(f"NVML error {value}")
        self.value = value


@dataclass
class FakeGpu:
    uuid: str
    fields: dict[str, Any]
    unsupported: set[str] = field(default_factory=set)


def fake_gpu(uuid: str, index: int = 0, **overrides: Any) -> FakeGpu:
    fields: dict[str, Any] = {
        "name": "NVIDIA H100 80GB HBM3",
        "bus_id": f"00000000:{0x18 + index:02X}:00.0",
        "minor": index,
        "util": [37, 12],  # gpu %, memory %
        "mem": [80 * GiB, 10 * GiB + 512 * MiB],  # total, used
        "power_mw": 250_500,
        "energy_mj": 5_000_000,
        "temp": 61,
        "mem_temp": 70,
        "sm_clock": 1980,
        "mem_clock": 2619,
        "pcie_tx_kb": 100,
        "pcie_rx_kb": 2000,
        "pcie_replay": 2,
        "enc": 5,
        "dec": 7,
        "reasons": 0x4 | 0x20,
        "ecc": {"0,0": 3, "1,0": 0, "0,1": 40, "1,1": 1},  # (error type, counter type)
        "retired": {"0": 2, "1": 1},
        "retired_pending": 0,
        "remapped_rows": [4, 1, 0, 0],
        "nvlink_kib": [1000, 2000],  # cumulative tx, rx
        "procs": [[4242, 3 * GiB, "python3"], [77, GiB, "/usr/bin/trtexec"]],
    }
    fields.update(overrides)
    return FakeGpu(uuid, fields)


class FakeNvml:
    """The slice of ``pynvml`` the agent calls; an unsupported field raises error 3."""

    NVMLError = NVMLError

    def __init__(self, gpus: list[FakeGpu], spec: Path | None = None) -> None:
        self._gpus = gpus
        self.spec = spec
        self.xids: list[tuple[str, int]] = []  # (uuid, xid) events, delivered in order
        self.delivered = 0
        self.registered: list[str] = []

    @property
    def gpus(self) -> list[FakeGpu]:
        if self.spec is not None:
            doc = json.loads(self.spec.read_text())
            return [
                FakeGpu(g["uuid"], g["fields"], set(g.get("unsupported", []))) for g in doc["gpus"]
            ]
        return self._gpus

    def _xids(self) -> list[tuple[str, int]]:
        if self.spec is not None:
            return [(u, x) for u, x in json.loads(self.spec.read_text()).get("xids", [])]
        return self.xids

    def _gpu(self, h: str) -> FakeGpu:
        return next(g for g in self.gpus if g.uuid == h)

    def _get(self, h: str, key: str) -> Any:
        g = self._gpu(h)
        if key in g.unsupported or key not in g.fields:
            raise NVMLError(NOT_SUPPORTED)
        return g.fields[key]

    def nvmlInit(self) -> None: ...

    def nvmlShutdown(self) -> None: ...

    def nvmlDeviceGetCount(self) -> int:
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, i: int) -> str:
        return self.gpus[i].uuid  # the handle is the UUID: stable across spec re-reads

    def nvmlDeviceGetUUID(self, h: str) -> bytes:
        return h.encode()  # older bindings return bytes

    def nvmlDeviceGetName(self, h: str) -> str:
        return str(self._get(h, "name"))

    def nvmlDeviceGetPciInfo(self, h: str) -> Any:
        return SimpleNamespace(busId=self._get(h, "bus_id").encode())

    def nvmlDeviceGetMinorNumber(self, h: str) -> int:
        return int(self._get(h, "minor"))

    def nvmlDeviceGetUtilizationRates(self, h: str) -> Any:
        gpu, memory = self._get(h, "util")
        return SimpleNamespace(gpu=gpu, memory=memory)

    def nvmlDeviceGetMemoryInfo(self, h: str) -> Any:
        total, used = self._get(h, "mem")
        return SimpleNamespace(total=total, used=used, free=total - used)

    def nvmlDeviceGetPowerUsage(self, h: str) -> int:
        return int(self._get(h, "power_mw"))

    def nvmlDeviceGetPowerManagementLimit(self, h: str) -> int:
        return int(self._get(h, "limit_mw"))

    def nvmlDeviceGetTotalEnergyConsumption(self, h: str) -> int:
        return int(self._get(h, "energy_mj"))

    def nvmlDeviceGetTemperature(self, h: str, sensor: int) -> int:
        assert sensor == 0
        return int(self._get(h, "temp"))

    def nvmlDeviceGetClockInfo(self, h: str, clock: int) -> int:
        return int(self._get(h, {1: "sm_clock", 2: "mem_clock"}[clock]))

    def nvmlDeviceGetPcieThroughput(self, h: str, counter: int) -> int:
        return int(self._get(h, {0: "pcie_tx_kb", 1: "pcie_rx_kb"}[counter]))

    def nvmlDeviceGetPcieReplayCounter(self, h: str) -> int:
        return int(self._get(h, "pcie_replay"))

    def nvmlDeviceGetEncoderUtilization(self, h: str) -> list[int]:
        return [self._get(h, "enc"), 167000]

    def nvmlDeviceGetDecoderUtilization(self, h: str) -> list[int]:
        return [self._get(h, "dec"), 167000]

    def nvmlDeviceGetCurrentClocksEventReasons(self, h: str) -> int:
        return int(self._get(h, "reasons"))

    def nvmlDeviceGetTotalEccErrors(self, h: str, error_type: int, counter_type: int) -> int:
        return int(self._get(h, "ecc")[f"{error_type},{counter_type}"])

    def nvmlDeviceGetRetiredPages(self, h: str, cause: int) -> list[int]:
        return list(range(int(self._get(h, "retired")[str(cause)])))

    def nvmlDeviceGetRetiredPagesPendingStatus(self, h: str) -> int:
        return int(self._get(h, "retired_pending"))

    def nvmlDeviceGetRemappedRows(self, h: str) -> tuple[int, ...]:
        return tuple(self._get(h, "remapped_rows"))

    def nvmlDeviceGetFieldValues(self, h: str, ids: list[int]) -> list[Any]:
        g = self._gpu(h)
        out = []
        for fid in ids:
            key, idx = {82: ("mem_temp", None), 138: ("nvlink_kib", 0), 139: ("nvlink_kib", 1)}[fid]
            if key in g.unsupported or key not in g.fields:
                out.append(SimpleNamespace(nvmlReturn=NOT_SUPPORTED, valueType=3, value=None))
                continue
            raw = g.fields[key] if idx is None else g.fields[key][idx]
            value = SimpleNamespace(ullVal=raw)
            out.append(SimpleNamespace(nvmlReturn=0, valueType=3, value=value))
        return out

    def nvmlDeviceGetComputeRunningProcesses(self, h: str) -> list[Any]:
        procs = self._get(h, "procs")
        return [SimpleNamespace(pid=pid, usedGpuMemory=used) for pid, used, _ in procs]

    def nvmlDeviceGetGraphicsRunningProcesses(self, h: str) -> list[Any]:
        raise NVMLError(NOT_SUPPORTED)

    def nvmlSystemGetProcessName(self, pid: int) -> bytes:
        for g in self.gpus:
            for p, _, name in g.fields.get("procs", []):
                if p == pid:
                    return str(name).encode()
        raise NVMLError(NOT_FOUND)

    # events: XIDs queued in ``xids`` are delivered one per wait
    def nvmlEventSetCreate(self) -> object:
        return object()

    def nvmlDeviceRegisterEvents(self, h: str, types: int, event_set: object) -> None:
        if "xid" in self._gpu(h).unsupported:
            raise NVMLError(NOT_SUPPORTED)
        self.registered.append(h)

    def nvmlEventSetWait(self, event_set: object, timeout_ms: int) -> Any:
        events = [x for x in self._xids() if x[0] in self.registered]
        if len(events) <= self.delivered:
            time.sleep(min(timeout_ms, 50) / 1000)
            raise NVMLError(TIMEOUT)
        uuid, xid = events[self.delivered]
        self.delivered += 1
        return SimpleNamespace(device=uuid, eventType=0x8, eventData=xid)

    def nvmlEventSetFree(self, event_set: object) -> None: ...


def from_env() -> FakeNvml:
    return FakeNvml([], Path(os.environ["KILN_FAKE_NVML_SPEC"]))


def write_spec(path: Path, gpus: list[FakeGpu], xids: tuple[tuple[str, int], ...] = ()) -> None:
    doc = {
        "gpus": [
            {"uuid": g.uuid, "fields": g.fields, "unsupported": sorted(g.unsupported)} for g in gpus
        ],
        "xids": [list(x) for x in xids],
    }
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(doc))
    tmp.replace(path)  # atomic: the agent never reads half a file
