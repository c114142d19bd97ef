"""Per-model-version statistics, shaped like Triton's statistics extension."""

from __future__ import annotations

import enum
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

from kiln.core.errors import KilnError, Status


@dataclass(slots=True)
class Duration:
    count: int = 0
    ns: int = 0

    def add(self, ns: int, count: int = 1) -> None:
        self.count += count
        self.ns += ns

    def to_json(self) -> dict[str, int]:
        return {"count": self.count, "ns": self.ns}


@dataclass(slots=True)
class BatchStats:
    compute_input: Duration = field(default_factory=Duration)
    compute_infer: Duration = field(default_factory=Duration)
    compute_output: Duration = field(default_factory=Duration)


@dataclass(slots=True)
class RequestTimes:
    """Timestamps of one request through the server (``time.monotonic_ns``)."""

    received: int = 0
    queue_end: int = 0
    input_end: int = 0
    infer_end: int = 0
    output_end: int = 0


class FailureReason(enum.Enum):
    """Triton's ``reason`` label on ``nv_inference_request_failure``."""

    REJECTED = "REJECTED"  # refused by the scheduler (queue full, request timeout expired)
    CANCELED = "CANCELED"
    BACKEND = "BACKEND"  # the model itself failed to execute or produced bad outputs
    OTHER = "OTHER"


def failure_reason(exc: BaseException) -> FailureReason:
    if not isinstance(exc, KilnError):
        return FailureReason.BACKEND
    if exc.status is Status.CANCELLED:
        return FailureReason.CANCELED
    if exc.status is Status.UNAVAILABLE:
        return FailureReason.REJECTED
    if exc.status is Status.INTERNAL:
        return FailureReason.BACKEND
    return FailureReason.OTHER


class RequestObserver(Protocol):
    """Per-runtime hook for distributions (histograms, summaries) the counters cannot hold.

    Called under the stats lock, once per finished request: it must stay O(1) and tiny.
    """

    def observe_success(self, times: RequestTimes, batch_size: int, end_ns: int) -> None: ...


class ModelStats:
    """Cumulative counters; updated from the event loop and instance threads."""

    # Set once at startup by the metrics layer (None: no distributions are kept at all).
    observer_factory: ClassVar[Callable[[], RequestObserver] | None] = None

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.success = Duration()
        self.fail = Duration()
        self.queue = Duration()
        self.compute_input = Duration()
        self.compute_infer = Duration()
        self.compute_output = Duration()
        self.cache_hit = Duration()
        self.cache_miss = Duration()
        self.inference_count = 0
        self.execution_count = 0
        self.last_inference_ms = 0
        self.batch: dict[int, BatchStats] = {}
        self.fail_reasons: dict[FailureReason, int] = dict.fromkeys(FailureReason, 0)
        factory = ModelStats.observer_factory
        self.observer: RequestObserver | None = factory() if factory is not None else None

    def record_execution(
        self, batch_size: int, input_ns: int, infer_ns: int, output_ns: int
    ) -> None:
        with self._lock:
            self.execution_count += 1
            b = self.batch.get(batch_size)
            if b is None:
                b = self.batch[batch_size] = BatchStats()
            b.compute_input.add(input_ns)
            b.compute_infer.add(infer_ns)
            b.compute_output.add(output_ns)

    def record_success(self, times: RequestTimes, batch_size: int, end_ns: int) -> None:
        with self._lock:
            self.success.add(end_ns - times.received)
            self.queue.add(times.queue_end - times.received)
            self.compute_input.add(times.input_end - times.queue_end)
            self.compute_infer.add(times.infer_end - times.input_end)
            self.compute_output.add(times.output_end - times.infer_end)
            self.inference_count += batch_size
            self.last_inference_ms = int(time.time() * 1000)
            if self.observer is not None:
                self.observer.observe_success(times, batch_size, end_ns)

    def record_cache_hit(self, times: RequestTimes, lookup_ns: int, end_ns: int) -> None:
        """A response served from the response cache: a success (as in Triton) that ran
        no model, so no queue, compute or inference_count."""
        with self._lock:
            self.cache_hit.add(lookup_ns)
            self.success.add(end_ns - times.received)
            self.last_inference_ms = int(time.time() * 1000)

    def record_cache_miss(self, lookup_and_insert_ns: int) -> None:
        with self._lock:
            self.cache_miss.add(lookup_and_insert_ns)

    def record_failure(
        self, times: RequestTimes, end_ns: int, reason: FailureReason = FailureReason.OTHER
    ) -> None:
        with self._lock:
            self.fail.add(end_ns - times.received)
            self.fail_reasons[reason] += 1
            self.last_inference_ms = int(time.time() * 1000)

    def batch_executions(self) -> dict[int, int]:
        """Executions per batch size (the batch-size distribution)."""
        with self._lock:
            return {size: b.compute_infer.count for size, b in self.batch.items()}

    def to_json(self, name: str, version: str) -> dict[str, Any]:
        with self._lock:
            return {
                "name": name,
                "version": version,
                "last_inference": self.last_inference_ms,
                "inference_count": self.inference_count,
                "execution_count": self.execution_count,
                "inference_stats": {
                    "success": self.success.to_json(),
                    "fail": self.fail.to_json(),
                    "queue": self.queue.to_json(),
                    "compute_input": self.compute_input.to_json(),
                    "compute_infer": self.compute_infer.to_json(),
                    "compute_output": self.compute_output.to_json(),
                    "cache_hit": self.cache_hit.to_json(),
                    "cache_miss": self.cache_miss.to_json(),
                },
                "response_stats": {},
                "batch_stats": [
                    {
                        "batch_size": size,
                        "compute_input": b.compute_input.to_json(),
                        "compute_infer": b.compute_infer.to_json(),
                        "compute_output": b.compute_output.to_json(),
                    }
                    for size, b in sorted(self.batch.items())
                ],
                "memory_usage": [],
            }
