"""Host CPU and memory, from /proc (Linux), with Triton's family names.

Sampled by the telemetry thread at ``--metrics-interval-ms``; a scrape only reads the
last sample. Where /proc is missing (not Linux) the families are simply not exposed.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kiln.metrics import names

log = logging.getLogger(__name__)


@dataclass(slots=True)
class HostSample:
    cpu_utilization: float
    memory_total_bytes: int
    memory_used_bytes: int


def read_cpu_times(proc: Path) -> tuple[int, int]:
    """(busy, total) jiffies across all cores from the aggregate ``cpu`` line."""
    fields = (proc / "stat").read_text().split("\n", 1)[0].split()
    # user nice system idle iowait irq softirq steal (guest time is already in user)
    values = [int(v) for v in fields[1:9]]
    idle = values[3] + values[4]
    total = sum(values)
    return total - idle, total


def read_memory(proc: Path) -> tuple[int, int]:
    """(total, used) bytes; used = MemTotal - MemAvailable, what the kernel cannot hand out."""
    info: dict[str, int] = {}
    for line in (proc / "meminfo").read_text().splitlines():
        key, _, rest = line.partition(":")
        parts = rest.split()
        if parts:
            info[key] = int(parts[0]) * 1024  # values are in kB
    total = info.get("MemTotal", 0)
    available = info.get("MemAvailable", info.get("MemFree", 0))
    return total, max(total - available, 0)


class HostCollector(Collector):
    def __init__(self, proc: Path = Path("/proc")) -> None:
        self.proc = proc
        self._prev = (0, 0)  # first sample: utilization averaged since boot
        self.latest: HostSample | None = None
        self._warned = False

    def sample(self) -> None:
        try:
            busy, total = read_cpu_times(self.proc)
            mem_total, mem_used = read_memory(self.proc)
        except (OSError, ValueError, IndexError) as exc:
            if not self._warned:
                log.info("CPU metrics disabled: cannot read %s (%s)", self.proc, exc)
                self._warned = True
            self.latest = None
            return
        d_busy, d_total = busy - self._prev[0], total - self._prev[1]
        self._prev = (busy, total)
        util = d_busy / d_total if d_total > 0 else 0.0
        self.latest = HostSample(min(max(util, 0.0), 1.0), mem_total, mem_used)

    def collect(self) -> Iterator[Metric]:
        s = self.latest
        if s is None:
            return
        yield GaugeMetricFamily(
            names.CPU_UTILIZATION,
            "CPU utilization rate [0.0 - 1.0], all cores, since the last sample",
            value=s.cpu_utilization,
        )
        yield GaugeMetricFamily(
            names.CPU_MEMORY_TOTAL_BYTES,
            "CPU total memory (RAM), in bytes",
            value=s.memory_total_bytes,
        )
        yield GaugeMetricFamily(
            names.CPU_MEMORY_USED_BYTES,
            "CPU used memory (RAM), in bytes",
            value=s.memory_used_bytes,
        )
