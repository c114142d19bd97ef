"""Responses of a decoupled model, carried from the instance's thread to the event loop.

A decoupled model answers a request with 0..N responses, each sent whenever the model
chooses. The backend calls ``send`` on its instance's thread; the request's coroutine reads
them in order with ``async for``. ``finish`` (on the loop) ends the stream once the
scheduler is done with the request, with the scheduler's error if it failed. ``cancel`` (on
the loop) says the reader went away: what the model sends after that is dropped (the
model itself hears of it through ``Job.cancel``).

**Detached requests.** A decoupled Python model may return from ``execute`` before it
sent a request's FINAL flag and send the rest from its own threads, as Triton allows; the
instance takes its next batch meanwhile. The backend then calls ``detach``, and the stream
ends with the FINAL response instead of when the scheduler is done with the request.

**Flow control.** A stream with a ``window`` (an ensemble's ``max_inflight_requests``)
holds at most that many responses its reader has not taken: a producer that can pause
(the Python backend's worker) registers ``on_credit`` and sends no further response while
``window`` of its non-final responses are untaken. The stream grants the count taken so
far each time half a window more has been taken, so a reader that keeps up costs two
grants per window and never lets the producer reach its end. ``-1`` lifts the limit: the
reader went away or the stream ended.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
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


#: What ``on_credit`` is called with to lift a window for good.
UNLIMITED = -1

#: The window of a client's stream (gRPC ``ModelStreamInfer``, HTTP ``generate_stream``):
#: a model that can pause (a Python model's response sender) sends no more while this many
#: of its responses wait untaken. The front ends take a response only as their client's
#: connection takes the one before (HTTP/2 and TCP flow control), so a client that reads
#: slowly, or not at all, holds the model back instead of filling the server's memory.
CLIENT_STREAM_WINDOW = 64


class ResponseStream:
    def __init__(self, loop: asyncio.AbstractEventLoop, window: int = 0) -> None:
        """``window``: how many non-final responses may wait untaken (0: no limit)."""
        self._loop = loop
        self._queue: asyncio.Queue[StreamItem] = asyncio.Queue()
        self._error: BaseException | None = None
        self.cancelled = False
        self.window = window
        self._half = max(1, window // 2)
        self._credit: Callable[[int], None] | None = None
        self._detached = False
        self._final_seen = False  # a final response (or error) was queued
        self._end_pending = False  # finish() came first on a detached stream
        self._taken = 0  # non-final responses taken and granted (on the loop)
        self._granted = 0

    def on_credit(self, grant: Callable[[int], None]) -> None:
        """The producer's way to hear how many non-final responses the reader has taken
        (or ``UNLIMITED``); called on the loop. Without a window nothing is granted."""
        self._credit = grant

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
        self._loop.call_soon_threadsafe(self._put, item)

    def _put(self, item: StreamItem) -> None:
        self._queue.put_nowait(item)
        if item.final:
            self._final_seen = True
            if self._end_pending:
                self._end_pending = False
                self._queue.put_nowait(_END)
                self._unlimit()

    def detach(self) -> None:
        """On the loop: the request's batch ended without its FINAL flag; the model sends
        the rest later, and the stream ends with it (see the module's text)."""
        self._detached = True

    def _grant(self) -> None:
        """Tell the producer what was taken once half a window has been taken since the
        last grant: two grants per window, and a producer that keeps pace with its reader
        never reaches the window's end. A producer that waits has sent a whole window, so
        once the reader took it, at least half a window is there to grant."""
        if self._credit is not None and self._taken - self._granted >= self._half:
            self._granted = self._taken
            self._credit(self._taken)

    def _unlimit(self) -> None:
        if self.window and self._credit is not None:
            self.window = 0
            self._credit(UNLIMITED)

    def cancel(self) -> None:
        """On the loop: nobody reads this stream any more. A paused producer goes on (what
        it sends is dropped) so that it can see the cancellation and end."""
        self.cancelled = True
        self._unlimit()

    def finish(self, error: BaseException | None = None) -> None:
        """On the loop: nothing more will come. Queued after everything ``send`` queued,
        because the executor hands its result to the loop the same way."""
        if error is None and self._detached and not self._final_seen and not self.cancelled:
            self._end_pending = True  # the FINAL flag is still to come
            return
        self._error = error
        self._queue.put_nowait(_END)
        self._unlimit()  # a thread of the model's may still wait (its batch failed)

    async def __aiter__(self) -> AsyncIterator[StreamItem]:
        while (item := await self._queue.get()) is not _END:
            if self.window and not item.final:
                self._taken += 1
                self._grant()
            yield item
        if self._error is not None:
            raise self._error
