"""When and with which sequences a free instance runs its next batch.

A planner looks at the live sequences and answers for one free instance: the rows of the
next batch (a sequence per row, None for an empty ``direct`` slot) and, if it would rather
wait for more, until when. It never changes anything; the scheduler acts on the answer.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable

from kiln.config.model_config_pb2 import ModelConfig
from kiln.scheduling.sequence_slots import Sequence

# (rows, deadline): rows empty = nothing to run; deadline None = run the rows now,
# else wait until that monotonic ns for more (the scheduler runs them anyway on unload).
Plan = tuple[list[Sequence | None], int | None]


class Planner(ABC):
    #: how many sequences may hold a slot at once (None: unlimited)
    capacity: int | None

    @abstractmethod
    def plan(self, instance: int, sequences: Iterable[Sequence], now_ns: int) -> Plan: ...


def _same_shape(ready: list[Sequence]) -> list[Sequence]:
    """The oldest-headed sequences whose next request can share a batch with the oldest."""
    ready.sort(key=lambda s: s.queue[0].enqueued_ns)
    key = ready[0].queue[0].key
    return [s for s in ready if s.queue[0].key == key]


class DirectPlanner(Planner):
    """Each instance owns ``max_batch_size`` rows; slot s is row s // n of instance s % n."""

    def __init__(self, config: ModelConfig, instances: int) -> None:
        direct = config.sequence_batching.direct
        self.instances = instances
        self.rows = max(config.max_batch_size, 1)
        self.capacity = self.rows * instances
        self.delay_ns = direct.max_queue_delay_microseconds * 1000
        self.min_utilization = direct.minimum_slot_utilization

    def _row(self, seq: Sequence) -> int:
        return (seq.slot or 0) // self.instances

    def plan(self, instance: int, sequences: Iterable[Sequence], now_ns: int) -> Plan:
        mine = [
            s
            for s in sequences
            if s.ready() and s.slot is not None and s.slot % self.instances == instance
        ]
        if not mine:
            return [], None
        batch = _same_shape(mine)
        rows: list[Sequence | None] = [None] * (1 + max(self._row(s) for s in batch))
        for seq in batch:
            rows[self._row(seq)] = seq
        oldest = batch[0].queue[0].enqueued_ns
        deadline = oldest + self.delay_ns
        # Wait for more of this instance's slots only while too few are ready and the
        # oldest request is within its delay (Triton's minimum_slot_utilization).
        if len(batch) < self.min_utilization * self.rows and now_ns < deadline:
            return rows, deadline
        return rows, None


class OldestPlanner(Planner):
    """Dynamic batching across sequences: at most one request per sequence per batch."""

    def __init__(self, config: ModelConfig, instances: int) -> None:
        oldest = config.sequence_batching.oldest
        self.max_batch = max(config.max_batch_size, 1)
        self.capacity = oldest.max_candidate_sequences or None
        self.preferred = frozenset(oldest.preferred_batch_size)
        self.delay_ns = oldest.max_queue_delay_microseconds * 1000

    def plan(self, instance: int, sequences: Iterable[Sequence], now_ns: int) -> Plan:
        ready = [s for s in sequences if s.ready()]
        if not ready:
            return [], None
        batch: list[Sequence | None] = list(_same_shape(ready)[: self.max_batch])
        first = batch[0]
        assert first is not None
        deadline = first.queue[0].enqueued_ns + self.delay_ns
        full = len(batch) >= self.max_batch or len(batch) in self.preferred
        if full or now_ns >= deadline:
            return batch, None
        return batch, deadline


def planner_for(config: ModelConfig, instances: int) -> Planner:
    if config.sequence_batching.HasField("oldest"):
        return OldestPlanner(config, instances)
    return DirectPlanner(config, instances)  # Triton's default strategy
