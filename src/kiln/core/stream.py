"""Responses of a decoupled model, carried from the instance's thread to the event loop.

A decoupled model answers a request with 0..N responses, each sent whenever the model
chooses. The backend calls ``send`` on its instance's thread; the request's coroutine reads
them in order with ``async for``. ``finish`` (on the loop) ends the stream once the
scheduler is done with the request, with the scheduler's error if it failed. ``cancel`` (on
the loop) says the reader went away: what the model sends after that is dropped (the
model itself hears of it through ``Job.cancel``).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from kiln.core.errors import KilnError


@dataclass(slots=True)
class StreamItem:
    outputs: dict[str, np.ndarray] | None  # None: a FINAL flag sent without a response
    final: bool
    error: KilnError | None = None
    parameters: dict[str, Any] | None = None  # the response's own, for the client


_END = StreamItem(None, True)


class ResponseStream:
    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._queue: asyncio.Queue[StreamItem] = asyncio.Queue()
        self._error: BaseException | None = None
        self.cancelled = False

    def send(
        self,
        outputs: dict[str, np.ndarray] | None,
        final: bool,
        error: KilnError | None,
        parameters: dict[str, Any] | None = None,
    ) -> None:
        """Thread-safe: queue one response (or a response's error) for the reader; dropped
        once the reader has gone (``cancel``), so a model that keeps sending holds no memory."""
        if self.cancelled:
            return
        item = StreamItem(outputs, final, error, parameters)
        self._loop.call_soon_threadsafe(self._queue.put_nowait, item)

    def cancel(self) -> None:
        """On the loop: nobody reads this stream any more."""
        self.cancelled = True

    def finish(self, error: BaseException | None = None) -> None:
        """On the loop: nothing more will come. Queued after everything ``send`` queued,
        because the executor hands its result to the loop the same way."""
        self._error = error
        self._queue.put_nowait(_END)

    async def __aiter__(self) -> AsyncIterator[StreamItem]:
        while (item := await self._queue.get()) is not _END:
            yield item
        if self._error is not None:
            raise self._error
