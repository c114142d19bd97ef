"""The ``local`` response cache: an LRU of output lists within a byte budget, in this
process (Triton's ``--cache-config local,size=BYTES``)."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any, ClassVar

import numpy as np

from kiln.cache import Cached
from kiln.core.types import InferOutput


@dataclass(frozen=True, slots=True)
class _Entry:
    outputs: tuple[InferOutput, ...]
    nbytes: int
    owner: int  # the loaded model version that produced it (see ``drop_owner``)
    parameters: dict[str, Any] | None = None  # the response's own (a Python model's)


class ResponseCache:
    """Thread-safe LRU of output lists; ``capacity`` bounds the bytes of cached outputs.
    The ``local`` cache: one per server, in its memory."""

    shared: ClassVar[bool] = False

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._lock = threading.Lock()
        self._entries: OrderedDict[bytes, _Entry] = OrderedDict()
        self._nbytes = 0

    async def open(self) -> None:
        return None

    async def close(self) -> None:
        self.clear()

    async def get(self, key: bytes) -> Cached | None:
        return self.lookup_response(key)

    async def put(
        self,
        key: bytes,
        outputs: Sequence[InferOutput],
        owner: int,
        parameters: dict[str, Any] | None,
    ) -> bool:
        return self.insert(key, outputs, owner, parameters)

    @property
    def nbytes(self) -> int:
        with self._lock:
            return self._nbytes

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def __contains__(self, key: bytes) -> bool:
        with self._lock:
            return key in self._entries

    def lookup(self, key: bytes) -> list[InferOutput] | None:
        """The cached outputs (fresh wrappers around read-only arrays), or None."""
        found = self.lookup_response(key)
        return None if found is None else found[0]

    def lookup_response(self, key: bytes) -> Cached | None:
        """The cached outputs and the response's parameters (copies), or None."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                return None
            self._entries.move_to_end(key)
        # New InferOutput objects: a caller may replace fields without touching the entry.
        outputs = [replace(o, parameters=dict(o.parameters)) for o in entry.outputs]
        return outputs, dict(entry.parameters or {})

    def insert(
        self,
        key: bytes,
        outputs: Iterable[InferOutput],
        owner: int = 0,
        parameters: dict[str, Any] | None = None,
    ) -> bool:
        """Cache ``outputs`` under ``key``, evicting the least recently used entries to fit.

        Returns False (and caches nothing) when the outputs alone exceed the whole budget.
        """
        # Own copies: the scheduler's outputs may be views into a larger batch array that
        # would otherwise stay alive (and uncounted) behind a small entry.
        frozen = tuple(_frozen(o) for o in outputs)
        nbytes = sum(_nbytes(o.data) for o in frozen)
        if nbytes > self.capacity:
            return False
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self._nbytes -= old.nbytes
            while self._entries and self._nbytes + nbytes > self.capacity:
                _, evicted = self._entries.popitem(last=False)
                self._nbytes -= evicted.nbytes
            self._entries[key] = _Entry(frozen, nbytes, owner, dict(parameters or {}) or None)
            self._nbytes += nbytes
        return True

    def drop_owner(self, owner: int) -> int:
        """Forget what one loaded model version cached (it is unloading); returns how many.

        A reload of the same version may serve a different model file, so its answers
        must not outlive it.
        """
        with self._lock:
            gone = [k for k, e in self._entries.items() if e.owner == owner]
            for key in gone:
                self._nbytes -= self._entries.pop(key).nbytes
            return len(gone)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._nbytes = 0


def _frozen(output: InferOutput) -> InferOutput:
    data = np.array(output.data, copy=True)
    data.flags.writeable = False  # shared by every later hit: nobody may write into it
    return replace(output, data=data, parameters=dict(output.parameters))


def _nbytes(data: np.ndarray) -> int:
    if data.dtype.kind == "O":
        # Object arrays hold pointers; the payload is the bytes objects themselves.
        return data.nbytes + sum(len(v) if isinstance(v, bytes) else 0 for v in data.ravel())
    return int(data.nbytes)
