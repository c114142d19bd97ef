"""The scheduler without batching: a freed instance slot goes to the oldest waiting caller."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

from kiln.core.stats import ModelStats
from kiln.scheduling.direct import DirectScheduler


def _scheduler(depth: int = 1) -> tuple[DirectScheduler, Any]:
    instance = SimpleNamespace(backend=SimpleNamespace(pipeline_depth=depth, queued_requests=0))
    return DirectScheduler([instance], ModelStats(), "m"), instance  # type: ignore[list-item]


async def test_a_freed_slot_goes_to_the_oldest_waiter_not_a_newcomer() -> None:
    """With a queue, a caller arriving after a slot was freed could take it before the
    woken waiter ran, sending that waiter to the back again: at c=16 some requests then
    waited many times their share (p99 21-24 ms against 4-5 ms, benchmarks/HISTORY.md)."""
    scheduler, instance = _scheduler()
    held = await scheduler._acquire()
    assert held is instance and scheduler.pending == 0
    second = asyncio.ensure_future(scheduler._acquire())
    third = asyncio.ensure_future(scheduler._acquire())
    await asyncio.sleep(0)
    assert scheduler.pending == 2
    scheduler._release(held)
    newcomer = asyncio.ensure_future(scheduler._acquire())
    await asyncio.sleep(0)
    assert second.done() and second.result() is instance
    assert not third.done() and not newcomer.done()
    scheduler._release(await second)
    await asyncio.sleep(0)
    assert third.done() and not newcomer.done()
    scheduler._release(await third)
    assert await asyncio.wait_for(newcomer, 5) is instance
    scheduler._release(instance)
    assert scheduler.pending == 0 and len(scheduler._idle) == 1


async def test_a_waiter_cancelled_after_it_was_handed_a_slot_passes_it_on() -> None:
    scheduler, instance = _scheduler()
    held = await scheduler._acquire()
    gone = asyncio.ensure_future(scheduler._acquire())
    next_ = asyncio.ensure_future(scheduler._acquire())
    await asyncio.sleep(0)
    scheduler._release(held)  # handed to `gone`, which has not run yet
    gone.cancel()
    assert await asyncio.wait_for(next_, 5) is instance
    assert gone.cancelled()


async def test_a_waiter_cancelled_before_its_turn_leaves_the_line() -> None:
    scheduler, instance = _scheduler(depth=2)
    first, second = await scheduler._acquire(), await scheduler._acquire()
    assert first is second is instance  # two slots of one pipelined instance
    gone = asyncio.ensure_future(scheduler._acquire())
    await asyncio.sleep(0)
    assert scheduler.pending == 1
    gone.cancel()
    await asyncio.sleep(0)
    assert scheduler.pending == 0
    scheduler._release(first)
    scheduler._release(second)
    assert len(scheduler._idle) == 2
