"""The default scheduler: no batching across requests; each request takes a free instance."""

from __future__ import annotations

import asyncio
import functools
import time
from typing import Any

import numpy as np

from kiln.core.errors import KilnError
from kiln.scheduling.base import Instance, Job, Scheduler, free_slots


class DirectScheduler(Scheduler):
    def __init__(self, instances: list[Instance], stats, model: str) -> None:  # type: ignore[no-untyped-def]
        super().__init__(instances, stats, model)
        # One entry per batch an instance may have started at once (``free_slots``).
        self._free: asyncio.Queue[Instance] = asyncio.Queue()
        for inst in free_slots(instances):
            self._free.put_nowait(inst)
        self._waiting = 0

    @property
    def pending(self) -> int:
        return self._waiting

    async def schedule(self, job: Job) -> dict[str, np.ndarray]:
        self._waiting += 1
        try:
            instance = await self._free.get()
        finally:
            self._waiting -= 1
        job.times.queue_end = time.monotonic_ns()
        try:
            running: asyncio.Future[tuple[Any, int, int]]
            if instance.backend.wants_requests:
                running = instance.submit_requests([job])
            else:
                running = instance.submit(instance.execute, job.inputs, job.output_names)
        except BaseException:
            self._free.put_nowait(instance)
            raise
        # The instance's slot comes back when its work ends, not when the caller stops
        # waiting: a caller that goes away (client disconnect) must not let another batch
        # in while this one still computes (a Python worker's pipe holds a fixed number).
        running.add_done_callback(functools.partial(self._release, instance))
        result, start, end = await asyncio.shield(running)
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
        return outputs

    def _release(self, instance: Instance, running: asyncio.Future[Any]) -> None:
        if not running.cancelled():
            running.exception()  # retrieved: nobody may be waiting for it any more
        self._free.put_nowait(instance)
