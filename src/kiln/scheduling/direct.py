"""The default scheduler: no batching across requests; each request takes a free instance."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections import deque
from typing import Any, cast

import numpy as np

from kiln.core.errors import KilnError
from kiln.scheduling.base import Instance, Job, Scheduler, free_slots
from kiln.scheduling.ragged import RaggedBatching


class DirectScheduler(Scheduler):
    def __init__(  # type: ignore[no-untyped-def]
        self, instances: list[Instance], stats, model: str, ragged: RaggedBatching | None = None
    ) -> None:
        """``ragged``: the model's batch inputs and scattered outputs (a batch of one)."""
        super().__init__(instances, stats, model)
        self.ragged = ragged
        # One entry per batch an instance may have started at once (``free_slots``).
        self._idle: deque[Instance] = deque(free_slots(instances))
        # Callers waiting for a slot, oldest first. A freed slot is handed to the oldest
        # directly: with a queue a newcomer could take it first and send a woken waiter
        # to the back again, so some requests waited many times their share (p99 of 15-27
        # ms against a p50 of 1-3 ms at c=16, benchmarks/HISTORY.md).
        self._waiters: deque[asyncio.Future[Instance]] = deque()

    @property
    def pending(self) -> int:
        # and those queued in a backend behind a running batch (a Python worker's pipe)
        return len(self._waiters) + sum(i.backend.queued_requests for i in self.instances)

    async def _acquire(self) -> Instance:
        if self._idle and not self._waiters:
            return self._idle.popleft()
        waiter: asyncio.Future[Instance] = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            return await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():
                self._release(waiter.result())  # handed a slot, then cancelled: pass it on
            else:
                with contextlib.suppress(ValueError):  # a release may have dropped it
                    self._waiters.remove(waiter)
            raise

    def _release(self, instance: Instance) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(instance)
                return
        self._idle.append(instance)

    async def schedule(self, job: Job) -> dict[str, np.ndarray]:
        instance = await self._acquire()
        job.times.queue_end = time.monotonic_ns()
        try:
            running: asyncio.Future[tuple[Any, int, int]]
            if instance.backend.wants_requests:
                running = instance.submit_requests([job])
            else:
                inputs = self.ragged.merge([job]) if self.ragged else job.inputs
                running = instance.submit(instance.execute, inputs, job.output_names, jobs=[job])
        except BaseException:
            self._release(instance)
            raise
        try:
            result, start, end = await asyncio.shield(running)
        except asyncio.CancelledError:
            # The caller went away (client disconnect) while its batch still computes: the
            # slot comes back when the batch ends, not now, or another batch could join it
            # (a Python worker's pipe holds a fixed number).
            running.add_done_callback(functools.partial(self._finished, instance))
            raise
        except BaseException:
            self._release(instance)
            raise
        self._release(instance)
        outputs = result[0] if instance.backend.wants_requests else result
        # Input preparation happened before the thread hop; the hop itself is input time.
        job.times.input_end = start
        job.times.infer_end = end
        done = time.monotonic_ns()
        job.times.output_end = done
        self.stats.record_execution(
            job.batch_size, start - job.times.queue_end, end - start, done - end
        )
        if isinstance(outputs, KilnError):
            raise outputs
        if self.ragged and not instance.backend.wants_requests:
            return self.ragged.split(outputs, [job])[0]
        return cast("dict[str, np.ndarray]", outputs)

    def _finished(self, instance: Instance, running: asyncio.Future[Any]) -> None:
        if not running.cancelled():
            running.exception()  # retrieved: nobody may be waiting for it any more
        self._release(instance)
