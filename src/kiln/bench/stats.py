"""Pure arithmetic of a measurement: percentiles, windows, stability, per-level summary."""

from __future__ import annotations

import math
import os
import resource
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from kiln.bench.control import StatsSnapshot

STABLE_WINDOWS = 3  # perf_analyzer judges stability over the last three windows


def own_cpu() -> float:
    """CPU seconds (user+system) of this process, every thread included (gRPC's too)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def process_tree_cpu(root: int) -> float:
    """utime+stime of ``root`` and all its descendants (Triton's python stubs are children)."""
    parents: dict[int, int] = {}
    times: dict[int, float] = {}
    ticks = os.sysconf("SC_CLK_TCK")
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:  # the process exited while we looked
            continue
        parents[int(entry.name)] = int(stat[1])
        times[int(entry.name)] = (int(stat[11]) + int(stat[12])) / ticks
    total, todo = 0.0, [root]
    while todo:
        pid = todo.pop()
        total += times.get(pid, 0.0)
        todo.extend(child for child, parent in parents.items() if parent == pid)
    return total


def percentile(sorted_values: Sequence[float], p: float) -> float:
    """Nearest-rank percentile (the value at rank ceil(p/100 * n)), as perf_analyzer reports."""
    if not sorted_values:
        return 0.0
    rank = max(1, math.ceil(p / 100.0 * len(sorted_values)))
    return sorted_values[min(rank, len(sorted_values)) - 1]


@dataclass(slots=True)
class Window:
    """One measurement window: completed requests' latencies (s), failures, CPU, server delta."""

    seconds: float
    latencies: list[float]
    errors: int = 0
    client_cpu_s: float = 0.0
    server: StatsSnapshot = field(default_factory=StatsSnapshot)
    dropped: int = 0
    late: int = 0
    responses: int = 0  # streamed requests' responses with outputs

    @property
    def throughput(self) -> float:
        return len(self.latencies) / self.seconds if self.seconds > 0 else 0.0

    def latency(self, pct: int | None) -> float:
        """Average latency, or the given percentile when stability is judged on one."""
        if not self.latencies:
            return 0.0
        if pct is None:
            return sum(self.latencies) / len(self.latencies)
        return percentile(sorted(self.latencies), pct)


def within(values: Sequence[float], percentage: float) -> bool:
    """Every value within ``percentage`` % of the values' mean (and the mean is not zero)."""
    mean = sum(values) / len(values)
    return mean > 0 and all(abs(v - mean) <= mean * percentage / 100.0 for v in values)


def is_stable(windows: Sequence[Window], percentage: float, pct: int | None = None) -> bool:
    """Throughput and latency of the last three windows all within ``percentage`` %."""
    if len(windows) < STABLE_WINDOWS:
        return False
    last = windows[-STABLE_WINDOWS:]
    return within([w.throughput for w in last], percentage) and within(
        [w.latency(pct) for w in last], percentage
    )


@dataclass(slots=True)
class LevelResult:
    """What one load level measured, over its last (up to three) windows."""

    concurrency: int | None
    request_rate: float | None
    batch_size: int
    requests: int
    errors: int
    seconds: float
    stable: bool
    windows: int
    latency_us: dict[str, float]  # avg, p50, p90, p95, p99
    server_us: dict[str, float]  # queue, compute_input, compute_infer, compute_output per request
    server_requests: int  # success count delta over the same windows
    client_cpu_us_per_request: float
    dropped: int = 0
    late: int = 0
    responses: int = 0  # streamed: responses with outputs (a decoupled model's 0..N each)

    @property
    def requests_per_sec(self) -> float:
        return self.requests / self.seconds if self.seconds > 0 else 0.0

    @property
    def responses_per_sec(self) -> float:
        return self.responses / self.seconds if self.seconds > 0 else 0.0

    @property
    def throughput(self) -> float:
        """Inferences per second (requests x batch size), perf_analyzer's headline figure."""
        return self.requests_per_sec * self.batch_size


def summarize(
    windows: Sequence[Window],
    stable: bool,
    batch_size: int,
    concurrency: int | None = None,
    request_rate: float | None = None,
) -> LevelResult:
    used = list(windows[-STABLE_WINDOWS:])
    lat = sorted(x for w in used for x in w.latencies)
    server = StatsSnapshot()
    for w in used:
        server = server + w.server
    n = len(lat)
    latency = {
        "avg": sum(lat) / n * 1e6 if n else 0.0,
        **{f"p{p}": percentile(lat, p) * 1e6 for p in (50, 90, 95, 99)},
    }
    done = max(server.success_count, 1)
    server_us = {
        "queue": server.queue_ns / done / 1e3,
        "compute_input": server.compute_input_ns / done / 1e3,
        "compute_infer": server.compute_infer_ns / done / 1e3,
        "compute_output": server.compute_output_ns / done / 1e3,
    }
    errors = sum(w.errors for w in used)
    cpu = sum(w.client_cpu_s for w in used)
    return LevelResult(
        concurrency=concurrency,
        request_rate=request_rate,
        batch_size=batch_size,
        requests=n,
        errors=errors,
        seconds=sum(w.seconds for w in used),
        stable=stable,
        windows=len(windows),
        latency_us=latency,
        server_us=server_us,
        server_requests=server.success_count,
        client_cpu_us_per_request=cpu / max(n + errors, 1) * 1e6,
        dropped=sum(w.dropped for w in used),
        late=sum(w.late for w in used),
        responses=sum(w.responses for w in used),
    )
