"""The sequence batcher (``sequence_batching {}``) for stateful models.

Every request names its sequence (``sequence_id``); a sequence runs one request at a time,
in arrival order, and carries its implicit state from one request to the next. Strategy
``direct`` pins a sequence to one batch row of one instance for its whole life and runs a
batch of that instance's rows (empty rows READY false); ``oldest`` batches the oldest
waiting requests of different sequences on whichever instance is free. One asyncio task
forms batches; merging, compute and splitting run on the instance's own thread, but for a
backend that takes requests unmerged (the Python backend), which runs them as it runs the
other schedulers' batches (``Instance.submit_requests``).

**Iterative sequences** (``iterative_sequence: true``, Triton's generative sequence
batching): a request sent without a ``sequence_id`` is a sequence of its own, named by the
scheduler (ids 1, 2, ... as the model sees them, START on its first run). A Python model
may release a request with ``TRITONSERVER_REQUEST_RELEASE_RESCHEDULE``: it is not answered
but runs again, START cleared, in a later batch, in the same slot, before any later request
of its sequence; a decoupled model streams its responses across those runs. The sequence
ends when the model releases the request without rescheduling it. With every slot of a
batch held by one such request, new requests join as others finish: continuous batching.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from kiln.backends.base import Rescheduled
from kiln.config.model_config_pb2 import ModelConfig
from kiln.config.sequence_config import (
    Control,
    ControlSpec,
    CorrId,
    SequenceFlags,
    corrid_value,
    parse_controls,
    parse_flags,
    parse_states,
)
from kiln.config.sequence_config import idle_limit_ns as config_idle_limit_ns
from kiln.core.errors import KilnError, internal, invalid_arg, unavailable
from kiln.core.stats import ModelStats
from kiln.scheduling.base import Instance, Job, Scheduler
from kiln.scheduling.queue import shape_key
from kiln.scheduling.sequence_batch import (
    Row,
    RowRequest,
    RowResult,
    batch_inputs,
    split_rows,
)
from kiln.scheduling.sequence_plan import Planner, planner_for
from kiln.scheduling.sequence_slots import GoneIds, Sequence, SlotPool, Waiting, describe

log = logging.getLogger(__name__)

Clock = Callable[[], int]  # monotonic nanoseconds; injectable so tests can move time
# Per slot: its result, the error of that request alone (a backend that takes requests
# unmerged answers each on its own), or None (an empty slot); or the whole batch's error.
Outcome = list[RowResult | KilnError | None] | BaseException


class SequenceScheduler(Scheduler):
    def __init__(
        self,
        instances: list[Instance],
        stats: ModelStats,
        model: str,
        config: ModelConfig,
        model_dir: Path,
        clock: Clock = time.monotonic_ns,
    ) -> None:
        super().__init__(instances, stats, model)
        self.batching = config.max_batch_size > 0
        self.controls: list[ControlSpec] = parse_controls(config)
        self.states = parse_states(config, model_dir)
        self.idle_limit_ns = config_idle_limit_ns(config)
        self.iterative = config.sequence_batching.iterative_sequence
        self._generated_ids = 0  # the last id given to a sequence the scheduler named
        self.clock = clock
        self.planner: Planner = planner_for(config, len(instances))
        self.pool = SlotPool(self.planner.capacity)
        self.sequences: dict[CorrId, Sequence] = {}
        self.backlog: list[Sequence] = []
        self.gone = GoneIds()
        self._idle_instances = list(range(len(instances)))
        self._running: set[asyncio.Task[None]] = set()
        self._changed = asyncio.Event()
        self._closing = False
        loop = asyncio.get_running_loop()
        self._task = loop.create_task(self._run(), name=f"kiln-sequencer-{model}")
        self._task.add_done_callback(self._on_batcher_exit)
        self._reaper = loop.create_task(self._reap(), name=f"kiln-sequence-reaper-{model}")

    @property
    def pending(self) -> int:
        return sum(len(seq.queue) for seq in self.sequences.values())

    # ---- requests in -------------------------------------------------------------------
    async def schedule(self, job: Job) -> dict[str, np.ndarray]:
        if self._closing:
            raise unavailable(f"model '{self.model}' is unloading")
        flags = parse_flags(job.parameters, self.model, self.iterative)
        generated = flags.corrid == 0  # iterative_sequence: a sequence of its own
        if generated:
            # The model sees ids 1, 2, ... (Triton's numbering); this scheduler keys the
            # sequence by the negated id, which no client can send.
            self._generated_ids += 1
            flags = SequenceFlags(self._generated_ids, True, False)
        if self.batching and job.batch_size != 1:
            raise invalid_arg(
                f"inference request to model '{self.model}' must specify batch-size 1 due "
                f"to requirements of sequence batcher (sequence {describe(flags.corrid)} "
                f"sent {job.batch_size})"
            )
        for spec in self.controls:
            if spec.kind == Control.CONTROL_SEQUENCE_CORRID:
                corrid_value(spec, flags.corrid, self.model)  # refuse it now, not its batch
        now = self.clock()
        if generated:
            seq = self._begin(-int(flags.corrid), None, now)
            seq.generated = True
        else:
            seq = self._join(flags, now)
        loop = asyncio.get_running_loop()
        item = Waiting(job, flags, loop.create_future(), now, shape_key(job.inputs, self.batching))
        seq.queue.append(item)
        seq.last_ns = now
        self._changed.set()
        try:
            return await item.future
        except asyncio.CancelledError:
            # The caller went away while queued: drop its request; the sequence goes on,
            # unless the request was all of it. (Running, it ends when its batch does.)
            if item in seq.queue:
                seq.queue.remove(item)
                seq.last_ns = self.clock()
                if seq.generated:
                    self._release(seq, "ended")
            raise

    def _join(self, flags: SequenceFlags, now: int) -> Sequence:
        """The sequence a client's request belongs to, begun by its START."""
        seq = self.sequences.get(flags.corrid)
        if seq is not None and seq.idle(now, self.idle_limit_ns):
            self._release(seq, "idle")  # expired, whether or not the reaper got there yet
            seq = None
        if flags.start:
            seq = self._begin(flags.corrid, seq, now)
        elif seq is None or not seq.accepting:
            raise self._no_start(flags.corrid, seq)
        if flags.end:
            seq.accepting = False
        return seq

    def _begin(self, corrid: CorrId, seq: Sequence | None, now: int) -> Sequence:
        if seq is not None:
            if seq.accepting:
                log.warning(
                    "sequence %s for model '%s' started again before it ended: the previous "
                    "sequence is cut short; its queued requests still run first",
                    describe(corrid),
                    self.model,
                )
            seq.accepting = True  # its START request resets the state when it runs
            return seq
        seq = Sequence(corrid, now)
        self.gone.forget(seq.corrid)
        seq.slot = self.pool.take()
        if seq.slot is None:
            self.backlog.append(seq)
        self.sequences[corrid] = seq
        return seq

    def _no_start(self, corrid: CorrId, seq: Sequence | None) -> KilnError:
        reason = "ended" if seq is not None else self.gone.reason(corrid)
        why = {
            "ended": ": the sequence already ended (a request with sequence_end came before)",
            "idle": (
                f": the sequence was idle longer than max_sequence_idle_microseconds "
                f"({self.idle_limit_ns // 1000}) and was released"
            ),
        }.get(reason or "", ": no such sequence is active")
        # Triton's words first: clients written for Triton match on them.
        return invalid_arg(
            f"inference request for sequence {describe(corrid)} to model '{self.model}' "
            f"must specify the START flag on the first request of the sequence{why}"
        )

    def _release(self, seq: Sequence, reason: str) -> None:
        """The sequence is over: forget its state, hand its slot to the backlog or pool."""
        if self.sequences.get(seq.corrid) is seq:
            del self.sequences[seq.corrid]
        self.gone.add(seq.corrid, reason)
        seq.states = None
        if seq.slot is None:
            if seq in self.backlog:
                self.backlog.remove(seq)
            return
        slot, seq.slot = seq.slot, None
        if self.backlog:
            self.backlog.pop(0).slot = slot
        else:
            self.pool.give(slot)
        self._changed.set()

    def expire_idle(self, now_ns: int) -> int:
        """Release every sequence idle past the limit; returns how many."""
        idle = [s for s in self.sequences.values() if s.idle(now_ns, self.idle_limit_ns)]
        for seq in idle:
            log.info("model '%s': sequence %s idled out", self.model, describe(seq.corrid))
            self._release(seq, "idle")
        return len(idle)

    async def _reap(self) -> None:
        # Wake a few times per idle limit: a slot is freed within ~1.5x the limit.
        interval = min(max(self.idle_limit_ns / 2e9, 0.01), 1.0)
        while True:
            await asyncio.sleep(interval)
            self.expire_idle(self.clock())

    # ---- batch formation ---------------------------------------------------------------
    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            self._changed.clear()
            now = self.clock()
            wake: int | None = None
            for index in list(self._idle_instances):
                seqs, deadline = self.planner.plan(index, self.sequences.values(), now)
                if seqs and (deadline is None or self._closing):
                    self._dispatch(index, seqs)
                elif deadline is not None:
                    wake = deadline if wake is None else min(wake, deadline)
            if self._closing and not self._running and not self._dispatchable():
                self._fail_waiting(unavailable(f"model '{self.model}' is unloading"))
                return
            timer = None
            if wake is not None and not self._closing:
                timer = loop.call_later(max(wake - self.clock(), 0) / 1e9, self._changed.set)
            await self._changed.wait()
            if timer is not None:
                timer.cancel()

    def _dispatchable(self) -> bool:
        return any(seq.ready() for seq in self.sequences.values())

    def _dispatch(self, index: int, seqs: list[Sequence | None]) -> None:
        """Start a batch on instance ``index``: one row per entry (None = empty slot)."""
        self._idle_instances.remove(index)
        now = time.monotonic_ns()
        rows: list[Row] = []
        taken: list[tuple[Sequence, Waiting] | None] = []
        for seq in seqs:
            if seq is None:
                rows.append(Row(None))
                taken.append(None)
                continue
            item = seq.queue.popleft()
            seq.busy = True
            item.job.times.queue_end = now
            f = item.flags
            rows.append(Row(item.job, f.corrid, f.start, f.end, seq.states))
            taken.append((seq, item))
        task = asyncio.get_running_loop().create_task(self._execute(index, rows, taken))
        self._running.add(task)
        task.add_done_callback(self._running.discard)

    async def _execute(
        self, index: int, rows: list[Row], taken: list[tuple[Sequence, Waiting] | None]
    ) -> None:
        outcome: Outcome
        instance = self.instances[index]
        try:
            if instance.backend.wants_requests:
                outcome = await self._run_requests(instance, rows)
            else:
                jobs = [row.job for row in rows if row.job is not None]
                outcome = await instance.call(self._compute, instance, rows, jobs=jobs)
        except Exception as exc:
            outcome = exc
        finally:
            self._idle_instances.append(index)
        self._finish(taken, outcome)
        self._changed.set()

    def _compute(self, instance: Instance, rows: list[Row]) -> list[RowResult | KilnError | None]:
        """On the instance's thread: build the batch, execute, split; stamps times."""
        inputs = batch_inputs(rows, self.controls, self.states, self.batching, self.model)
        names = list(
            dict.fromkeys(
                [n for row in rows if row.job for n in row.job.output_names]
                + [s.output_name for s in self.states]
            )
        )
        outputs, start, end = instance.execute(inputs, names)
        results = split_rows(outputs, rows, self.states, self.batching, self.model)
        done = time.monotonic_ns()
        jobs = [row.job for row in rows if row.job is not None]
        for job in jobs:
            job.times.input_end = start
            job.times.infer_end = end
            job.times.output_end = done
        queue_end = jobs[0].times.queue_end
        self.stats.record_execution(len(jobs), start - queue_end, end - start, done - end)
        return list(results)

    async def _run_requests(
        self, instance: Instance, rows: list[Row]
    ) -> list[RowResult | KilnError | None]:
        """A backend that takes requests unmerged (the Python backend): each request of the
        batch is its own, with its own control values and state, as Triton hands a Python
        model its sequence batch; empty slots are left out, and a decoupled model's
        responses stream to each request's own client. The instance runs the batch as it
        runs the other schedulers' (``Instance.submit_requests``: from the event loop when
        the backend can), so a decoupled model's batch ends when its ``execute`` returns,
        as on Triton: the sequence's next request may run while the model's threads still
        stream the responses of the one before."""
        real = [row for row in rows if row.job is not None]
        requests = [
            RowRequest(row, batch_inputs([row], self.controls, self.states, self.batching,
                                         self.model), self.states)
            for row in real
        ]  # fmt: skip
        outcomes, start, end = await instance.submit_requests(list(requests))
        done = time.monotonic_ns()
        results: list[RowResult | KilnError | None] = []
        answers = iter(outcomes)  # one per real row, in order
        for row in rows:
            if row.job is None:
                results.append(None)
                continue
            outcome = next(answers)
            if isinstance(outcome, KilnError):
                results.append(outcome)
            elif row.job.sink is not None:  # decoupled: the outputs went to the stream
                results.append(RowResult({}, dict(row.states or {})))
            else:
                try:
                    results.extend(
                        split_rows(outcome, [row], self.states, self.batching, self.model)
                    )
                except KilnError as exc:
                    results.append(exc)
            row.job.times.input_end = start
            row.job.times.infer_end = end
            row.job.times.output_end = done
        queue_end = real[0].job.times.queue_end if real and real[0].job else start
        self.stats.record_execution(len(real), start - queue_end, end - start, done - end)
        return results

    def _finish(self, taken: list[tuple[Sequence, Waiting] | None], outcome: Outcome) -> None:
        if isinstance(outcome, BaseException) and not isinstance(outcome, KilnError):
            log.error("model '%s': sequence batch failed", self.model, exc_info=outcome)
        now = self.clock()
        for i, entry in enumerate(taken):
            if entry is None:
                continue
            seq, item = entry
            seq.busy = False
            seq.last_ns = now
            if isinstance(outcome, BaseException):
                error = self._error(outcome)
                if not item.future.done():
                    item.future.set_exception(error)
            else:
                result = outcome[i]
                assert result is not None
                if (
                    isinstance(result, Rescheduled)
                    and self.iterative
                    and not item.future.done()  # its caller is still there
                ):
                    # It runs again, first of its sequence, as a continuation (not START).
                    item.flags = SequenceFlags(item.flags.corrid, False, item.flags.end)
                    seq.queue.appendleft(item)
                    continue
                if isinstance(result, KilnError):  # that request alone failed
                    if not item.future.done():
                        item.future.set_exception(self._error(result))
                else:
                    seq.states = result.states
                    if not item.future.done():
                        item.future.set_result(result.outputs)
            if item.flags.end or seq.generated:
                seq.states = None  # the state of an ended sequence is never read again
                if not seq.queue:
                    self._release(seq, "ended")

    def _error(self, exc: BaseException) -> KilnError:
        if isinstance(exc, KilnError):
            return KilnError(exc.message, exc.status)
        return internal(f"model '{self.model}' failed to execute: {type(exc).__name__}: {exc}")

    # ---- shutdown ----------------------------------------------------------------------
    def _fail_waiting(self, error: KilnError) -> None:
        for seq in list(self.sequences.values()):
            while seq.queue:
                item = seq.queue.popleft()
                if not item.future.done():
                    item.future.set_exception(KilnError(error.message, error.status))

    def _on_batcher_exit(self, task: asyncio.Task[None]) -> None:
        if task.cancelled() or task.exception() is None:
            return
        log.error("model '%s': sequence batcher stopped", self.model, exc_info=task.exception())
        self._fail_waiting(internal(f"model '{self.model}': sequence batcher stopped"))

    def flush(self) -> None:
        self._closing = True
        self._changed.set()

    async def close(self) -> None:
        self.flush()
        await asyncio.gather(self._task, return_exceptions=True)
        if self._running:
            await asyncio.gather(*self._running, return_exceptions=True)
        self._reaper.cancel()
        await asyncio.gather(self._reaper, return_exceptions=True)
        await super().close()
