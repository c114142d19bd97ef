"""Instances (a backend on its own thread) and the scheduler interface.

A scheduler decides when and with what an instance runs. Model compute never runs on the
event loop: each instance owns one worker thread, so ``instance_group.count`` = threads.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import queue
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import numpy as np

from kiln.backends.base import (
    Backend,
    BackendRequest,
    NotStarted,
    RequestOutcome,
    ResponseSink,
)
from kiln.core.errors import KilnError, Status
from kiln.core.stats import ModelStats, RequestTimes

if TYPE_CHECKING:
    from kiln.scheduling.rate_limit import Holder, RateLimiter

T = TypeVar("T")
log = logging.getLogger(__name__)


class Stamped(BackendRequest, Protocol):
    """A request an instance runs for a scheduler (``Instance.submit_requests``): a
    ``Job``, or one row of a sequence batch (``RowRequest``). Its ``times`` are stamped
    where it leaves the queue."""

    @property
    def times(self) -> RequestTimes: ...


@dataclass(slots=True)
class Job:
    """One request's work as a scheduler sees it."""

    inputs: dict[str, np.ndarray]
    output_names: list[str]
    batch_size: int
    times: RequestTimes
    parameters: dict[str, Any] = field(default_factory=dict)
    request_id: str = ""
    sink: ResponseSink | None = None  # a decoupled model's responses stream here
    # time.monotonic_ns() by which it must be answered, 0 = none: set by the dynamic
    # batcher from its queue policy; the Python backend also bounds execution by it.
    deadline_ns: int = 0
    trace_id: int = 0  # its trace's id when sampled (a Python model's ``request.trace()``)
    trace_context: str | None = None  # and its OpenTelemetry context (``get_context()``)
    cancelled: bool = False  # its client went away (Triton's request cancellation)
    # The response's parameters as the model set them, for the client (BackendRequest).
    response_parameters: dict[str, Any] | None = None
    _on_cancel: list[Callable[[], None]] | None = None

    @property
    def correlation_id(self) -> int | str:
        """Its ``sequence_id`` parameter, 0 without one (a sequence batch's requests are
        ``RowRequest``, which say their sequence's id and flags)."""
        return self.parameters.get("sequence_id", 0)  # type: ignore[no-any-return]

    @property
    def flags(self) -> int:
        return 0

    def add_cancel_callback(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` when the client goes away (at once if it has). It may be
        called twice when registered from another thread as the cancel happens: it must
        be idempotent."""
        if self._on_cancel is None:
            self._on_cancel = []
        self._on_cancel.append(callback)
        if self.cancelled:
            callback()

    def cancel(self) -> None:
        """On the loop: the request's client went away (a cancelled gRPC call or stream, a
        closed SSE connection). A backend that registered tells its model."""
        if self.cancelled:
            return
        self.cancelled = True
        for callback in list(self._on_cancel or ()):
            try:
                callback()
            except Exception:
                log.exception("a request cancellation callback failed")


class _Worker:
    """One thread running what it is handed, in order, and resolving the caller's future on
    its event loop. Leaner than a one-worker ``ThreadPoolExecutor`` (no work-item object,
    shutdown locks or idle semaphore per call): this hand-off happens once per batch."""

    _STOP = object()

    def __init__(self, name: str) -> None:
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[..., T], args: tuple[Any, ...]) -> asyncio.Future[T]:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()
        self._queue.put((loop, future, fn, args))
        return future

    def _main(self) -> None:
        while True:
            item = self._queue.get()
            if item is self._STOP:
                return
            loop, future, fn, args = item
            try:
                result, error = fn(*args), None
            except BaseException as exc:  # delivered to the awaiting coroutine
                result, error = None, exc
            # A closed loop raises RuntimeError: nobody is waiting any more.
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(_settle, future, result, error)

    def shutdown(self) -> None:
        self._queue.put(self._STOP)
        self._thread.join()


def _failed(error: BaseException) -> asyncio.Future[Any]:
    future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
    future.set_exception(error)
    return future


def _outcome(done: asyncio.Future[Any]) -> tuple[Any, BaseException | None]:
    """(result, None) or (None, exception) of a finished future."""
    error = done.exception()
    return (None, error) if error is not None else (done.result(), None)


def _settle(future: asyncio.Future[Any], result: Any, error: BaseException | None) -> None:
    if future.cancelled():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


def _relay(outer: asyncio.Future[Any], inner: asyncio.Future[Any]) -> None:
    _settle(outer, *_outcome(inner))


#: ``inline_execution_max_us`` default: calls whose compute takes less than this run on the
#: event loop's thread (see ``Instance.submit``).
INLINE_MAX_US = 200


class Instance:
    """A backend plus the one thread it computes on.

    A call normally goes to the instance's own thread. For a short call that hand-off costs
    more than the model (docs/design/inline-execution.md), so when the backend runs on the
    CPU (``inline_capable``) and the average CPU time of its recent calls is under
    ``inline_max_us`` (model parameter ``inline_execution_max_us``, 0 = never), the call
    runs right away on the loop's thread instead: the loop is held for about as long as it
    takes to parse one request. A call that runs longer pushes the average up and the next
    ones go back to the thread. A backend with ``inline_only_alone`` (the PyTorch backend)
    runs inline only while its request is the only one in flight in the server."""

    def __init__(
        self,
        backend: Backend,
        model: str,
        inline_max_us: int = INLINE_MAX_US,
        limit: tuple[RateLimiter, Holder] | None = None,
    ) -> None:
        """``limit``: the rate limiter and this instance's place at it (``--rate-limit``);
        an instance that lists no resources is never held up, so it takes none."""
        self.backend = backend
        self.model = model
        self.limit = limit if limit is not None and limit[1].needs else None
        if limit is not None and self.limit is None:
            limit[0].unregister(limit[1])
        self._worker = _Worker(f"kiln-{model}-{backend.instance.index}")
        self.inline_max_ns = inline_max_us * 1000 if backend.inline_capable else 0
        self._inline_only_alone = backend.inline_only_alone
        self.call_ns: float | None = None  # moving average of a call's CPU time, ns
        self.inline_calls = 0  # calls that ran on the loop's thread (tests, diagnostics)
        self.loop_driven_calls = 0  # batches the backend ran from the loop (same)
        self._busy_until = 0  # when its last loop-driven batch ended, monotonic ns
        self._thread_calls = 0  # submit_requests batches on the thread path, not answered
        # submit_requests batches waiting for those to end (``_after_thread_calls``)
        self._behind_thread: list[tuple[list[Stamped], asyncio.Future[Any]]] = []

    async def run(
        self, inputs: dict[str, np.ndarray], output_names: list[str]
    ) -> tuple[dict[str, np.ndarray], int, int]:
        """Execute on this instance's thread; returns outputs and (start, end) ns stamps.
        Warm-up runs this during load: the rate limiter does not hold it up."""
        return await self._submit(self.execute, inputs, output_names)

    async def call(self, fn: Callable[..., T], *args: Any, jobs: Sequence[Job] = ()) -> T:
        """Run ``fn`` on this instance's thread (a scheduler's merge + execute + split)."""
        return await self.submit(fn, *args, jobs=jobs)

    def submit(
        self,
        fn: Callable[..., T],
        *args: Any,
        jobs: Sequence[Job] = (),
    ) -> asyncio.Future[T]:
        """Run ``fn`` for this instance now: inline when it is short (see the class), else
        on the instance's thread. The future resolves on the loop either way. With the
        rate limiter, once this instance's resources are free: ``jobs`` (the requests the
        call computes) then leave the queue at that moment, as Triton counts it."""
        if self.limit is not None:
            return self._limited(lambda: self._submit(fn, *args), jobs)
        return self._submit(fn, *args)

    def _limited(
        self, start: Callable[[], asyncio.Future[T]], jobs: Sequence[Stamped]
    ) -> asyncio.Future[T]:
        """``start()`` once the rate limiter grants this instance's resources; they are
        given back when its future is done. The wait is queue time for ``jobs``."""
        assert self.limit is not None
        limiter, holder = self.limit
        outer: asyncio.Future[T] = asyncio.get_running_loop().create_future()

        def finished(inner: asyncio.Future[T]) -> None:
            limiter.release(holder)
            if inner.cancelled():
                if not outer.done():
                    outer.cancel()
                return
            _settle(outer, *_outcome(inner))

        def go() -> None:
            if outer.done():  # its caller went away while it waited
                limiter.release(holder)
                return
            now = time.monotonic_ns()
            for job in jobs:
                job.times.queue_end = now
            try:
                inner = start()
            except BaseException as exc:
                limiter.release(holder)
                outer.set_exception(exc)
                return
            inner.add_done_callback(finished)

        withdraw = limiter.request(holder, go)
        outer.add_done_callback(lambda f: withdraw() if f.cancelled() else None)
        return outer

    def _submit(self, fn: Callable[..., T], *args: Any) -> asyncio.Future[T]:
        if (
            self.call_ns is not None
            and self.call_ns < self.inline_max_ns
            and (not self._inline_only_alone or self.backend.activity.alone())
        ):
            future: asyncio.Future[T] = asyncio.get_running_loop().create_future()
            start = time.thread_time_ns()
            try:
                future.set_result(fn(*args))
            except Exception as exc:  # delivered to the awaiting coroutine, as from the thread
                future.set_exception(exc)
            self._observe(time.thread_time_ns() - start)
            self.inline_calls += 1
            return future
        return self._worker.submit(self._timed, (fn, args))

    def _timed(self, fn: Callable[..., T], args: tuple[Any, ...]) -> T:
        # CPU time of this thread, not wall time: waiting for the GIL is not the model's
        # cost, and on the loop's thread the call would not wait for it.
        start = time.thread_time_ns()
        try:
            return fn(*args)
        finally:
            self._observe(time.thread_time_ns() - start)

    def _observe(self, ns: int) -> None:
        previous = self.call_ns
        self.call_ns = float(ns) if previous is None else 0.8 * previous + 0.2 * ns

    def execute(
        self, inputs: dict[str, np.ndarray], output_names: list[str]
    ) -> tuple[dict[str, np.ndarray], int, int]:
        """Compute on the calling thread (this instance's own); (outputs, start, end) ns."""
        start = time.monotonic_ns()
        try:
            outputs = self.backend.execute(inputs, output_names)
        except KilnError:
            raise
        except Exception as exc:
            raise self._failure(exc) from exc
        return outputs, start, time.monotonic_ns()

    def execute_requests(self, jobs: list[BackendRequest]) -> tuple[list[RequestOutcome], int, int]:
        """``execute`` for backends that take requests unmerged (``wants_requests``)."""
        start = time.monotonic_ns()
        try:
            outcomes = self.backend.execute_requests(list(jobs))
        except KilnError:
            raise
        except Exception as exc:
            raise self._failure(exc) from exc
        return outcomes, start, time.monotonic_ns()

    def submit_requests(
        self, requests: Sequence[Stamped]
    ) -> asyncio.Future[tuple[list[RequestOutcome], int, int]]:
        """``execute_requests`` for this instance: driven from the loop when the backend
        can (``Backend.start_requests``), else on the instance's thread; with the rate
        limiter, once this instance's resources are free."""
        jobs = list(requests)
        if self.limit is not None:
            return self._limited(lambda: self._submit_requests(jobs), jobs)
        return self._submit_requests(jobs)

    def _submit_requests(
        self, jobs: list[Stamped]
    ) -> asyncio.Future[tuple[list[RequestOutcome], int, int]]:
        if self._thread_calls:
            # A batch runs on the thread path (the backend asked for it, e.g. during a
            # restart): the two paths must not share the backend (one worker pipe) at
            # once, and batches start in order. This one waits for the thread's batches to
            # end, then tries the loop again; following them onto the thread instead kept
            # a loaded instance there for good (each batch found another still queued).
            return self._after_thread_calls(jobs)
        start = time.monotonic_ns()
        started: asyncio.Future[list[RequestOutcome]] | None = None
        try:
            started = self.backend.start_requests(list(jobs))
        except KilnError as exc:
            started = _failed(exc)
        except Exception as exc:
            started = _failed(self._failure(exc))
        if started is None:
            return self._on_thread(jobs)
        self.loop_driven_calls += 1
        future: asyncio.Future[tuple[list[RequestOutcome], int, int]]
        future = asyncio.get_running_loop().create_future()

        def done(outcomes: asyncio.Future[list[RequestOutcome]]) -> None:
            if future.cancelled():
                return
            error = outcomes.exception()
            if isinstance(error, NotStarted):
                # Queued behind a batch whose worker was lost: it starts over. While the
                # restart runs, the backend sends it to the thread path, which waits for
                # it; when the word came late (the restart over, the loop's batches in the
                # new worker's pipe) it queues behind those: on the thread it would read
                # the same pipe at once, and answers would cross.
                again = self._submit_requests(jobs)
                again.add_done_callback(lambda f: _settle(future, *_outcome(f)))
            elif error is not None:
                future.set_exception(error)
            else:
                # A batch queued behind another on this instance (``pipeline_depth``)
                # began computing when that one ended.
                end = time.monotonic_ns()
                concurrent = self.backend.runs_concurrently
                began = start if concurrent else max(start, self._busy_until)
                self._busy_until = end
                if began > start:
                    # It waited for the batch before it: queue time, as when it waits
                    # for a free instance (Triton's queue duration), not compute input.
                    for job in jobs:
                        job.times.queue_end = began
                future.set_result((outcomes.result(), began, end))

        started.add_done_callback(done)
        return future

    def _on_thread(
        self, jobs: list[Stamped]
    ) -> asyncio.Future[tuple[list[RequestOutcome], int, int]]:
        self._thread_calls += 1
        running = self._submit(self.execute_requests, jobs)  # within its caller's grant
        running.add_done_callback(self._thread_call_done)
        return running

    def _after_thread_calls(
        self, jobs: list[Stamped]
    ) -> asyncio.Future[tuple[list[RequestOutcome], int, int]]:
        outer: asyncio.Future[tuple[list[RequestOutcome], int, int]]
        outer = asyncio.get_running_loop().create_future()
        self._behind_thread.append((jobs, outer))
        return outer

    def _thread_call_done(self, _: asyncio.Future[Any]) -> None:
        self._thread_calls -= 1
        if self._thread_calls or not self._behind_thread:
            return
        waiting, self._behind_thread = self._behind_thread, []
        for jobs, outer in waiting:  # in order; one may take the thread again
            if outer.done():  # its caller went away meanwhile
                continue
            self._submit_requests(jobs).add_done_callback(functools.partial(_relay, outer))

    def _failure(self, exc: Exception) -> KilnError:
        """A backend's unexpected exception, naming the model: only this batch fails."""
        return KilnError(
            f"model '{self.model}' failed to execute: {type(exc).__name__}: {exc}",
            Status.INTERNAL,
        )

    def close(self) -> None:
        self._worker.shutdown()
        self.backend.close()
        if self.limit is not None:
            self.limit[0].unregister(self.limit[1])


def free_slots(instances: list[Instance]) -> list[Instance]:
    """A scheduler's initial free list: each instance once per batch it may have started at
    once (its backend's ``pipeline_depth``), every instance's first entry before any
    second, so that requests spread over idle instances before queueing behind busy ones."""
    depth = max((inst.backend.pipeline_depth for inst in instances), default=1)
    return [
        inst
        for round_ in range(depth)
        for inst in instances
        if round_ < inst.backend.pipeline_depth
    ]


class Scheduler(ABC):
    def __init__(self, instances: list[Instance], stats: ModelStats, model: str) -> None:
        self.instances = instances
        self.stats = stats
        self.model = model

    @abstractmethod
    async def schedule(self, job: Job) -> dict[str, np.ndarray]:
        """Run the job; stamp ``job.times``; return the outputs for this job only."""

    @property
    def pending(self) -> int:
        """Requests waiting for an instance (``nv_inference_pending_request_count``)."""
        return 0

    def flush(self) -> None:  # noqa: B027 - only batching schedulers hold requests back
        """The model is going away: run what is queued without waiting for more."""

    async def close(self) -> None:
        loop = asyncio.get_running_loop()
        for inst in self.instances:
            await loop.run_in_executor(None, inst.close)
