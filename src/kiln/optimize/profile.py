"""Profile candidates: latency percentiles and throughput per batch size, memory, file size.

All runners (the FP32 baseline first, then every accepted candidate) are timed together, in
interleaved rounds: each round gives every runner, in a rotated order, one window of
``seconds / rounds`` per batch size. On a shared machine the speed of the machine itself
changes for seconds at a time (benchmarks/optimize_digits.py on a shared 2-core container: the
same CNN graph ran a batch of 32 in 0.17 ms or 0.32 ms depending on the moment), so:

- One window per runner, taken minutes apart, compared moments, not models: the baseline's own
  graph "was" 1.5x faster than the baseline. Every runner now gets windows spread over the
  same span of the run, and the baseline gets one in every round.
- Neither the lowest nor the median per-window figure is safe alone: when fast moments are
  rare, whoever happened to catch one wins; when they are half the time, the median flips.
  Comparing within a round is: each round's median of a runner is divided by the reference's
  (the baseline's) median of the same round, and a runner's p50 is the reference's p50 times
  the median of those ratios. The reference's own p50 is its lowest per-round median (load
  only adds time), so every p50 reads as "on this machine at its quietest in this run".
- p99 pools every timed call of the runner, unscaled, so a latency budget is checked against
  the real tail, noise included. Throughput is paired with the reference like p50.

``round_p50_ms`` keeps each round's raw median: their spread is the noise.
The total stays runners x batch sizes x ``seconds``, plus a short warm-up per window.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kiln.optimize.data import Batch, tile_to
from kiln.optimize.gpu import GpuMemory
from kiln.optimize.types import BatchProfile, Profile

_WARMUP = 3  # per window: the caches another runner's window evicted
_MIN_ITERATIONS = 5  # per window, however short the window
_MAX_ITERATIONS = 5000  # per window

Clock = Callable[[], float]


@dataclass(slots=True)
class Timed:
    """One thing to profile: how to open it, and its file (for the file size)."""

    open_runner: Callable[[], Any]
    path: Path


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


def time_window(run: Callable[..., Any], feed: Batch, seconds: float,
                clock: Clock = time.perf_counter) -> list[float]:  # fmt: skip
    """Seconds per call of ``run(None, feed)`` over one window, after a short warm-up."""
    for _ in range(_WARMUP):
        run(None, feed)
    times: list[float] = []
    deadline = clock() + seconds
    while len(times) < _MIN_ITERATIONS or (clock() < deadline and len(times) < _MAX_ITERATIONS):
        start = clock()
        run(None, feed)
        times.append(clock() - start)
    return times


def _round_figures(batch_size: int, windows: Sequence[Sequence[float]]
                   ) -> tuple[list[float], list[float]]:  # fmt: skip
    """Per round: the median in ms, and the rate in samples per second."""
    medians = [float(np.median(w)) * 1000.0 for w in windows]
    rates = [batch_size * len(w) / float(np.sum(w)) for w in windows]
    return medians, rates


def summarize(batch_size: int, windows: Sequence[Sequence[float]],
              reference: Sequence[Sequence[float]] | None = None) -> BatchProfile:  # fmt: skip
    """One batch size's figures from its windows (seconds per call, one list per round).

    Without ``reference`` (the reference itself): the lowest per-round median and the highest
    per-round rate. With it (the reference's windows, round for round): the reference's figures
    times this runner's median per-round ratio to it.
    """
    medians, rates = _round_figures(batch_size, windows)
    if reference is None:
        p50, rate = min(medians), max(rates)
    else:
        ref_medians, ref_rates = _round_figures(batch_size, reference)
        if len(ref_medians) != len(medians):
            raise ValueError("the reference must have one window per round, as the runner")
        p50 = min(ref_medians) * float(np.median(np.divide(medians, ref_medians)))
        rate = max(ref_rates) * float(np.median(np.divide(rates, ref_rates)))
    pooled = np.concatenate([np.asarray(w, dtype=np.float64) for w in windows]) * 1000.0
    return BatchProfile(
        batch_size=batch_size,
        p50_ms=p50,
        p99_ms=float(np.percentile(pooled, 99)),
        throughput=rate,
        iterations=int(pooled.size),
        round_p50_ms=medians,
    )


def round_order(count: int, round_index: int) -> list[int]:
    """Runner order in a round: rotated by one each round, so no runner always follows the same
    neighbour or always goes first after the warm-up of the whole run."""
    shift = round_index % count if count else 0
    return list(range(shift, count)) + list(range(shift))


def profile_all(
    timed: Sequence[Timed],
    data: Batch,
    batch_sizes: list[int],
    seconds: float,
    rounds: int = 5,
    gpu: GpuMemory | None = None,
    on_round: Callable[[int], None] | None = None,
    clock: Clock = time.perf_counter,
) -> list[Profile]:
    """Profile every runner in ``timed`` in ``rounds`` interleaved rounds; one Profile each.

    ``timed[0]`` is the reference the others are paired with, round for round (see the module
    docstring). Runners are opened in the first round, in order, and stay open until the last one is
    timed, so host RSS / GPU memory is what each one added when it was opened and warmed (its
    first round), with those before it already loaded.
    """
    rounds = max(1, rounds)
    window = seconds / rounds
    feeds = {size: tile_to(data, size) for size in batch_sizes}
    runners: list[Any] = [None] * len(timed)
    rss: list[float] = [0.0] * len(timed)
    gpu_mb: list[float | None] = [None] * len(timed)
    windows: list[dict[int, list[list[float]]]] = [
        {size: [] for size in batch_sizes} for _ in timed
    ]

    def open_and_time(i: int) -> None:
        gc.collect()
        before = rss_mb()
        gpu_before = gpu.read_mb() if gpu is not None else None
        runners[i] = timed[i].open_runner()
        time_all(i)
        rss[i] = max(0.0, rss_mb() - before)
        gpu_after = gpu.read_mb() if gpu is not None else None
        if gpu_after is not None and gpu_before is not None:
            gpu_mb[i] = max(0.0, gpu_after - gpu_before)

    def time_all(i: int) -> None:
        for size in batch_sizes:
            windows[i][size].append(time_window(runners[i].run, feeds[size], window, clock))

    try:
        for r in range(rounds):
            if on_round is not None:
                on_round(r)
            for i in round_order(len(timed), r):
                if r == 0:
                    open_and_time(i)
                else:
                    time_all(i)
    finally:
        for runner in runners:
            close = getattr(runner, "close", None)
            if close is not None:
                close()
        runners.clear()
    return [
        Profile(
            batches=[
                summarize(size, windows[i][size], windows[0][size] if i else None)
                for size in batch_sizes
            ],
            rss_mb=rss[i],
            file_size_mb=t.path.stat().st_size / (1024.0 * 1024.0),
            gpu_mb=gpu_mb[i],
        )
        for i, t in enumerate(timed)
    ]
