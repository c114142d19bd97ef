"""The sequence batcher, driven directly with a recording backend and a fake clock.

The backend is an accumulator (``ACC_OUT = OUTPUT = ACC_IN * (1 - START) + INPUT * READY``)
that records every batch it is given and can be held (``Recorder.hold``) so tests queue
requests while an instance is busy and then see exactly which batches formed. Idle expiry
reads the scheduler's injected clock, which only the test moves. Nothing measures time.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pytest
from google.protobuf import text_format

from kiln.backends.base import Backend, InstanceSpec, Rescheduled
from kiln.config.model_config_pb2 import ModelConfig
from kiln.config.signature import ModelSignature
from kiln.core.errors import KilnError, Status
from kiln.core.stats import ModelStats, RequestTimes
from kiln.core.types import DataType, InferenceRequest, InferInput
from kiln.scheduling.base import Instance, Job
from kiln.scheduling.sequence import SequenceScheduler
from kiln.server.runtime import ModelRuntime

IDLE_US = 1000


@dataclass
class Recorder:
    hold: threading.Event = field(default_factory=threading.Event)  # set: batches wait
    release: threading.Event = field(default_factory=threading.Event)
    batches: list[dict[str, np.ndarray]] = field(default_factory=list)
    fail_on: int | None = None  # an INPUT value that makes its batch raise
    # INPUT value -> how many more times an unmerged backend reschedules such a request
    reschedule: dict[int, int] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def column(self, batch: int, name: str) -> list[Any]:
        return [v.item() if hasattr(v, "item") else v for v in self.batches[batch][name][:, 0]]


class RecordingBackend(Backend):
    name: ClassVar[str] = "recording"
    recorder: ClassVar[Recorder]

    def execute(
        self, inputs: dict[str, np.ndarray], output_names: list[str]
    ) -> dict[str, np.ndarray]:
        with self.recorder.lock:
            self.recorder.batches.append({k: v.copy() for k, v in inputs.items()})
        if self.recorder.hold.is_set():
            assert self.recorder.release.wait(10), "test never released the backend"
        value = inputs["INPUT"]
        if self.recorder.fail_on is not None and self.recorder.fail_on in value:
            raise ValueError("the recording model refuses this value")
        start = inputs.get("START", np.zeros_like(value)).astype(np.int32)
        ready = inputs.get("READY", np.ones_like(value)).astype(np.int32)
        total = inputs["ACC_IN"] * (1 - start) + value * ready
        return {"OUTPUT": total, "ACC_OUT": total.copy()}


class RequestsBackend(RecordingBackend):
    """The same accumulator taking requests unmerged, as the Python backend does: each
    request computed (and failed) on its own; ``requests`` records what each batch held."""

    wants_requests: ClassVar[bool] = True
    requests: ClassVar[list[list[dict[str, Any]]]]

    def execute_requests(self, requests: list[Any]) -> list[Any]:
        self.requests.append(
            [
                {"inputs": dict(r.inputs), "outputs": list(r.output_names),
                 "corrid": r.correlation_id, "flags": r.flags}
                for r in requests
            ]
        )  # fmt: skip
        outcomes: list[Any] = []
        for request in requests:
            value = int(request.inputs["INPUT"][0, 0])
            if self.recorder.reschedule.get(value, 0) > 0:
                self.recorder.reschedule[value] -= 1
                outcomes.append(Rescheduled("acc"))  # as the Python backend reports it
                continue
            if (
                self.recorder.fail_on is not None
                and self.recorder.fail_on in request.inputs["INPUT"]
            ):
                outcomes.append(KilnError("the recording model refuses this value"))
                continue
            request.response_parameters = {"seen": int(request.inputs["INPUT"][0, 0])}
            outcomes.append(self.execute(request.inputs, request.output_names))
        return outcomes


BASE = """
name: "acc"
max_batch_size: {mbs}
input [ {{ name: "INPUT" data_type: TYPE_INT32 dims: [ 1 ] }} ]
output [ {{ name: "OUTPUT" data_type: TYPE_INT32 dims: [ 1 ] }} ]
instance_group [ {{ count: {count} kind: KIND_CPU }} ]
sequence_batching {{
  max_sequence_idle_microseconds: {idle}
  control_input [
    {{ name: "START" control [ {{ kind: CONTROL_SEQUENCE_START int32_false_true: [ 0, 1 ] }} ] }},
    {{ name: "READY" control [ {{ kind: CONTROL_SEQUENCE_READY int32_false_true: [ 0, 1 ] }} ] }}
    {extra_controls}
  ]
  state [ {{ input_name: "ACC_IN" output_name: "ACC_OUT" data_type: TYPE_INT32 dims: [ 1 ]
             {initial} }} ]
  {strategy}
}}
"""


def config_text(
    strategy: str = "direct { }",
    mbs: int = 2,
    count: int = 1,
    extra_controls: str = "",
    initial: str = "initial_state { name: 'z' data_type: TYPE_INT32 dims: [ 1 ] zero_data: true }",
) -> str:
    return BASE.format(
        mbs=mbs,
        count=count,
        idle=IDLE_US,
        extra_controls=extra_controls,
        initial=initial,
        strategy=strategy,
    )


@dataclass
class Harness:
    scheduler: SequenceScheduler
    recorder: Recorder
    stats: ModelStats
    now: list[int]  # the fake clock, ns

    def submit(
        self, value: int, sid: Any, start: bool = False, end: bool = False, rows: int = 1
    ) -> asyncio.Task[dict[str, np.ndarray]]:
        params: dict[str, Any] = {"sequence_id": sid}
        if start:
            params["sequence_start"] = True
        if end:
            params["sequence_end"] = True
        data = np.full((rows, 1), value, np.int32)
        job = Job({"INPUT": data}, ["OUTPUT"], rows, RequestTimes(), params)
        return asyncio.create_task(self.scheduler.schedule(job))

    async def run(self, value: int, sid: Any, start: bool = False, end: bool = False) -> int:
        out = await self.submit(value, sid, start, end)
        return int(out["OUTPUT"][0, 0])

    def advance_us(self, us: int) -> None:
        self.now[0] += us * 1000


Factory = Callable[..., Any]


@pytest.fixture
async def make(tmp_path: Path) -> AsyncIterator[Factory]:
    made: list[Harness] = []

    async def factory(text: str | None = None, unmerged: bool = False, **kwargs: Any) -> Harness:
        config = text_format.Parse(text or config_text(**kwargs), ModelConfig())
        recorder = Recorder()
        base = RequestsBackend if unmerged else RecordingBackend
        backend = type("Rec", (base,), {"recorder": recorder, "requests": []})
        count = config.instance_group[0].count
        instances = [
            Instance(backend(config, tmp_path, InstanceSpec("acc", "cpu", 0, i, count)), "acc")
            for i in range(count)
        ]
        now = [0]
        stats = ModelStats()
        scheduler = SequenceScheduler(
            instances, stats, "acc", config, tmp_path, clock=lambda: now[0]
        )
        harness = Harness(scheduler, recorder, stats, now)
        made.append(harness)
        return harness

    yield factory
    for harness in made:
        harness.recorder.release.set()
        await harness.scheduler.close()


async def until(condition: Callable[[], bool]) -> None:
    """Yield to the loop until ``condition`` holds (the bound only stops a hung test)."""
    for _ in range(5000):
        if condition():
            return
        await asyncio.sleep(0.002)
    raise AssertionError("condition never became true")


async def hold_first(h: Harness, value: int, sid: Any) -> asyncio.Task[dict[str, np.ndarray]]:
    """Start sequence ``sid`` with a batch that stays executing until released."""
    h.recorder.hold.set()
    task = h.submit(value, sid, start=True)
    await until(lambda: len(h.recorder.batches) == 1)
    return task


def total(out: dict[str, np.ndarray]) -> int:
    return int(out["OUTPUT"][0, 0])


async def a_then_a_and_b(h: Harness) -> None:
    """Sequence A's first request runs alone (held); A's second and B's first queue
    meanwhile and run together in the next batch. Running totals 1, then 3 and 10."""
    first_a = await hold_first(h, 1, 100)
    b1 = h.submit(10, "b", start=True)
    a2 = h.submit(2, 100)
    await until(lambda: h.scheduler.pending == 2)
    h.recorder.hold.clear()
    h.recorder.release.set()
    assert [total(await t) for t in (first_a, a2, b1)] == [1, 3, 10]


async def error_of(task: asyncio.Future[Any]) -> KilnError:
    with pytest.raises(KilnError) as info:
        await task
    return info.value


# ---- a backend that takes requests unmerged (the Python backend) ---------------------------
async def test_an_unmerged_backend_gets_each_request_with_its_own_controls_and_state(
    make: Factory,
) -> None:
    h = await make(mbs=2, unmerged=True)
    await a_then_a_and_b(h)
    backend = h.scheduler.instances[0].backend
    assert isinstance(backend, RequestsBackend)
    # The second batch held A's and B's requests, each with batch dimension 1, its own
    # START and state, and the state output among its outputs; no empty slot was sent.
    second = backend.requests[1]
    assert len(second) == 2
    by_input = {int(r["inputs"]["INPUT"][0, 0]): r for r in second}
    assert by_input[2]["inputs"]["START"].tolist() == [[0]]
    assert by_input[2]["inputs"]["ACC_IN"].tolist() == [[1]]  # A's state after step 1
    assert by_input[10]["inputs"]["START"].tolist() == [[1]]
    assert all(r["outputs"] == ["OUTPUT", "ACC_OUT"] for r in second)
    assert await h.run(5, "b") == 15
    assert len(backend.requests[-1]) == 1  # B alone: one request, not a padded batch


async def test_an_unmerged_backend_fails_one_request_not_its_batch_mates(make: Factory) -> None:
    h = await make(mbs=2, unmerged=True)
    first = await hold_first(h, 1, "a")
    bad = h.submit(66, "b", start=True)
    good = h.submit(2, "a")
    await until(lambda: h.scheduler.pending == 2)
    h.recorder.fail_on = 66
    h.recorder.hold.clear()
    h.recorder.release.set()
    assert total(await first) == 1
    error = await error_of(bad)
    assert "refuses this value" in error.message
    assert total(await good) == 3  # its batch mate's failure did not touch it
    h.recorder.fail_on = None
    assert await h.run(4, "b", start=True) == 4


async def test_an_unmerged_backend_s_response_parameters_reach_the_job(make: Factory) -> None:
    h = await make(mbs=1, unmerged=True)
    params = {"sequence_id": 5, "sequence_start": True}
    job = Job({"INPUT": np.full((1, 1), 9, np.int32)}, ["OUTPUT"], 1, RequestTimes(), params)
    out = await h.scheduler.schedule(job)
    assert total(out) == 9
    assert job.response_parameters == {"seen": 9}


# ---- direct ------------------------------------------------------------------------------
async def test_direct_pins_each_sequence_to_its_slot(make: Factory) -> None:
    h = await make(mbs=2)
    await a_then_a_and_b(h)
    # B alone: A's row is an empty slot (READY false, zero data), B stays on row 1.
    assert await h.run(5, "b") == 15
    rec = h.recorder
    assert len(rec.batches) == 3
    assert rec.column(0, "START") == [1] and rec.column(0, "READY") == [1]
    assert rec.column(1, "INPUT") == [2, 10]
    assert rec.column(1, "START") == [0, 1] and rec.column(1, "READY") == [1, 1]
    assert rec.column(2, "INPUT") == [0, 5]
    assert rec.column(2, "READY") == [0, 1] and rec.column(2, "START") == [0, 0]
    assert rec.column(2, "ACC_IN") == [0, 10]  # the empty slot gets the initial state


async def test_requests_of_one_sequence_run_in_order_one_per_batch(make: Factory) -> None:
    h = await make(mbs=4)
    first = await hold_first(h, 1, 7)
    rest = [h.submit(v, 7) for v in (2, 3, 4)]
    await until(lambda: h.scheduler.pending == 3)
    h.recorder.hold.clear()
    h.recorder.release.set()
    assert [total(await t) for t in (first, *rest)] == [1, 3, 6, 10]
    assert [h.recorder.column(i, "INPUT") for i in range(4)] == [[1], [2], [3], [4]]


async def test_backlogged_sequence_waits_for_a_slot_until_one_ends(make: Factory) -> None:
    h = await make(mbs=1)  # one instance, one slot
    assert await h.run(1, "a", start=True) == 1
    waiting = h.submit(5, "b", start=True)
    await until(lambda: h.scheduler.pending == 1)
    assert not waiting.done() and h.scheduler.backlog
    assert await h.run(2, "a", end=True) == 3  # A ends: its slot goes to B
    assert total(await waiting) == 5


async def test_minimum_slot_utilization_waits_for_more_ready_slots(make: Factory) -> None:
    h = await make(
        mbs=2,
        strategy="direct { max_queue_delay_microseconds: 100000000 minimum_slot_utilization: 1.0 }",
    )
    a = h.submit(1, "a", start=True)
    await until(lambda: h.scheduler.pending == 1)
    assert not h.recorder.batches  # 1 of 2 slots ready: waits out the (long) delay
    b = h.submit(2, "b", start=True)
    assert [total(await a), total(await b)] == [1, 2]
    assert h.recorder.column(0, "INPUT") == [1, 2]


# ---- oldest ------------------------------------------------------------------------------
async def test_oldest_batches_one_request_per_sequence_oldest_first(make: Factory) -> None:
    h = await make(mbs=2, strategy="oldest { max_candidate_sequences: 8 }")
    first = await hold_first(h, 1, 1)
    a2, a3 = h.submit(2, 1), h.submit(3, 1)
    b1 = h.submit(10, 2, start=True)
    c1 = h.submit(100, 3, start=True)
    await until(lambda: h.scheduler.pending == 4)
    h.recorder.hold.clear()
    h.recorder.release.set()
    results = [total(await t) for t in (first, a2, a3, b1, c1)]
    assert results == [1, 3, 6, 10, 100]
    rec = h.recorder
    # Never two requests of sequence 1 in one batch; the oldest heads go first.
    assert rec.column(1, "INPUT") == [2, 10]
    assert sorted(rec.column(2, "INPUT")) == [3, 100]
    assert all(rec.column(i, "READY") == [1] * len(rec.batches[i]["READY"]) for i in range(3))
    assert [b["batch_size"] for b in h.stats.to_json("acc", "1")["batch_stats"]] == [1, 2]


async def test_oldest_candidate_limit_backlogs_extra_sequences(make: Factory) -> None:
    h = await make(mbs=4, strategy="oldest { max_candidate_sequences: 1 }")
    assert await h.run(1, "a", start=True) == 1
    waiting = h.submit(7, "b", start=True)
    await until(lambda: h.scheduler.pending == 1)
    assert not waiting.done()
    assert await h.run(1, "a", end=True) == 2
    assert total(await waiting) == 7


# ---- controls and state ------------------------------------------------------------------
EXTRA = """,
    { name: "END" control [ { kind: CONTROL_SEQUENCE_END bool_false_true: [ false, true ] } ] },
    { name: "CORRID" control [ { kind: CONTROL_SEQUENCE_CORRID data_type: TYPE_%s } ] },
    { name: "FSTART" control [ { kind: CONTROL_SEQUENCE_START fp32_false_true: [ 0.5, 2.5 ] } ] }
"""


async def test_end_corrid_and_fp32_controls_carry_their_values(make: Factory) -> None:
    h = await make(mbs=2, extra_controls=EXTRA % "UINT64")
    big = 2**64 - 1
    assert await h.run(4, big, start=True) == 4
    assert await h.run(1, big, end=True) == 5
    rec = h.recorder
    assert rec.batches[0]["CORRID"].dtype == np.uint64
    assert rec.column(0, "CORRID") == [big] and rec.column(1, "CORRID") == [big]
    assert rec.column(0, "END") == [False] and rec.column(1, "END") == [True]
    assert rec.batches[0]["FSTART"].dtype == np.float32
    assert rec.column(0, "FSTART") == [2.5] and rec.column(1, "FSTART") == [0.5]


async def test_string_ids_and_a_string_corrid(make: Factory) -> None:
    h = await make(extra_controls=EXTRA % "STRING")
    assert await h.run(3, "user-42", start=True) == 3
    assert h.recorder.column(0, "CORRID") == [b"user-42"]


async def test_string_id_refused_by_a_numeric_corrid_control(make: Factory) -> None:
    h = await make(extra_controls=EXTRA % "UINT64")
    err = await error_of(h.submit(1, "abc", start=True))
    assert err.status is Status.INVALID_ARG
    assert "'abc'" in err.message and "'acc'" in err.message and "CORRID" in err.message
    assert await h.run(2, 9, start=True) == 2  # the scheduler keeps serving


async def test_state_is_per_sequence_and_dropped_at_end(make: Factory) -> None:
    h = await make()
    assert await h.run(5, "x", start=True) == 5
    assert await h.run(1, "y", start=True) == 1
    assert await h.run(5, "x", end=True) == 10
    assert await h.run(2, "y") == 3
    assert await h.run(7, "x", start=True) == 7  # a new "x" starts from the initial state


async def test_initial_state_from_a_data_file(make: Factory, tmp_path: Path) -> None:
    (tmp_path / "initial_state").mkdir()
    (tmp_path / "initial_state" / "hundred").write_bytes(np.int32(100).tobytes())
    initial = "initial_state { name: 'h' data_type: TYPE_INT32 dims: [ 1 ] data_file: 'hundred' }"
    # STATE-only accumulator: without the START control the model adds onto the state.
    text = config_text(initial=initial).replace(
        '{ name: "START" control [ { kind: CONTROL_SEQUENCE_START '
        "int32_false_true: [ 0, 1 ] } ] },",
        "",
    )
    h = await make(text)
    assert await h.run(1, 1, start=True) == 101
    assert await h.run(2, 1) == 103


async def test_failed_batch_fails_its_requests_and_keeps_the_state(make: Factory) -> None:
    h = await make()
    h.recorder.fail_on = -99
    assert await h.run(4, 1, start=True) == 4
    err = await error_of(h.submit(-99, 1))
    assert err.status is Status.INTERNAL and "refuses" in err.message
    assert await h.run(1, 1) == 5


# ---- bad requests ------------------------------------------------------------------------
@pytest.mark.parametrize("sid", [None, 0, ""])
async def test_missing_sequence_id(make: Factory, sid: Any) -> None:
    h = await make()
    params = {} if sid is None else {"sequence_id": sid}
    job = Job({"INPUT": np.ones((1, 1), np.int32)}, ["OUTPUT"], 1, RequestTimes(), params)
    with pytest.raises(KilnError) as info:
        await h.scheduler.schedule(job)
    assert info.value.status is Status.INVALID_ARG
    assert "'acc'" in info.value.message and "correlation ID" in info.value.message


@pytest.mark.parametrize(
    ("params", "named"),
    [
        ({"sequence_id": 1.5}, "sequence_id"),
        ({"sequence_id": True}, "sequence_id"),
        ({"sequence_id": 2**64}, "sequence_id"),
        ({"sequence_id": 1, "sequence_start": "yes"}, "sequence_start"),
    ],
)
async def test_malformed_sequence_parameters(make: Factory, params: Any, named: str) -> None:
    h = await make()
    job = Job({"INPUT": np.ones((1, 1), np.int32)}, ["OUTPUT"], 1, RequestTimes(), params)
    with pytest.raises(KilnError) as info:
        await h.scheduler.schedule(job)
    assert info.value.status is Status.INVALID_ARG and named in info.value.message


async def test_unknown_sequence_without_start(make: Factory) -> None:
    h = await make()
    err = await error_of(h.submit(1, 55))
    assert err.status is Status.INVALID_ARG
    assert "sequence 55 to model 'acc' must specify the START flag" in err.message
    assert "no such sequence" in err.message


async def test_request_after_end(make: Factory) -> None:
    h = await make()
    assert await h.run(1, "s", start=True) == 1
    end = h.submit(1, "s", end=True)
    late = await error_of(h.submit(1, "s"))  # END queued, not yet run: already refused
    assert total(await end) == 2
    later = await error_of(h.submit(1, "s"))
    for err in (late, later):
        assert err.status is Status.INVALID_ARG
        assert "sequence 's' to model 'acc'" in err.message and "already ended" in err.message


async def test_batch_size_above_one_is_refused(make: Factory) -> None:
    h = await make()
    err = await error_of(h.submit(1, 3, start=True, rows=2))
    assert err.status is Status.INVALID_ARG and "batch-size 1" in err.message


async def test_idle_sequence_expires_on_its_next_request(make: Factory) -> None:
    h = await make()
    assert await h.run(1, 8, start=True) == 1
    h.advance_us(IDLE_US - 1)
    assert await h.run(1, 8) == 2  # within the limit (measured from the last activity)
    h.advance_us(IDLE_US + 1)
    err = await error_of(h.submit(1, 8))
    assert err.status is Status.INVALID_ARG
    assert "sequence 8 to model 'acc'" in err.message and "idle" in err.message
    assert await h.run(3, 8, start=True) == 3  # a new sequence with the id starts afresh


async def test_reaper_frees_the_slot_of_an_idle_sequence(make: Factory) -> None:
    h = await make(mbs=1)
    assert await h.run(1, "idle", start=True) == 1
    waiting = h.submit(5, "next", start=True)
    await until(lambda: h.scheduler.pending == 1)
    assert h.scheduler.expire_idle(h.now[0]) == 0  # "next" has queued work; "idle" is fresh
    h.advance_us(IDLE_US + 1)
    assert h.scheduler.expire_idle(h.now[0]) == 1
    assert total(await waiting) == 5
    err = await error_of(h.submit(1, "idle"))
    assert "idle" in err.message


async def test_unload_fails_requests_that_can_never_run(make: Factory) -> None:
    h = await make(mbs=1)
    assert await h.run(1, "a", start=True) == 1
    stuck = h.submit(1, "b", start=True)  # backlogged behind "a", which never ends
    await until(lambda: h.scheduler.pending == 1)
    await h.scheduler.close()
    err = await error_of(stuck)
    assert err.status is Status.UNAVAILABLE and "unloading" in err.message


# ---- iterative sequences and rescheduling ----------------------------------------------
def job_without_id(value: int) -> Job:
    return Job({"INPUT": np.full((1, 1), value, np.int32)}, ["OUTPUT"], 1, RequestTimes(), {})


async def test_iterative_request_without_id_is_a_sequence_that_reruns_until_released(
    make: Factory,
) -> None:
    h = await make(
        config_text(strategy="direct { } iterative_sequence: true", mbs=2), unmerged=True
    )
    h.recorder.reschedule[3] = 2
    out = await h.scheduler.schedule(job_without_id(3))
    assert total(out) == 3
    runs = [batch[0] for batch in h.scheduler.instances[0].backend.requests]
    assert len(runs) == 3  # twice rescheduled, then answered
    assert [r["flags"] for r in runs] == [1, 0, 0]  # START first, continuations after
    assert [r["inputs"]["START"].tolist() for r in runs] == [[[1]], [[0]], [[0]]]
    assert {r["corrid"] for r in runs} == {1}  # the scheduler named it, Triton-style
    # released without rescheduling: the sequence is over and its slot free again
    assert not h.scheduler.sequences and h.scheduler.pending == 0
    out = await h.scheduler.schedule(job_without_id(4))
    assert h.scheduler.instances[0].backend.requests[-1][0]["corrid"] == 2


async def test_iterative_sequences_share_the_slots_and_queue_for_them(make: Factory) -> None:
    h = await make(
        config_text(strategy="direct { } iterative_sequence: true", mbs=1), unmerged=True
    )
    h.recorder.reschedule.update({5: 3, 6: 1})
    first, second = (asyncio.create_task(h.scheduler.schedule(job_without_id(v))) for v in (5, 6))
    assert [total(await t) for t in (first, second)] == [5, 6]
    runs = [batch for batch in h.scheduler.instances[0].backend.requests]
    assert all(len(batch) == 1 for batch in runs)  # one slot: one request per batch
    # the first holds the slot through its reschedules; the second starts after it ends
    assert [b[0]["corrid"] for b in runs] == [1, 1, 1, 1, 2, 2]
    assert not h.scheduler.sequences


async def test_a_client_sequence_may_be_rescheduled_and_keeps_its_order(make: Factory) -> None:
    h = await make(
        config_text(strategy="direct { } iterative_sequence: true", mbs=1), unmerged=True
    )
    h.recorder.reschedule[1] = 1
    first = h.submit(1, "s", start=True)
    second = h.submit(2, "s", end=True)
    assert [total(await t) for t in (first, second)] == [1, 3]
    runs = [b[0] for b in h.scheduler.instances[0].backend.requests]
    # the rescheduled request ran again before the sequence's next one
    assert [int(r["inputs"]["INPUT"][0, 0]) for r in runs] == [1, 1, 2]
    assert [r["flags"] for r in runs] == [1, 0, 2]
    assert {r["corrid"] for r in runs} == {"s"}


async def test_a_request_of_its_own_sequence_must_still_have_batch_size_one(
    make: Factory,
) -> None:
    h = await make(
        config_text(strategy="direct { } iterative_sequence: true", mbs=2), unmerged=True
    )
    job = Job({"INPUT": np.ones((2, 1), np.int32)}, ["OUTPUT"], 2, RequestTimes(), {})
    err = await error_of(asyncio.ensure_future(h.scheduler.schedule(job)))
    assert "must specify batch-size 1" in err.message and "sent 2" in err.message
    assert not h.scheduler.sequences  # nothing was begun for it


async def test_rescheduling_without_iterative_sequence_fails_the_request(make: Factory) -> None:
    h = await make(mbs=1, unmerged=True)
    h.recorder.reschedule[7] = 1
    err = await error_of(h.submit(7, "a", start=True))
    assert "TRITONSERVER_REQUEST_RELEASE_RESCHEDULE" in err.message
    assert "'acc'" in err.message and "iterative_sequence: true" in err.message
    assert await h.run(7, "a") == 7  # the sequence goes on


async def test_a_request_without_id_is_still_refused_without_iterative_sequence(
    make: Factory,
) -> None:
    h = await make(mbs=1, unmerged=True)
    err = await error_of(asyncio.ensure_future(h.scheduler.schedule(job_without_id(1))))
    assert "must specify a non-zero or non-empty correlation ID" in err.message


# ---- wiring ------------------------------------------------------------------------------
def test_signature_leaves_controls_and_state_to_the_scheduler() -> None:
    text = (
        config_text()
        + """
input [ { name: "START" data_type: TYPE_INT32 dims: [ 1 ] },
        { name: "ACC_IN" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "ACC_OUT" data_type: TYPE_INT32 dims: [ 1 ] } ]
"""
    )  # as auto-complete would list them from the model file
    signature = ModelSignature(text_format.Parse(text, ModelConfig()))
    assert list(signature.inputs) == ["INPUT"] and signature.required == ["INPUT"]
    assert signature.output_names == ["OUTPUT"]
    data = np.ones((1, 1), np.int32)
    ok = InferenceRequest("acc", inputs=[InferInput("INPUT", DataType.INT32, (1, 1), data)])
    assert signature.validate(ok) == 1
    extra = InferInput("START", DataType.INT32, (1, 1), data)
    with pytest.raises(KilnError, match="unexpected inference input 'START'"):
        signature.validate(InferenceRequest("acc", inputs=[*ok.inputs, extra]))


async def test_runtime_uses_the_sequence_batcher(tmp_path: Path) -> None:
    config = text_format.Parse(config_text(), ModelConfig())
    backend = type("Rec", (RecordingBackend,), {"recorder": Recorder()})
    runtime = ModelRuntime("acc", 1, config, tmp_path / "1", backend)
    await runtime.load()
    try:
        assert isinstance(runtime.scheduler, SequenceScheduler)
        data = np.full((1, 1), 6, np.int32)
        req = InferenceRequest(
            "acc",
            inputs=[InferInput("INPUT", DataType.INT32, (1, 1), data)],
            parameters={"sequence_id": 3, "sequence_start": True},
        )
        response = await runtime.infer(req)
        assert [o.name for o in response.outputs] == ["OUTPUT"]
        assert response.outputs[0].data.tolist() == [[6]]
        stats = runtime.stats.to_json("acc", "1")
        assert stats["inference_stats"]["success"]["count"] == 1 and stats["execution_count"] == 1
    finally:
        await runtime.unload(5)
