"""The dynamic batcher (``dynamic_batching {}``): queued requests become batches.

Batches form in plain loop callbacks, not a task: ``_pump`` runs (once per loop
iteration at most) when a request arrives, an instance frees up, a delay or timeout
expires. It takes a batch only once an instance is free, so while every instance
computes, requests pile up and the next batch grows by itself. A batch is
sent as soon as it is full (``max_batch_size``) or reaches a ``preferred_batch_size``;
otherwise it waits for more until its oldest request has waited
``max_queue_delay_microseconds``. Merging, compute and splitting run on the instance's
own thread, so the event loop never copies a tensor.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections import deque
from typing import Any

import numpy as np

from kiln.config.model_config_pb2 import ModelConfig
from kiln.core.errors import KilnError, internal, unavailable
from kiln.core.stats import ModelStats
from kiln.scheduling.base import Instance, Job, Scheduler
from kiln.scheduling.batch import merge_inputs, output_names, split_outputs
from kiln.scheduling.policy import QueuePolicy
from kiln.scheduling.queue import Pending, RequestQueue, shape_key
from kiln.scheduling.ragged import RaggedBatching

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
        self.ragged = RaggedBatching.of(config)
        # inputs whose shapes need not agree within a batch (``allow_ragged_batch``)
        self.ragged_inputs = self.ragged.ragged if self.ragged else frozenset()
        self._free: deque[Instance] = deque(instances)  # first free, first used
        self._closing = False
        self._pump_soon = False  # a _pump is already scheduled for this loop iteration
        self._timer: asyncio.TimerHandle | None = None  # wakes _pump when a delay expires
        self._timer_at = 0  # its deadline, monotonic ns
        self._running: set[asyncio.Future[Any]] = set()
        self._formed = 0  # batches formed so far: the next batch's sequence number
        self._released = 0  # preserve_ordering: the next batch allowed to answer
        self._finished: dict[int, tuple[list[Pending], Outcome]] = {}
        self._loop = asyncio.get_running_loop()

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
            shape_key(job.inputs, self.batching, self.ragged_inputs),
        )
        self.queue.push(item)
        if timeout_ns:
            item.timer = loop.call_later(timeout_ns / 1e9, self._on_timeout, item)
            if not self.policy.levels[level - 1].delay_on_timeout:
                # The same bound then holds while it executes, where a backend can enforce
                # it (the Python backend kills a worker that overruns it).
                job.deadline_ns = item.enqueued_ns + timeout_ns
        self._kick()
        try:
            return await item.future
        except asyncio.CancelledError:
            # The caller went away while queued: free its place instead of computing it.
            if item.timer is not None:
                item.timer.cancel()
            if self.queue.remove(item):
                self._kick()
            raise

    def _on_timeout(self, item: Pending) -> None:
        item.timer = None
        if self.policy.levels[item.level - 1].delay_on_timeout:
            if self.queue.delay(item):
                self._kick()
        elif self.queue.remove(item):
            if not item.future.done():
                # Triton's exact text: clients written for Triton compare it.
                item.future.set_exception(unavailable("Request timeout expired"))
            self._kick()

    # ---- batch formation ---------------------------------------------------------------
    def _kick(self) -> None:
        """Form batches on this loop iteration's tail: requests that arrive together (one
        read can parse several) get the chance to share a batch."""
        if not self._pump_soon:
            self._pump_soon = True
            self._loop.call_soon(self._pump)

    def _pump(self) -> None:
        self._pump_soon = False
        try:
            while self._free and len(self.queue):
                count, deadline = self.plan(time.monotonic_ns())
                if not count:
                    self._wake_at(deadline)
                    return
                self._dispatch(self._free.popleft(), self.queue.pop_front(count))
        except Exception as exc:  # a bug here must not leave callers waiting forever
            log.error("model '%s': batcher failed", self.model, exc_info=exc)
            for item in self.queue.pop_front(len(self.queue)):
                if not item.future.done():
                    item.future.set_exception(internal(f"model '{self.model}': batcher failed"))

    def _wake_at(self, deadline_ns: int) -> None:
        if self._timer is not None:
            if self._timer_at <= deadline_ns:
                return  # an earlier wake-up re-plans anyway
            self._timer.cancel()
        self._timer_at = deadline_ns
        delay = max(0.0, (deadline_ns - time.monotonic_ns()) / 1e9)
        self._timer = self._loop.call_later(delay, self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        self._pump()

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
        # Handed to the instance's thread at once; completion comes back as a callback, so
        # a batch costs no task and no extra loop iteration (measured: benchmarks/HISTORY.md).
        jobs = [p.job for p in batch]
        running: asyncio.Future[Any]
        if instance.backend.wants_requests:
            # Unmerged requests; a backend may drive them from the loop (Python backend).
            running = instance.submit_requests(jobs)
            running.add_done_callback(
                functools.partial(self._on_requests_done, instance, batch, seq)
            )
        else:
            running = instance.submit(self._compute, instance, jobs, jobs=jobs)
            running.add_done_callback(functools.partial(self._on_done, instance, batch, seq))
        self._running.add(running)

    # ---- execution ---------------------------------------------------------------------
    def _on_done(
        self, instance: Instance, batch: list[Pending], seq: int, done: asyncio.Future[Outputs]
    ) -> None:
        self._running.discard(done)
        self._free.append(instance)  # a failed batch does not take the instance down
        outcome: Outcome
        if done.cancelled():
            outcome = asyncio.CancelledError()
        else:
            error = done.exception()
            outcome = error if error is not None else done.result()
        self._finish(seq, batch, outcome)
        if len(self.queue):
            self._pump()

    def _on_requests_done(
        self,
        instance: Instance,
        batch: list[Pending],
        seq: int,
        done: asyncio.Future[tuple[Outputs, int, int]],
    ) -> None:
        parts: asyncio.Future[Outputs] = asyncio.get_running_loop().create_future()
        if done.cancelled():
            parts.cancel()
        elif (error := done.exception()) is not None:
            parts.set_exception(error)
        else:
            outcomes, start, end = done.result()
            self._stamp([p.job for p in batch], start, end)
            parts.set_result(outcomes)
        self._running.discard(done)
        self._on_done(instance, batch, seq, parts)

    def _compute(self, instance: Instance, jobs: list[Job]) -> Outputs:
        """On the instance's thread: merge, execute, split; stamps every request's times."""
        ragged = self.ragged
        inputs = ragged.merge(jobs) if ragged else merge_inputs(jobs)
        outputs, start, end = instance.execute(inputs, output_names(jobs))
        split = ragged.split(outputs, jobs) if ragged else split_outputs(outputs, jobs, self.model)
        parts: Outputs = list(split)
        self._stamp(jobs, start, end)
        return parts

    def _stamp(self, jobs: list[Job], start: int, end: int) -> None:
        """Every request's times and the batch's statistics, once it has run."""
        done = time.monotonic_ns()
        queue_end = jobs[0].times.queue_end
        for job in jobs:
            job.times.input_end = start
            job.times.infer_end = end
            job.times.output_end = done
        size = sum(job.batch_size for job in jobs)
        self.stats.record_execution(size, start - queue_end, end - start, done - end)

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
    def flush(self) -> None:
        self._closing = True
        self._kick()

    async def close(self) -> None:
        """Run what is still queued (without waiting out delays), then close instances."""
        self.flush()
        while len(self.queue) or self._running:
            if self._running:
                await asyncio.gather(*self._running, return_exceptions=True)
            else:
                await asyncio.sleep(0)  # let the scheduled _pump dispatch the rest
        if self._timer is not None:
            self._timer.cancel()
        await super().close()
