"""vLLM's ``--sse-keep-alive-interval``: an SSE comment on a stream that is idle.

A proxy or tunnel with a read timeout (nginx's ``proxy_read_timeout``, a cloud load
balancer's idle timeout) closes a stream that sends nothing for a while: a request queued
behind others, a long prefill, a slow step. A comment line (``: keep-alive``) is bytes on
the wire that every SSE client skips (the ``openai`` client too). One ``anext`` of the
stream is in flight at a time and is never cancelled by the timer, so no event is lost,
reordered or held back; closing the stream cancels it and closes the stream it reads.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator
from typing import Any

__all__ = ["KEEP_ALIVE", "with_keep_alive"]

#: vLLM's comment line, byte for byte
KEEP_ALIVE = b": keep-alive\n\n"


def with_keep_alive(events: AsyncIterator[bytes], interval: float) -> AsyncIterator[bytes]:
    """``events`` with :data:`KEEP_ALIVE` after each ``interval`` seconds without one
    (``interval`` 0: ``events`` as it is)."""
    if not 0 < interval < math.inf:
        return events
    return _keep_alive(events, interval)


async def _keep_alive(events: AsyncIterator[bytes], interval: float) -> AsyncIterator[bytes]:
    pending: asyncio.Future[bytes] | None = None
    try:
        while True:
            if pending is None:
                pending = asyncio.ensure_future(anext(events))
            done, _ = await asyncio.wait({pending}, timeout=interval)
            if not done:
                yield KEEP_ALIVE
                continue
            finished, pending = pending, None
            try:
                event = finished.result()
            except StopAsyncIteration:
                return
            yield event
    finally:
        if pending is not None:  # the reader left (or was cancelled) mid-wait
            pending.cancel()
            # waited for, not awaited: a cancellation of this task is not swallowed
            await asyncio.wait({pending})
            if not pending.cancelled():
                pending.exception()  # retrieved: no "exception was never retrieved"
        close: Any = getattr(events, "aclose", None)
        if close is not None:
            await close()
