"""``ResponseStream``: a decoupled model's responses, in order, and its reader going away."""

from __future__ import annotations

import asyncio
import threading

import numpy as np

from kiln.core.errors import KilnError
from kiln.core.stream import ResponseStream


async def test_responses_from_a_thread_arrive_in_order_then_the_error() -> None:
    stream = ResponseStream(asyncio.get_running_loop())

    def model() -> None:
        for i in range(3):
            stream.send({"OUT": np.array([i])}, i == 2, None)

    thread = threading.Thread(target=model)
    thread.start()
    thread.join()
    await asyncio.sleep(0)  # the thread's call_soon_threadsafe callbacks run
    stream.finish(KilnError("late failure"))
    got = []
    try:
        async for item in stream:
            got.append((item.outputs["OUT"].tolist() if item.outputs else None, item.final))
    except KilnError as exc:
        assert exc.message == "late failure"
    else:
        raise AssertionError("finish(error) did not raise after the items")
    assert got == [([0], False), ([1], False), ([2], True)]


async def test_after_cancel_responses_are_dropped() -> None:
    stream = ResponseStream(asyncio.get_running_loop())
    stream.send({"OUT": np.array([1])}, False, None)
    stream.cancel()
    for _ in range(1000):
        stream.send({"OUT": np.array([2])}, False, None)  # nobody reads: not kept
    await asyncio.sleep(0)
    stream.finish()
    items = [item async for item in stream]
    assert [i.outputs["OUT"].tolist() for i in items if i.outputs] == [[1]]
