"""The dynamic batcher (``dynamic_batching {}``): queued requests become batches.

One asyncio task forms batches; it takes a batch only once an instance is free, so while
every instance computes, requests pile up and the next batch grows by itself. A batch is
sent as soon as it is full (``max_batch_size``) or reaches a ``preferred_batch_size``;
otherwise it waits for more until its oldest request has waited
``max_queue_delay_microseconds``. Merging, compute and splitting run on the instance's
own thread, so the event loop never copies a tensor.
"""

from __future__ import annotations

import asyncio
import logging
import time

import numpy as np

from kiln.config.model_config_pb2 import ModelConfig
from kiln.core.errors import KilnError, internal, unavailable
from kiln.core.stats import ModelStats
from kiln.scheduling.base import Instance, Job, Scheduler
from kiln.scheduling.batch import merge_inputs, output_names, split_outputs
from kiln.scheduling.policy import QueuePolicy
from kiln.scheduling.queue import Pending, RequestQueue, shape_key

log = logging.getLogger(__name__)

# One output dict per request of a batch, in batch order; a backend that takes requests
# unmerged may fail one request alone (its entry is then the error).
Outputs = list[dict[str, np.ndarray] | KilnError]
Outcome = Outputs | BaseException


class DynamicScheduler(Scheduler):
    def __init__(
        self, instances: list[Instance], stats: ModelStats, model: str, config: ModelConfig
    ) -> None:
        super().__init__(instances, stats, model)
        db = config.dynamic_batching
        # A model without a batch dimension still gets queue policy and priorities, but
        # every request runs alone.
        self.batching = config.max_batch_size > 0
        self.max_batch_size = max(config.max_batch_size, 1)
        self.preferred = frozenset(
            s for s in db.preferred_batch_size if 0 < s <= self.max_batch_size
        )
        self.max_delay_ns = db.max_queue_delay_microseconds * 1000
        self.preserve_ordering = db.preserve_ordering
        self.policy = QueuePolicy.from_config(model, db)
        self.queue = RequestQueue(self.policy)
        self._free: asyncio.Queue[Instance] = asyncio.Queue()
        for inst in instances:
            self._free.put_nowait(inst)
        self._changed = asyncio.Event()
        self._closing = False
        self._running: set[asyncio.Task[None]] = set()
        self._formed = 0  # batches formed so far: the next batch's sequence number
        self._released = 0  # preserve_ordering: the next batch allowed to answer
        self._finished: dict[int, tuple[list[Pending], Outcome]] = {}
        self._task = asyncio.get_running_loop().create_task(
            self._run(), name=f"kiln-batcher-{model}"
        )
        self._task.add_done_callback(self._on_batcher_exit)

    @property
    def pending(self) -> int:
        return len(self.queue)

    # ---- requests in -------------------------------------------------------------------
    async def schedule(self, job: Job) -> dict[str, np.ndarray]:
        if self._closing:
            raise unavailable(f"model '{self.model}' is unloading")
        level = self.policy.level_of(job.parameters)
        timeout_ns = self.policy.timeout_ns(level, job.parameters)
        loop = asyncio.get_running_loop()
        item = Pending(
            job,
            loop.create_future(),
            level,
            time.monotonic_ns(),
            shape_key(job.inputs, self.batching),
        )
        self.queue.push(item)
        if timeout_ns:
            item.timer = loop.call_later(timeout_ns / 1e9, self._on_timeout, item)
            if not self.policy.levels[level - 1].delay_on_timeout:
                # The same bound then holds while it executes, where a backend can enforce
                # it (the Python backend kills a worker that overruns it).
                job.deadline_ns = item.enqueued_ns + timeout_ns
        self._changed.set()
        try:
            return await item.future
        except asyncio.CancelledError:
            # The caller went away while queued: free its place instead of computing it.
            if item.timer is not None:
                item.timer.cancel()
            if self.queue.remove(item):
                self._changed.set()
            raise

    def _on_timeout(self, item: Pending) -> None:
        item.timer = None
        if self.policy.levels[item.level - 1].delay_on_timeout:
            if self.queue.delay(item):
                self._changed.set()
        elif self.queue.remove(item):
            if not item.future.done():
                # Triton's exact text: clients written for Triton compare it.
                item.future.set_exception(unavailable("Request timeout expired"))
            self._changed.set()

    # ---- batch formation ---------------------------------------------------------------
    async def _run(self) -> None:
        while True:
            instance = await self._free.get()
            batch = await self._next_batch()
            if batch is None:
                self._free.put_nowait(instance)
                return
            self._dispatch(instance, batch)

    async def _next_batch(self) -> list[Pending] | None:
        loop = asyncio.get_running_loop()
        while True:
            self._changed.clear()
            if not len(self.queue):
                if self._closing:
                    return None
                await self._changed.wait()
                continue
            count, deadline = self.plan(time.monotonic_ns())
            if count:
                return self.queue.pop_front(count)
            wake = loop.call_later((deadline - time.monotonic_ns()) / 1e9, self._changed.set)
            await self._changed.wait()
            wake.cancel()

    def plan(self, now_ns: int) -> tuple[int, int]:
        """``(n, 0)``: send the first n queued requests now; ``(0, t)``: wait until t.

        Walks the queue in dequeue order and stops at the first request that would overflow
        ``max_batch_size`` or whose shapes differ: skipping it would reorder requests.
        """
        total = count = best = 0
        key = None
        oldest = now_ns
        blocked = False
        for item in self.queue:
            if count and (item.key != key or total + item.batch_size > self.max_batch_size):
                blocked = True  # waiting longer cannot grow this batch
                break
            key = item.key
            total += item.batch_size
            count += 1
            oldest = min(oldest, item.enqueued_ns)
            if total in self.preferred:
                best = count
            if total >= self.max_batch_size:
                return count, 0
        if best:
            return best, 0
        deadline = oldest + self.max_delay_ns
        if blocked or self._closing or now_ns >= deadline:
            return count, 0
        return 0, deadline

    def _dispatch(self, instance: Instance, batch: list[Pending]) -> None:
        now = time.monotonic_ns()
        for item in batch:
            if item.timer is not None:
                item.timer.cancel()
                item.timer = None
            item.job.times.queue_end = now
        seq = self._formed
        self._formed += 1
        # Submitted here, not from inside the task: a new task first runs on the loop's next
        # iteration, which under load is milliseconds away (measured: benchmarks/README.md).
        running = instance.submit(self._compute, instance, [p.job for p in batch])
        task = asyncio.get_running_loop().create_task(self._execute(instance, batch, seq, running))
        self._running.add(task)
        task.add_done_callback(self._running.discard)

    # ---- execution ---------------------------------------------------------------------
    async def _execute(
        self, instance: Instance, batch: list[Pending], seq: int, running: asyncio.Future[Outputs]
    ) -> None:
        outcome: Outcome
        try:
            outcome = await running
        except Exception as exc:
            outcome = exc
        finally:
            self._free.put_nowait(instance)  # a failed batch does not take the instance down
        self._finish(seq, batch, outcome)

    def _compute(self, instance: Instance, jobs: list[Job]) -> Outputs:
        """On the instance's thread: merge, execute, split; stamps every request's times."""
        parts: Outputs
        if instance.backend.wants_requests:
            parts, start, end = instance.execute_requests(jobs)
        else:
            inputs = merge_inputs(jobs)
            outputs, start, end = instance.execute(inputs, output_names(jobs))
            parts = list(split_outputs(outputs, jobs, self.model))
        done = time.monotonic_ns()
        queue_end = jobs[0].times.queue_end
        for job in jobs:
            job.times.input_end = start
            job.times.infer_end = end
            job.times.output_end = done
        size = sum(job.batch_size for job in jobs)
        self.stats.record_execution(size, start - queue_end, end - start, done - end)
        return parts

    def _finish(self, seq: int, batch: list[Pending], outcome: Outcome) -> None:
        if not self.preserve_ordering:
            self._resolve(batch, outcome)
            return
        # Hold a batch that finished early until every batch formed before it has answered.
        self._finished[seq] = (batch, outcome)
        while self._released in self._finished:
            self._resolve(*self._finished.pop(self._released))
            self._released += 1

    def _resolve(self, batch: list[Pending], outcome: Outcome) -> None:
        if isinstance(outcome, BaseException) and not isinstance(outcome, KilnError):
            log.error("model '%s': batch failed", self.model, exc_info=outcome)
        for i, item in enumerate(batch):
            if item.future.done():  # its caller gave up
                continue
            if isinstance(outcome, BaseException):
                item.future.set_exception(self._error(outcome))
                continue
            part = outcome[i]
            if isinstance(part, KilnError):
                item.future.set_exception(self._error(part))
            else:
                item.future.set_result(part)

    def _error(self, exc: BaseException) -> KilnError:
        # One exception object per request: each caller's traceback stays its own.
        if isinstance(exc, KilnError):
            return KilnError(exc.message, exc.status)
        return internal(f"model '{self.model}' failed to execute: {type(exc).__name__}: {exc}")

    # ---- shutdown ----------------------------------------------------------------------
    def _on_batcher_exit(self, task: asyncio.Task[None]) -> None:
        if task.cancelled() or task.exception() is None:
            return
        log.error("model '%s': batcher stopped", self.model, exc_info=task.exception())
        for item in self.queue.pop_front(len(self.queue)):
            if not item.future.done():
                item.future.set_exception(internal(f"model '{self.model}': batcher stopped"))

    def flush(self) -> None:
        self._closing = True
        self._changed.set()

    async def close(self) -> None:
        """Run what is still queued (without waiting out delays), then close instances."""
        self.flush()
        await asyncio.gather(self._task, return_exceptions=True)
        if self._running:
            await asyncio.gather(*self._running, return_exceptions=True)
        await super().close()
