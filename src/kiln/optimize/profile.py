"""Profile a candidate: latency percentiles and throughput per batch size, memory, file size.

Each batch size runs for a fixed time slice (at least a few iterations) after a warm-up, so a
run's total time is bounded and predictable: candidates x batch sizes x ``seconds``.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from kiln.optimize.data import Batch, tile_to
from kiln.optimize.gpu import GpuMemory
from kiln.optimize.types import BatchProfile, Profile

_WARMUP = 3
_MIN_ITERATIONS = 5
_MAX_ITERATIONS = 5000


def rss_mb() -> float:
    """This process's resident set size, from /proc (0.0 where there is none)."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024.0
    except OSError:
        pass
    return 0.0


def time_batch(run: object, feed: Batch, batch_size: int, seconds: float) -> BatchProfile:
    assert callable(run)
    for _ in range(_WARMUP):
        run(None, feed)
    times: list[float] = []
    deadline = time.perf_counter() + seconds
    while len(times) < _MIN_ITERATIONS or (
        time.perf_counter() < deadline and len(times) < _MAX_ITERATIONS
    ):
        start = time.perf_counter()
        run(None, feed)
        times.append(time.perf_counter() - start)
    ms = np.asarray(times) * 1000.0
    return BatchProfile(
        batch_size=batch_size,
        p50_ms=float(np.percentile(ms, 50)),
        p99_ms=float(np.percentile(ms, 99)),
        throughput=batch_size * len(times) / float(np.sum(times)),
        iterations=len(times),
    )


def profile(
    open_runner: Callable[[], Any],
    path: Path,
    data: Batch,
    batch_sizes: list[int],
    seconds: float,
    gpu: GpuMemory | None = None,
) -> Profile:
    """Time what ``open_runner()`` returns (anything with ``InferenceSession.run``'s shape)."""
    gc.collect()
    before = rss_mb()
    gpu_before = gpu.read_mb() if gpu is not None else None
    runner = open_runner()
    batches = [time_batch(runner.run, tile_to(data, size), size, seconds) for size in batch_sizes]
    grown = max(0.0, rss_mb() - before)
    gpu_after = gpu.read_mb() if gpu is not None else None
    gpu_mb = (
        max(0.0, gpu_after - gpu_before)
        if gpu_after is not None and gpu_before is not None
        else None
    )
    close = getattr(runner, "close", None)
    if close is not None:
        close()
    del runner
    return Profile(
        batches=batches,
        rss_mb=grown,
        file_size_mb=path.stat().st_size / (1024.0 * 1024.0),
        gpu_mb=gpu_mb,
    )
