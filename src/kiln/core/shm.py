"""System shared memory regions (Triton's ``system_shared_memory`` extension).

A client creates a POSIX shared memory object (``shm_open(key)``, i.e. ``/dev/shm/<key>``),
registers a window of it (``offset``, ``byte_size``) under a region name, and then names
the region instead of sending tensor bytes. Every read and write is checked against the
registered window, so a request can never touch memory outside it.
"""

from __future__ import annotations

import mmap
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path

from kiln.core.errors import KilnError, Status, invalid_arg, not_found

SHM_ROOT = Path("/dev/shm")


@dataclass(slots=True)
class Region:
    name: str
    key: str
    offset: int
    byte_size: int
    buffer: mmap.mmap
    in_use: int = 0

    def to_json(self) -> dict[str, object]:
        return {"name": self.name, "key": self.key, "offset": self.offset,
                "byte_size": self.byte_size}  # fmt: skip


@dataclass
class SharedMemoryManager:
    root: Path = SHM_ROOT
    regions: dict[str, Region] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def register(self, name: str, key: str, offset: int, byte_size: int) -> None:
        if not name:
            raise invalid_arg("a shared memory region needs a name")
        for what, value in (("offset", offset), ("byte_size", byte_size)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise invalid_arg(
                    f"shared memory region '{name}': '{what}' must be an integer >= 0"
                )
        path = self._path(name, key)
        with self._lock:
            if name in self.regions:
                raise KilnError(
                    f"shared memory region '{name}' already in manager", Status.ALREADY_EXISTS
                )
            try:
                fd = os.open(path, os.O_RDWR)
            except OSError as exc:
                raise invalid_arg(
                    f"unable to open shared memory region '{name}' (key '{key}'): {exc.strerror}"
                ) from None
            try:
                size = os.fstat(fd).st_size
                if offset + byte_size > size or byte_size == 0:
                    raise invalid_arg(
                        f"shared memory region '{name}': offset {offset} + byte_size "
                        f"{byte_size} does not fit the {size}-byte object '{key}'"
                    )
                buffer = mmap.mmap(fd, size)
            finally:
                os.close(fd)
            self.regions[name] = Region(name, key, offset, byte_size, buffer)

    def _path(self, name: str, key: str) -> Path:
        stem = key[1:] if key.startswith("/") else key
        if not stem or "/" in stem or stem in (".", "..") or "\x00" in stem:
            raise invalid_arg(f"shared memory region '{name}': invalid key '{key}'")
        return self.root / stem

    def unregister(self, name: str = "") -> None:
        """Unregister one region, or every region when ``name`` is empty."""
        with self._lock:
            names = [name] if name else list(self.regions)
            for n in names:
                region = self.regions.get(n)
                if region is None:
                    continue  # Triton: unregistering an unknown region is not an error
                if region.in_use:
                    raise invalid_arg(
                        f"shared memory region '{n}' is in use by {region.in_use} "
                        "in-flight request(s); unregister it after they complete"
                    )
                del self.regions[n]
                region.buffer.close()

    def status(self, name: str = "") -> list[dict[str, object]]:
        with self._lock:
            if name:
                if name not in self.regions:
                    raise not_found(f"Unable to find system shared memory region: '{name}'")
                return [self.regions[name].to_json()]
            return [r.to_json() for r in self.regions.values()]

    def _window(self, name: str, offset: int, size: int, tensor: str) -> Region:
        region = self.regions.get(name)
        if region is None:
            raise invalid_arg(
                f"tensor '{tensor}': unable to find system shared memory region '{name}'"
            )
        if offset < 0 or size < 0 or offset + size > region.byte_size:
            raise invalid_arg(
                f"tensor '{tensor}': shared memory offset {offset} + byte size {size} is "
                f"outside region '{name}' of {region.byte_size} bytes"
            )
        return region

    def check(self, name: str, offset: int, size: int, tensor: str) -> None:
        """Refuse a window outside its region before any work is done for the request."""
        with self._lock:
            self._window(name, offset, size, tensor)

    def read(self, name: str, offset: int, size: int, tensor: str) -> bytes:
        with self._lock:
            region = self._window(name, offset, size, tensor)
            start = region.offset + offset
            return region.buffer[start : start + size]

    def write(self, name: str, offset: int, data: bytes, capacity: int, tensor: str) -> None:
        with self._lock:
            region = self._window(name, offset, capacity, tensor)
            if len(data) > capacity:
                raise invalid_arg(
                    f"output '{tensor}': {len(data)} bytes do not fit the "
                    f"{capacity}-byte window of shared memory region '{name}'"
                )
            start = region.offset + offset
            region.buffer[start : start + len(data)] = data

    def acquire(self, names: list[str]) -> None:
        """Mark regions in use by a request (so they cannot be unregistered under it)."""
        with self._lock:
            for n in names:
                if n in self.regions:
                    self.regions[n].in_use += 1

    def release(self, names: list[str]) -> None:
        with self._lock:
            for n in names:
                if n in self.regions:
                    self.regions[n].in_use -= 1

    def close(self) -> None:
        with self._lock:
            for region in self.regions.values():
                region.buffer.close()
            self.regions.clear()
