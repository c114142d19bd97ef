"""The dynamic batcher's request queue: one FIFO per priority level, plus its delayed tail.

Dequeue order is Triton's: level 1 first; within a level, requests that have not timed out
in arrival order, then the ones whose DELAY timeout expired, in the order they expired.
The queue only holds and orders requests; the scheduler decides batches and owns timers.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np

from kiln.core.errors import unavailable
from kiln.scheduling.base import Job
from kiln.scheduling.policy import QueuePolicy

# What must agree for two requests to share a batch: each input's name and its shape
# without the batch dimension (variable dims must be equal to be concatenated).
ShapeKey = tuple[tuple[str, tuple[int, ...]], ...]


def shape_key(
    inputs: dict[str, np.ndarray], batching: bool, ragged: frozenset[str] = frozenset()
) -> ShapeKey:
    """``ragged``: inputs whose shapes need not agree (``allow_ragged_batch``)."""
    skip = 1 if batching else 0
    if not ragged:
        return tuple(sorted((name, tuple(a.shape[skip:])) for name, a in inputs.items()))
    return tuple(
        sorted((n, () if n in ragged else tuple(a.shape[skip:])) for n, a in inputs.items())
    )


@dataclass(slots=True, eq=False)
class Pending:
    """One queued request and the future its caller awaits."""

    job: Job
    future: asyncio.Future[dict[str, np.ndarray]]
    level: int
    enqueued_ns: int
    key: ShapeKey
    timer: asyncio.TimerHandle | None = None
    delayed: bool = False

    @property
    def batch_size(self) -> int:
        return self.job.batch_size


@dataclass(slots=True)
class _Level:
    queue: deque[Pending] = field(default_factory=deque)
    delayed: deque[Pending] = field(default_factory=deque)

    def __len__(self) -> int:
        return len(self.queue) + len(self.delayed)


class RequestQueue:
    def __init__(self, policy: QueuePolicy) -> None:
        self.policy = policy
        self._levels = [_Level() for _ in policy.levels]
        self._size = 0

    def __len__(self) -> int:
        return self._size

    def __iter__(self) -> Iterator[Pending]:
        for level in self._levels:
            yield from level.queue
            yield from level.delayed

    @property
    def delayed(self) -> int:
        return sum(len(level.delayed) for level in self._levels)

    def push(self, item: Pending) -> None:
        """Append to its level; a full level refuses at once (Triton's wording)."""
        level = self._levels[item.level - 1]
        limit = self.policy.levels[item.level - 1].max_queue_size
        if limit and len(level) >= limit:
            raise unavailable(
                f"Exceeds maximum queue size: model '{self.policy.model}' already queues "
                f"{limit} request(s) at priority level {item.level} (max_queue_size {limit})"
            )
        level.queue.append(item)
        self._size += 1

    def remove(self, item: Pending) -> bool:
        """Take a request out wherever it is; False if it was not queued."""
        level = self._levels[item.level - 1]
        for fifo in (level.delayed, level.queue) if item.delayed else (level.queue,):
            try:
                fifo.remove(item)
            except ValueError:
                continue
            self._size -= 1
            return True
        return False

    def delay(self, item: Pending) -> bool:
        """Move a timed-out request behind every request of its level still in time."""
        level = self._levels[item.level - 1]
        if item.delayed:
            return False
        try:
            level.queue.remove(item)
        except ValueError:
            return False
        item.delayed = True
        level.delayed.append(item)
        return True

    def pop_front(self, count: int) -> list[Pending]:
        """The first ``count`` requests in dequeue order, removed."""
        taken: list[Pending] = []
        for level in self._levels:
            for fifo in (level.queue, level.delayed):
                while fifo and len(taken) < count:
                    taken.append(fifo.popleft())
        self._size -= len(taken)
        return taken
