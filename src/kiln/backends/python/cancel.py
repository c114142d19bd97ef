"""Request cancellation for the Python backend (Triton's ``is_cancelled()``), and the
streams of a decoupled model's requests while the worker has them.

Every request the worker has gets one byte in the worker's flags arena (``FlagPool``),
written as 0 when the batch is sent. When a request's client goes away (``Job.cancel``),
the server sets the byte; the worker reads it in ``InferenceRequest.is_cancelled()`` and
``InferenceResponseSender.is_cancelled()``, with no message on the pipe, so a model busy in
``execute`` sees it while it runs. The byte goes back to the pool when the request is over
for the worker: when its batch ends, or, for a decoupled request still open when its
``execute`` returned, when the model sends its FINAL flag. A cancel after that writes
nothing.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kiln.backends.base import BackendRequest
from kiln.backends.python.arena import Arena

if TYPE_CHECKING:
    from collections.abc import Iterator

# A cancel (on the loop) against a request's end (on any thread); rare and short, so one
# lock serves every pool.
_LOCK = threading.Lock()


class FlagPool:
    """The cancellation bytes of one worker, reused as requests end."""

    def __init__(self, arena: Arena) -> None:
        self.arena = arena
        self._free: list[int] = []
        # A restarted worker starts over; a flag of the old one's must not write then.
        self.generation = 0

    def reset(self) -> None:
        with _LOCK:
            self.generation += 1
            self._free.clear()
            self.arena.reset()

    def take(self, request: BackendRequest) -> CancelFlag:
        with _LOCK:
            if self._free:
                offset = self._free.pop()
                self.arena.set_flag(offset, on=False)
            else:
                offset = self.arena.zero_flags(1)
            flag = CancelFlag(self, offset, self.generation)
        add = getattr(request, "add_cancel_callback", None)  # a Job's client can go
        if add is not None:
            add(flag.set)
        return flag

    def give_back(self, flag: CancelFlag) -> None:
        """Under ``_LOCK``: the worker no longer reads ``flag``'s byte (a restarted worker's
        pool has started over without it)."""
        if flag.generation == self.generation:
            self._free.append(flag.offset)


class CancelFlag:
    __slots__ = ("generation", "live", "offset", "pool")

    def __init__(self, pool: FlagPool, offset: int, generation: int) -> None:
        self.pool = pool
        self.offset = offset
        self.generation = generation
        self.live = True

    def set(self) -> None:
        with _LOCK:
            if self.live and self.generation == self.pool.generation:
                self.pool.arena.set_flag(self.offset)

    def end(self) -> None:
        """The worker no longer reads this byte: it may serve another request."""
        with _LOCK:
            if self.live:
                self.live = False
                self.pool.give_back(self)


@dataclass(slots=True)
class OpenStream:
    """A decoupled request the worker may still send responses for."""

    request: BackendRequest
    flag: CancelFlag
    detached: bool = False  # its execute returned before its FINAL flag


@dataclass(slots=True)
class BatchWatch:
    """One batch's requests while the worker has them (``end()`` when the batch ends)."""

    flags: list[CancelFlag]
    keys: list[int]  # each request's stream key (-1: not streamed)
    streams: dict[int, OpenStream] = field(repr=False)

    @classmethod
    def start(
        cls,
        pool: FlagPool,
        requests: Sequence[BackendRequest],
        streams: dict[int, OpenStream] | None,
        keys: Iterator[int],
    ) -> BatchWatch:
        """``streams``: the backend's open streams (a decoupled model), where each request
        with a sink is registered under a new key from ``keys``."""
        flags = [pool.take(r) for r in requests]
        if streams is None:
            return cls(flags, [], {})
        ids = []
        for request, flag in zip(requests, flags, strict=True):
            if request.sink is None:  # a warm-up: nobody listens
                ids.append(-1)
                continue
            key = next(keys)
            streams[key] = OpenStream(request, flag)
            ids.append(key)
        return cls(flags, ids, streams)

    def detach_open(self, rescheduled: list[int] | None = None) -> None:
        """The batch's execute returned: requests without their FINAL flag stay open, and
        their streams end with it rather than with the batch. A ``rescheduled`` one (by
        index) ends with the batch: its next run is another batch's, with a key and a
        byte of its own."""
        skip = set(rescheduled or ())
        for index, key in enumerate(self.keys):
            if index in skip:
                continue
            entry = self.streams.get(key)
            if entry is not None and not entry.detached:
                entry.detached = True
                assert entry.request.sink is not None
                entry.request.sink.detach()

    def end(self) -> None:
        """The batch is over: its requests leave the worker, but for those detached."""
        keys = self.keys or [-1] * len(self.flags)  # -1: never a stream's key
        for key, flag in zip(keys, self.flags, strict=True):
            entry = self.streams.get(key)
            if entry is not None and entry.detached:
                continue  # it ends with its FINAL flag (``PythonBackend._stream``)
            self.streams.pop(key, None)
            flag.end()
