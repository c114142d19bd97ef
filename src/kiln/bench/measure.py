"""Driving load: closed loop (N workers back to back) or open loop (sends on a schedule).

Workers run without pause for the whole level; the measurement cuts their stream into
windows at fixed instants, sampling the server's statistics and this process's CPU at each
cut, so a window's server delta and CPU cover exactly the time its requests completed in.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from kiln.bench.control import StatsSnapshot
from kiln.bench.options import Distribution
from kiln.bench.stats import Window, is_stable, own_cpu
from kiln.bench.transport import RequestError


class Slot(Protocol):
    """What a worker drives: one request at a time on its own connection."""

    async def infer(self) -> int | None:
        """Send one request and wait for it; a streamed request returns how many responses
        carried outputs (a decoupled model's 0..N), others None."""
        ...

    async def close(self) -> None: ...


@dataclass(slots=True)
class Recorder:
    """Completions since the last window cut, plus run-wide totals."""

    latencies: list[float] = field(default_factory=list)
    responses: int = 0  # streamed requests' responses with outputs
    errors: int = 0
    dropped: int = 0
    late: int = 0
    total_ok: int = 0
    total_errors: int = 0
    total_dropped: int = 0
    first_error: str | None = None

    async def timed(self, slot: Slot) -> None:
        t0 = time.perf_counter()
        try:
            answered = await slot.infer()
        except (RequestError, OSError) as exc:
            self.errors += 1
            self.total_errors += 1
            if self.first_error is None:
                self.first_error = str(exc) or type(exc).__name__
            return
        self.latencies.append(time.perf_counter() - t0)
        self.total_ok += 1
        if answered:
            self.responses += answered

    def cut(self) -> tuple[list[float], int, int, int, int]:
        taken = self.latencies, self.errors, self.dropped, self.late, self.responses
        self.latencies, self.errors, self.dropped, self.late, self.responses = [], 0, 0, 0, 0
        return taken


StatsFn = Callable[[], Awaitable[StatsSnapshot]]
OnWindow = Callable[[int, Window], None]


@dataclass(slots=True)
class Plan:
    """How long to measure a level: fixed duration, or windows until stable."""

    interval_s: float
    max_trials: int
    stability_percentage: float
    percentile: int | None = None
    duration_s: float | None = None


async def measure(
    recorder: Recorder, stats: StatsFn, plan: Plan, on_window: OnWindow
) -> tuple[list[Window], bool]:
    """Cut windows while the load runs; stop when stable or out of trials."""
    windows: list[Window] = []
    before, cpu0, t0 = await stats(), own_cpu(), time.perf_counter()
    recorder.cut()  # what completed before the first cut belongs to no window
    trials = 1 if plan.duration_s is not None else plan.max_trials
    interval = plan.duration_s if plan.duration_s is not None else plan.interval_s
    for trial in range(trials):
        await asyncio.sleep(max(0.0, t0 + interval - time.perf_counter()))
        latencies, errors, dropped, late, responses = recorder.cut()
        t1, cpu1 = time.perf_counter(), own_cpu()
        after = await stats()
        window = Window(
            t1 - t0, latencies, errors, cpu1 - cpu0, after - before, dropped, late, responses
        )
        windows.append(window)
        on_window(trial, window)
        # The next window starts after the stats call so its own cost is not counted twice.
        before, cpu0, t0 = after, own_cpu(), time.perf_counter()
        if plan.duration_s is None and is_stable(
            windows, plan.stability_percentage, plan.percentile
        ):
            return windows, True
    return windows, plan.duration_s is not None


async def closed_loop(
    slots: list[Slot], recorder: Recorder, stats: StatsFn, plan: Plan, on_window: OnWindow
) -> tuple[list[Window], bool]:
    """Every slot sends its next request as soon as the previous one completed."""
    stop = False

    async def worker(slot: Slot) -> None:
        while not stop:
            await recorder.timed(slot)

    tasks = [asyncio.create_task(worker(s)) for s in slots]
    try:
        return await measure(recorder, stats, plan, on_window)
    finally:
        stop = True
        # Let in-flight requests finish so run-wide totals match the server's counters.
        await asyncio.gather(*tasks, return_exceptions=True)


def arrival_gaps(rate: float, distribution: Distribution, seed: int = 0) -> Callable[[], float]:
    """Seconds until the next send: constant 1/rate, or exponential (Poisson arrivals)."""
    if distribution is Distribution.CONSTANT:
        return lambda: 1.0 / rate
    rng = np.random.default_rng(seed)
    return lambda: float(rng.exponential(1.0 / rate))


LATE_S = 0.001  # a send more than 1 ms behind its schedule is reported as late


async def open_loop(
    make_slot: Callable[[], Slot],
    max_outstanding: int,
    gaps: Callable[[], float],
    recorder: Recorder,
    stats: StatsFn,
    plan: Plan,
    on_window: OnWindow,
) -> tuple[list[Window], bool]:
    """Send on a schedule; with ``max_outstanding`` requests in flight the send is dropped."""
    idle: deque[Slot] = deque()
    created: list[Slot] = []
    inflight: set[asyncio.Task[None]] = set()

    async def send(slot: Slot) -> None:
        try:
            await recorder.timed(slot)
        finally:
            idle.append(slot)

    async def schedule() -> None:
        due = time.perf_counter()
        while True:
            due += gaps()
            delay = due - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            elif -delay > LATE_S:
                recorder.late += 1  # behind schedule: sent now, as a burst, and counted
            if idle:
                slot = idle.pop()
            elif len(created) < max_outstanding:
                slot = make_slot()
                created.append(slot)
            else:
                recorder.dropped += 1
                recorder.total_dropped += 1
                continue
            task = asyncio.create_task(send(slot))
            inflight.add(task)
            task.add_done_callback(inflight.discard)

    scheduler = asyncio.create_task(schedule())
    try:
        return await measure(recorder, stats, plan, on_window)
    finally:
        scheduler.cancel()
        await asyncio.gather(scheduler, return_exceptions=True)
        await asyncio.gather(*list(inflight), return_exceptions=True)
        await asyncio.gather(*(s.close() for s in created), return_exceptions=True)
