"""System shared memory regions (Triton's ``system_shared_memory`` extension).

A client creates a POSIX shared memory object (``shm_open(key)``, i.e. ``/dev/shm/<key>``),
registers a window of it (``offset``, ``byte_size``) under a region name, and then names
the region instead of sending tensor bytes. Every read and write is checked against the
registered window, so a request can never touch memory outside it.

The server opens the object with its own rights on behalf of a client it cannot identify,
so only plain objects of its own user are accepted (no symlink, FIFO, directory or hard
link; see ``_open``), and they are read with ``pread``/``pwrite`` rather than mapped: a
client that truncates its object gets a 400, not a SIGBUS that kills the server, and a
region costs one descriptor, not one mapping.
"""

from __future__ import annotations

import os
import stat
import threading
from dataclasses import dataclass, field
from pathlib import Path

from kiln.core.errors import KilnError, Status, invalid_arg, not_found

SHM_ROOT = Path("/dev/shm")
#: ``--max-shm-regions``' default: each region holds one descriptor.
MAX_REGIONS = 1024
#: characters of a region name (one object may be registered under many names)
MAX_REGION_NAME = 256

# O_NOFOLLOW: a symlink in /dev/shm must not lead the server to a file of its choosing.
# O_NONBLOCK: opening a FIFO must not wait for a writer (it is refused right after).
_OPEN_FLAGS = os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOCTTY


@dataclass(slots=True)
class Region:
    name: str
    key: str
    offset: int
    byte_size: int
    fd: int  # read and written with pread/pwrite: no mapping, so no SIGBUS on truncation
    in_use: int = 0

    def to_json(self) -> dict[str, object]:
        return {"name": self.name, "key": self.key, "offset": self.offset,
                "byte_size": self.byte_size}  # fmt: skip


@dataclass
class SharedMemoryManager:
    root: Path = SHM_ROOT
    max_regions: int = MAX_REGIONS  # --max-shm-regions
    # --allow-shm-other-owners: objects of other users too (the server reads and writes
    # them with its own rights, so only for a server that trusts every local user).
    allow_other_owners: bool = False
    regions: dict[str, Region] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def register(self, name: str, key: str, offset: int, byte_size: int) -> None:
        if not name:
            raise invalid_arg("a shared memory region needs a name")
        if len(name) > MAX_REGION_NAME:  # kept for the region's life, up to max_regions
            raise invalid_arg(
                f"a shared memory region name is 1 to {MAX_REGION_NAME} characters, got {len(name)}"
            )
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
            if len(self.regions) >= self.max_regions:
                raise invalid_arg(
                    f"unable to register shared memory region '{name}': the server holds "
                    f"{len(self.regions)} regions, its limit (--max-shm-regions); "
                    "unregister one first"
                )
            fd = self._open(name, key, path)
            try:
                size = os.fstat(fd).st_size
                if offset + byte_size > size or byte_size == 0:
                    # The object's size is not told: a client learns nothing it could
                    # not learn by opening the object itself.
                    raise invalid_arg(
                        f"shared memory region '{name}': offset {offset} + byte_size "
                        f"{byte_size} does not fit the object '{key}'"
                    )
            except BaseException:
                os.close(fd)
                raise
            self.regions[name] = Region(name, key, offset, byte_size, fd)

    def _open(self, name: str, key: str, path: Path) -> int:
        """A descriptor of the object ``path``, which must be a plain shared memory object
        the server may hand to this client. One message for every refusal, so that a
        client cannot tell a missing object from a forbidden one."""
        owner = "" if self.allow_other_owners else ", owned by the server's user"
        refused = invalid_arg(
            f"unable to open shared memory region '{name}': key '{key}' does not name a "
            f"shared memory object this server may use (one in {self.root}, a regular file "
            f"with one link{owner})"
        )
        try:
            fd = os.open(path, _OPEN_FLAGS)
        except OSError:
            raise refused from None
        try:
            st = os.fstat(fd)
            ok = (
                stat.S_ISREG(st.st_mode)
                and st.st_dev == os.stat(self.root).st_dev  # not a file bind-mounted in
                and st.st_nlink == 1  # not a hard link to a file elsewhere on tmpfs
                and (self.allow_other_owners or st.st_uid == os.geteuid())
            )
        except OSError:
            ok = False
        if not ok:
            os.close(fd)
            raise refused
        return fd

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
                os.close(region.fd)

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
            # One pread into a fresh buffer: an object truncated since it was registered
            # reads short (a 400) where a mapping would have raised SIGBUS.
            data = os.pread(region.fd, size, start)
            if len(data) < size:
                data = self._read_rest(region, data, size, start, tensor)
            return data

    @staticmethod
    def _read_rest(region: Region, head: bytes, size: int, start: int, tensor: str) -> bytes:
        parts, got = [head], len(head)
        while got < size:
            chunk = os.pread(region.fd, size - got, start + got)
            if not chunk:
                raise invalid_arg(
                    f"tensor '{tensor}': shared memory region '{region.name}' holds fewer "
                    f"than {region.offset + region.byte_size} bytes now (its object was "
                    "truncated after registration)"
                )
            parts.append(chunk)
            got += len(chunk)
        return b"".join(parts)

    def write(self, name: str, offset: int, data: bytes, capacity: int, tensor: str) -> None:
        with self._lock:
            region = self._window(name, offset, capacity, tensor)
            if len(data) > capacity:
                raise invalid_arg(
                    f"output '{tensor}': {len(data)} bytes do not fit the "
                    f"{capacity}-byte window of shared memory region '{name}'"
                )
            start = region.offset + offset
            # pwrite past the end would grow a truncated object instead of failing.
            if os.fstat(region.fd).st_size < start + len(data):
                raise invalid_arg(
                    f"output '{tensor}': shared memory region '{name}' holds fewer than "
                    f"{start + len(data)} bytes now (its object was truncated after "
                    "registration)"
                )
            done = os.pwrite(region.fd, data, start)
            if done < len(data):  # a partial write: rare, so the view only then
                view = memoryview(data).cast("B")
                while done < len(view):
                    done += os.pwrite(region.fd, view[done:], start + done)

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
                os.close(region.fd)
            self.regions.clear()
