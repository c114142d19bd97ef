"""The default scheduler: no batching across requests; each request takes a free instance."""

from __future__ import annotations

import asyncio
import time

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
        try:
            job.times.queue_end = time.monotonic_ns()
            if instance.backend.wants_requests:
                outcomes, start, end = await instance.submit_requests([job])
                outputs = outcomes[0]
            else:
                outputs, start, end = await instance.run(job.inputs, job.output_names)
        finally:
            self._free.put_nowait(instance)
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
