"""``ensemble_scheduling { max_inflight_requests }``: at most that many requests in flight
at each step across the ensemble's requests, and a decoupled step's responses read no
faster than the step after it admits them. Fake composing models whose execution the test
releases one at a time, so every count below is exact, not timed."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import numpy as np
import pytest

from kiln.config.ensemble_graph import EnsembleGraph, Step
from kiln.config.loader import parse_config_text
from kiln.config.signature import ModelSignature
from kiln.core.errors import KilnError, Status
from kiln.core.stats import ModelStats, RequestTimes
from kiln.core.stream import ResponseStream
from kiln.core.types import DataType, InferenceRequest, InferenceResponse, InferOutput
from kiln.scheduling.base import Job
from kiln.scheduling.ensemble import EnsembleScheduler, StepFailed

ENSEMBLE = """
name: "pipe"
platform: "ensemble"
max_batch_size: 0
input [ { name: "X" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "Y" data_type: TYPE_INT32 dims: [ 1 ] } ]
"""


class Gated:
    """``Y = T + 1`` once the test lets a call through (``release``); ``fail_on``: the
    value that makes it raise."""

    def __init__(self, name: str, fail_on: int | None = None) -> None:
        self.name = name
        self.decoupled = False
        self.running = 0
        self.peak = 0
        self.done = 0
        self.fail_on = fail_on
        self._gate: asyncio.Queue[None] = asyncio.Queue()

    def release(self, n: int = 1) -> None:
        for _ in range(n):
            self._gate.put_nowait(None)

    async def infer(self, request: InferenceRequest) -> InferenceResponse:
        self.running += 1
        self.peak = max(self.peak, self.running)
        try:
            await self._gate.get()
            value = int(request.inputs[0].data[0])
            if value == self.fail_on:
                raise KilnError(f"cannot take {value}", Status.INTERNAL)
            self.done += 1
            out = np.array([value + 1], np.int32)
            return InferenceResponse(self.name, "1", outputs=[_out("Y", out)])
        finally:
            self.running -= 1

    def infer_stream(
        self, request: InferenceRequest, window: int = 0
    ) -> AsyncIterator[InferenceResponse]:
        raise AssertionError("not decoupled")


class Producer:
    """Decoupled: ``count`` responses T = 0, 1, ...; counts how many were pulled."""

    def __init__(self, count: int) -> None:
        self.name = "producer"
        self.decoupled = True
        self.count = count
        self.produced = 0
        self.windows: list[int] = []

    async def infer(self, request: InferenceRequest) -> InferenceResponse:
        raise AssertionError("decoupled")

    async def infer_stream(
        self, request: InferenceRequest, window: int = 0
    ) -> AsyncIterator[InferenceResponse]:
        self.windows.append(window)
        for i in range(self.count):
            self.produced += 1
            yield InferenceResponse(self.name, "1", outputs=[_out("T", np.array([i], np.int32))])


def _out(name: str, value: np.ndarray) -> InferOutput:
    return InferOutput(name, DataType.INT32, value.shape, value)


def _scheduler(
    models: dict[str, Gated | Producer], max_inflight: int, decoupled: frozenset[int]
) -> EnsembleScheduler:
    first = "producer" if "producer" in models else "gate"
    graph = EnsembleGraph(
        name="pipe",
        steps=(
            Step(0, first, "", {"X": "X"}, {"Y" if first == "gate" else "T": "t"}),
            Step(1, "next", "", {"T": "t"}, {"Y": "Y"}),
        ),
        inputs=("X",),
        outputs=("Y",),
    )
    signature = ModelSignature(parse_config_text(ENSEMBLE))
    return EnsembleScheduler(
        graph,
        signature,
        ModelStats(),
        lambda name, _version: models[name],
        decoupled,
        max_inflight,
    )


def _job(x: int, stream: ResponseStream | None = None) -> Job:
    return Job({"X": np.array([x], np.int32)}, ["Y"], 1, RequestTimes(), sink=stream)


async def _settle() -> None:
    for _ in range(20):
        await asyncio.sleep(0)


@pytest.mark.parametrize("limit", [0, 2])
async def test_a_step_holds_at_most_max_inflight_requests_across_the_ensembles_requests(
    limit: int,
) -> None:
    first, second = Gated("gate"), Gated("next")
    scheduler = _scheduler({"gate": first, "next": second}, limit, frozenset())
    tasks = [asyncio.create_task(scheduler.schedule(_job(i))) for i in range(5)]
    await _settle()
    assert first.running == (limit or 5)  # the rest wait for a place, not at the model
    assert scheduler.in_flight(0) == limit and scheduler.in_flight(1) == 0
    first.release(5)
    await _settle()
    assert second.running == (limit or 5)
    second.release(5)
    results = await asyncio.gather(*tasks)
    assert sorted(int(r["Y"][0]) for r in results) == [2, 3, 4, 5, 6]
    assert first.peak == second.peak == (limit or 5)
    assert scheduler.in_flight(0) == scheduler.in_flight(1) == 0


async def test_a_decoupled_step_is_read_only_as_fast_as_the_next_step_admits() -> None:
    producer, slow = Producer(10), Gated("next")
    scheduler = _scheduler({"producer": producer, "next": slow}, 2, frozenset({0}))
    stream = ResponseStream(asyncio.get_running_loop())
    task = asyncio.create_task(scheduler.schedule(_job(0, stream)))
    await _settle()
    # two branches at the slow step, a third response read and waiting for a place
    assert (slow.running, producer.produced) == (2, 3)
    assert producer.windows == [2]  # the producer's own stream holds at most 2 untaken
    for done in range(1, 11):
        slow.release()
        await _settle()
        assert producer.produced == min(10, done + 3)  # each answer lets one more in
    await task
    assert slow.peak == 2
    stream.finish()
    values = sorted(int(item.outputs["Y"][0]) for item in [i async for i in stream] if item.outputs)
    assert values == list(range(1, 11))
    assert scheduler.in_flight(0) == scheduler.in_flight(1) == 0


async def test_without_the_limit_the_decoupled_step_runs_ahead() -> None:
    producer, slow = Producer(10), Gated("next")
    scheduler = _scheduler({"producer": producer, "next": slow}, 0, frozenset({0}))
    stream = ResponseStream(asyncio.get_running_loop())
    task = asyncio.create_task(scheduler.schedule(_job(0, stream)))
    await _settle()
    assert (slow.running, producer.produced, producer.windows) == (10, 10, [0])
    slow.release(10)
    await task


async def test_places_come_back_when_a_branch_fails_or_the_request_is_cancelled() -> None:
    producer, slow = Producer(10), Gated("next", fail_on=1)
    scheduler = _scheduler({"producer": producer, "next": slow}, 2, frozenset({0}))
    stream = ResponseStream(asyncio.get_running_loop())
    task = asyncio.create_task(scheduler.schedule(_job(0, stream)))
    await _settle()
    slow.release(2)  # T=0 passes, T=1 fails the request
    with pytest.raises(StepFailed, match="step 1 model 'next' failed: cannot take 1"):
        await task
    await _settle()
    assert scheduler.in_flight(0) == scheduler.in_flight(1) == 0
    assert producer.produced < 10  # the stream stopped early

    cancelled = asyncio.create_task(scheduler.schedule(_job(0, ResponseStream(stream._loop))))
    await _settle()
    assert scheduler.in_flight(1) == 2
    cancelled.cancel()
    with pytest.raises(asyncio.CancelledError):
        await cancelled
    await _settle()
    assert scheduler.in_flight(0) == scheduler.in_flight(1) == 0


async def test_the_stream_grants_what_was_taken_every_half_window() -> None:
    stream = ResponseStream(asyncio.get_running_loop(), window=4)
    grants: list[int] = []
    stream.on_credit(grants.append)
    reader = aiter(stream)

    async def take() -> None:
        await anext(reader)

    for _ in range(4):  # a whole window: the producer waits now
        stream.send({"T": np.array([0])}, False, None)
    await _settle()
    assert grants == []  # nothing taken yet: nothing to grant
    await take()
    assert grants == []  # one taken: less than half a window
    await take()
    assert grants == [2]  # half a window taken: the producer may send two more
    for _ in range(2):
        stream.send({"T": np.array([0])}, False, None)
    await _settle()
    assert grants == [2]  # sends grant nothing
    for _ in range(3):
        await take()
    assert grants == [2, 4]  # 5 taken: the grant said 4
    await take()
    assert grants == [2, 4, 6]  # all six taken
    stream.send(None, True, None)  # a FINAL flag takes no credit
    await _settle()
    await take()
    assert grants == [2, 4, 6]
    stream.cancel()
    assert grants == [2, 4, 6, -1]  # the reader left: the producer is let go


async def test_a_waiting_producer_always_gets_a_grant_once_its_window_is_taken() -> None:
    """An odd window: a producer that sent all of it waits; once the reader took what came,
    at least half a window is there to grant, so it never waits for good."""
    stream = ResponseStream(asyncio.get_running_loop(), window=3)
    grants: list[int] = []
    stream.on_credit(grants.append)
    reader = aiter(stream)
    for _ in range(3):
        stream.send({"T": np.array([0])}, False, None)
    await _settle()
    for _ in range(3):
        await anext(reader)
    assert grants and grants[-1] == 3


async def test_a_stream_without_a_window_never_grants() -> None:
    stream = ResponseStream(asyncio.get_running_loop())
    grants: list[int] = []
    stream.on_credit(grants.append)
    for _ in range(5):
        stream.send({"T": np.array([0])}, False, None)
    await _settle()  # the sends reach the loop before the end does
    stream.finish()
    assert len([item async for item in stream]) == 5
    assert grants == []
