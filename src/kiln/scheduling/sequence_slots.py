"""The sequence batcher's bookkeeping: live sequences, their queued requests, their slots.

A sequence holds a slot for its lifetime. With strategy ``direct`` a slot is one batch
row of one instance; with ``oldest`` it is a place among ``max_candidate_sequences``
candidates (unlimited when that is 0). A sequence that finds no free slot waits in the
backlog, requests queued, until a sequence ends or idles out.
"""

from __future__ import annotations

import asyncio
import heapq
from collections import OrderedDict, deque
from dataclasses import dataclass, field

import numpy as np

from kiln.config.sequence_config import CorrId, SequenceFlags
from kiln.scheduling.base import Job
from kiln.scheduling.queue import ShapeKey

# How many ended / expired ids are remembered to say why a late request is refused.
_GONE_MEMORY = 4096


@dataclass(slots=True, eq=False)
class Waiting:
    """One queued request of a sequence and the future its caller awaits."""

    job: Job
    flags: SequenceFlags
    future: asyncio.Future[dict[str, np.ndarray]]
    enqueued_ns: int
    key: ShapeKey


@dataclass(slots=True, eq=False)
class Sequence:
    corrid: CorrId
    last_ns: int  # last arrival or completion: the idle clock starts here
    queue: deque[Waiting] = field(default_factory=deque)
    busy: bool = False  # a request of it is executing: the next one must wait (order, state)
    accepting: bool = True  # False once its END request arrived
    slot: int | None = None  # None: in the backlog
    states: dict[str, np.ndarray] | None = None  # None: initial state
    # ``iterative_sequence``: a request sent without an id is a sequence of its own, named
    # by the scheduler, that ends when the model releases the request without rescheduling.
    generated: bool = False

    def ready(self) -> bool:
        return bool(self.queue) and not self.busy and self.slot is not None

    def idle(self, now_ns: int, limit_ns: int) -> bool:
        return not self.queue and not self.busy and now_ns - self.last_ns > limit_ns


class SlotPool:
    """Free slots, lowest id first; ``capacity`` None means unlimited (all slot 0)."""

    def __init__(self, capacity: int | None) -> None:
        self.capacity = capacity
        self._free = list(range(capacity)) if capacity is not None else []
        heapq.heapify(self._free)

    def take(self) -> int | None:
        if self.capacity is None:
            return 0
        return heapq.heappop(self._free) if self._free else None

    def give(self, slot: int) -> None:
        if self.capacity is not None:
            heapq.heappush(self._free, slot)


class GoneIds:
    """Recently ended or expired ids and why, so a late request's error can say which."""

    def __init__(self) -> None:
        self._reasons: OrderedDict[CorrId, str] = OrderedDict()

    def add(self, corrid: CorrId, reason: str) -> None:
        self._reasons[corrid] = reason
        self._reasons.move_to_end(corrid)
        while len(self._reasons) > _GONE_MEMORY:
            self._reasons.popitem(last=False)

    def forget(self, corrid: CorrId) -> None:
        self._reasons.pop(corrid, None)

    def reason(self, corrid: CorrId) -> str | None:
        return self._reasons.get(corrid)


def describe(corrid: CorrId) -> str:
    """How an id appears in messages: numbers bare, strings quoted (so '' is visible)."""
    return str(corrid) if isinstance(corrid, int) else f"'{corrid}'"
