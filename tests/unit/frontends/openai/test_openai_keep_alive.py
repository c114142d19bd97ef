"""vLLM's ``--sse-keep-alive-interval``: comments while a stream is held back, every event
through in order, and nothing left running when the stream ends or its reader leaves.
The source is held by events the test sets: no assertion depends on how long a step takes."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator

import pytest

from kiln.frontends.openai.generation import Delta, started
from kiln.frontends.openai.keep_alive import KEEP_ALIVE, with_keep_alive

TICK = 0.001  # the interval: far shorter than any hold below, which the test releases


class Held:
    """A stream whose events go out only when the test releases them."""

    def __init__(self, events: list[bytes]) -> None:
        self.events = events
        self.gates = [asyncio.Event() for _ in events]
        self.closed = asyncio.Event()

    async def stream(self) -> AsyncGenerator[bytes, None]:
        try:
            for gate, event in zip(self.gates, self.events, strict=True):
                await gate.wait()
                yield event
        finally:
            self.closed.set()


async def _until_comment(stream: AsyncGenerator[bytes, None] | object) -> list[bytes]:
    seen = []
    async for chunk in stream:  # type: ignore[attr-defined]
        seen.append(chunk)
        if chunk == KEEP_ALIVE:
            return seen
    return seen


def test_off_is_the_stream_itself() -> None:
    async def source() -> AsyncGenerator[bytes, None]:
        yield b"data: 1\n\n"

    stream = source()
    assert with_keep_alive(stream, 0) is stream
    assert with_keep_alive(stream, float("inf")) is stream


async def test_comments_fill_the_holds_and_events_keep_their_order() -> None:
    held = Held([b"data: 1\n\n", b"data: 2\n\n", b"data: [DONE]\n\n"])
    stream = with_keep_alive(held.stream(), TICK)
    out = await _until_comment(stream)  # held before the first event (queued, prefill)
    assert out == [KEEP_ALIVE]
    held.gates[0].set()
    out = await _until_comment(stream)  # the event, then comments while the next is held
    assert out[0] == b"data: 1\n\n" and out[-1] == KEEP_ALIVE
    held.gates[1].set()
    held.gates[2].set()
    rest = [chunk async for chunk in stream]
    events = [c for c in rest if c != KEEP_ALIVE]
    assert events == [b"data: 2\n\n", b"data: [DONE]\n\n"]  # nothing lost or reordered
    assert held.closed.is_set()
    assert KEEP_ALIVE == b": keep-alive\n\n"  # vLLM's bytes: an SSE comment


async def test_a_reader_leaving_mid_hold_closes_the_stream_and_leaves_no_task() -> None:
    before = asyncio.all_tasks()
    held = Held([b"data: 1\n\n"])
    stream = with_keep_alive(held.stream(), TICK)
    assert await _until_comment(stream) == [KEEP_ALIVE]  # an anext of the source pending
    await stream.aclose()  # type: ignore[attr-defined]
    assert held.closed.is_set()
    assert asyncio.all_tasks() == before


async def test_a_cancelled_reader_closes_the_stream_and_stays_cancelled() -> None:
    before = asyncio.all_tasks()
    held = Held([b"data: 1\n\n"])
    stream = with_keep_alive(held.stream(), TICK)
    seen = asyncio.Event()

    async def read() -> None:
        async for chunk in stream:
            if chunk == KEEP_ALIVE:
                seen.set()

    reader = asyncio.ensure_future(read())
    await seen.wait()
    reader.cancel()  # the server's task for a client that left
    with pytest.raises(asyncio.CancelledError):
        await reader
    assert held.closed.is_set()
    assert asyncio.all_tasks() == before


async def test_an_error_of_the_stream_reaches_its_reader() -> None:
    async def failing() -> AsyncGenerator[bytes, None]:
        yield b"data: 1\n\n"
        raise RuntimeError("engine died")

    stream = with_keep_alive(failing(), TICK)
    assert await anext(stream) == b"data: 1\n\n"
    with pytest.raises(RuntimeError, match="engine died"):
        await anext(stream)


def _delta(text: str) -> Delta:
    return Delta(text, None, 1, 1)


async def test_started_with_a_wait_begins_before_a_held_first_delta() -> None:
    gate = asyncio.Event()
    closed = asyncio.Event()

    async def deltas() -> AsyncGenerator[Delta, None]:
        try:
            await gate.wait()
            yield _delta("a")
            yield _delta("b")
        finally:
            closed.set()

    rest = await started(deltas(), wait=TICK)  # returns though nothing came yet
    gate.set()
    assert [d.text async for d in rest] == ["a", "b"]
    assert closed.is_set()

    # an error within the wait is raised by started itself: the HTTP status
    async def refused() -> AsyncGenerator[Delta, None]:
        raise ValueError("queue full")
        yield _delta("never")

    with pytest.raises(ValueError, match="queue full"):
        await started(refused(), wait=TICK)

    # an empty stream, and a reader leaving before the first delta came
    async def empty() -> AsyncGenerator[Delta, None]:
        return
        yield _delta("never")

    assert [d async for d in await started(empty(), wait=TICK)] == []
    before = asyncio.all_tasks()
    gate, closed = asyncio.Event(), asyncio.Event()
    rest = await started(deltas(), wait=TICK)
    reader = asyncio.ensure_future(anext(rest))
    await asyncio.sleep(0)
    reader.cancel()
    with pytest.raises(asyncio.CancelledError):
        await reader
    await rest.aclose()
    assert closed.is_set()
    assert asyncio.all_tasks() == before
