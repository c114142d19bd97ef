"""Request cancellation for the Python backend: Triton's ``is_cancelled()``.

A batch's requests each get one byte in the slot's inbound arena, written as 0 with their
tensors. When a request's client goes away (``Job.cancel``), the server sets the byte; the
worker reads it in ``InferenceRequest.is_cancelled()`` and
``InferenceResponseSender.is_cancelled()``, with no message on the pipe, so a model busy in
``execute`` sees it while it runs. Once the batch has ended the arena belongs to the next
batch of that slot, so the flags are no longer written.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from functools import partial

from kiln.backends.base import BackendRequest
from kiln.backends.python.arena import Arena

# A cancel (on the loop) against a batch's end (on any thread); rare and short, so one lock
# serves every batch rather than one made per batch.
_LOCK = threading.Lock()


class CancelWatch:
    """The cancellation bytes of one batch, set while the batch runs."""

    def __init__(self, arena: Arena, requests: Sequence[BackendRequest]) -> None:
        self._arena = arena
        self.offset = arena.zero_flags(len(requests))
        self._live = True
        for index, request in enumerate(requests):
            add = getattr(request, "add_cancel_callback", None)  # a Job's client can go
            if add is not None:
                add(partial(self._cancel, index))

    def _cancel(self, index: int) -> None:
        with _LOCK:
            if self._live:
                self._arena.set_flag(self.offset + index)

    def end(self) -> None:
        """The batch is over: its slot's arena may hold the next batch's tensors."""
        with _LOCK:
            self._live = False
