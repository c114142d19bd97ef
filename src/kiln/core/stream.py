"""Responses of a decoupled model, carried from the instance's thread to the event loop.

A decoupled model answers a request with 0..N responses, each sent whenever the model
chooses. The backend calls ``send`` on its instance's thread; the request's coroutine reads
them in order with ``async for``. ``finish`` (on the loop) ends the stream once the
scheduler is done with the request, with the scheduler's error if it failed. ``cancel`` (on
the loop) says the reader went away (a cancelled gRPC stream, a closed SSE connection): a
backend that registered with ``add_cancel_callback`` tells its model (Triton's
``is_cancelled()``).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import numpy as np

from kiln.core.errors import KilnError


@dataclass(slots=True)
class StreamItem:
    outputs: dict[str, np.ndarray] | None  # None: a FINAL flag sent without a response
    final: bool
    error: KilnError | None = None


_END = StreamItem(None, True)
log = logging.getLogger(__name__)


class ResponseStream:
    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._queue: asyncio.Queue[StreamItem] = asyncio.Queue()
        self._error: BaseException | None = None
        self.cancelled = False
        self._on_cancel: list[Callable[[], None]] = []
        self._cancel_lock = threading.Lock()  # a backend may register from its thread

    def send(
        self, outputs: dict[str, np.ndarray] | None, final: bool, error: KilnError | None
    ) -> None:
        """Thread-safe: queue one response (or a response's error) for the reader; dropped
        once the reader has gone (``cancel``), so a model that keeps sending holds no memory."""
        if self.cancelled:
            return
        self._loop.call_soon_threadsafe(self._queue.put_nowait, StreamItem(outputs, final, error))

    def add_cancel_callback(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` (on the loop) when the reader goes away; at once (on the
        caller's thread) if it has."""
        with self._cancel_lock:
            if not self.cancelled:
                self._on_cancel.append(callback)
                return
        callback()

    def cancel(self) -> None:
        """On the loop: nobody reads this stream any more."""
        with self._cancel_lock:
            if self.cancelled:
                return
            self.cancelled = True
            callbacks, self._on_cancel = self._on_cancel, []
        for callback in callbacks:
            try:
                callback()
            except Exception:
                log.exception("a cancellation callback failed")

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
