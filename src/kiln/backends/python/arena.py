"""A shared-memory arena: tensors cross the process boundary as bytes in a /dev/shm file.

Each direction has its own arena and exactly one writer (the server writes requests and BLS
answers into the *inbound* arena, the worker writes responses and BLS requests into the
*outbound* one), so no locks are needed across processes. Only small headers
``(name, dtype, shape, offset, nbytes)`` travel over the pipe. The writer bumps a cursor
and resets it at the start of each execute; when a tensor does not fit, it grows the file
(``ftruncate`` keeps what was written) and the reader remaps when a header points past the
end of its mapping.

BYTES tensors are written in Triton's serialized form: each element as a 4-byte
little-endian length followed by its bytes (``bytes_tensors.py``).
"""

from __future__ import annotations

import contextlib
import mmap
import os
import sys
import tempfile
from typing import Any

import numpy as np

from kiln.backends.python.bytes_tensors import (
    Serialized,
    deserialize_bytes,
    serialize_bytes,
    serialize_slices,
)
from kiln.core.offloop import ENCODE_SLICE

__all__ = [
    "ALIGN",
    "BYTES",
    "Arena",
    "Header",
    "Serialized",
    "deserialize_bytes",
    "serialize_bytes",
]

ALIGN = 64  # every tensor starts on a cache line
BYTES = "BYTES"
SHM_DIR = "/dev/shm" if os.path.isdir("/dev/shm") else None

# (name, dtype string or "BYTES", shape, offset, nbytes): what the pipe carries per tensor.
Header = tuple[str, str, tuple[int, ...], int, int]


def _mmap(fd: int, size: int) -> mmap.mmap:
    if sys.version_info >= (3, 13):
        return mmap.mmap(fd, size, trackfd=False)  # no duplicate descriptor held
    return mmap.mmap(fd, size)


class Arena:
    """One mapped file; ``write`` places tensors at the cursor, ``read`` gets them back.

    The arena keeps no file descriptor of its own: the file is opened again by its path
    only to grow it or to map more of it. Before Python 3.13 the mapping itself holds a
    duplicate (``mmap``'s ``trackfd``), so a server holds one descriptor per arena, two
    per batch its workers' pipes can hold (16 per instance by default); ``kiln serve``
    raises its soft descriptor limit to the hard one for that (``serve.raise_fd_limit``)."""

    def __init__(self, path: str, owner: bool) -> None:
        self.path = path
        self.owner = owner  # the server creates (and unlinks) both arenas
        self.size = 0
        self._map: mmap.mmap | None = None
        self.cursor = 0
        self._remap(os.stat(path).st_size)

    @classmethod
    def create(cls, prefix: str, size: int = 1 << 20, directory: str | None = SHM_DIR) -> Arena:
        """``directory``: the worker's private folder (``process.private_shm_dir``), where
        no client's shared memory key can name the arena."""
        fd, path = tempfile.mkstemp(prefix=prefix, dir=directory)
        try:
            os.ftruncate(fd, size)
        finally:
            os.close(fd)
        return cls(path, owner=True)

    @classmethod
    def attach(cls, path: str) -> Arena:
        return cls(path, owner=False)

    # ---- mapping ---------------------------------------------------------------------
    def _remap(self, size: int, grow: bool = False) -> None:
        """Map ``size`` bytes of the file (``grow``: making the file that large first)."""
        old = self._map
        fd = os.open(self.path, os.O_RDWR)
        try:
            if grow:
                os.ftruncate(fd, size)  # keeps what was written
            self._map = _mmap(fd, size) if size else None
        finally:
            os.close(fd)
        self.size = size
        if old is not None:
            # Arrays may still view it: then it goes away with the last of them.
            with contextlib.suppress(BufferError):
                old.close()

    def _reserve(self, nbytes: int) -> int:
        """Room for ``nbytes`` at the cursor, growing the file if needed; its offset."""
        offset = -(-self.cursor // ALIGN) * ALIGN
        end = offset + nbytes
        if end > self.size:
            new_size = max(self.size * 2, 1 << 16)
            while new_size < end:
                new_size *= 2
            self._remap(new_size, grow=True)
        self.cursor = end
        return offset

    def _ensure_mapped(self, end: int) -> None:
        if end > self.size:  # the other side grew the file since we mapped it
            self._remap(os.stat(self.path).st_size)

    def reset(self) -> None:
        self.cursor = 0

    # ---- tensors ---------------------------------------------------------------------
    def write(self, name: str, array: Any) -> Header:
        array = np.asarray(array)
        if array.dtype.kind in ("O", "S", "U"):
            if array.size > ENCODE_SLICE:  # a join a slice, no single one over it all
                return self._write_chunks(name, serialize_slices(array))
            data = serialize_bytes(array)
            offset = self._reserve(len(data))
            assert self._map is not None
            self._map[offset : offset + len(data)] = data
            return (name, BYTES, tuple(array.shape), offset, len(data))
        nbytes = array.nbytes
        offset = self._reserve(nbytes)
        if nbytes:
            assert self._map is not None
            if not (array.flags.c_contiguous and self._copy_bytes(offset, array)):
                target = np.ndarray(array.shape, array.dtype, buffer=self._map, offset=offset)
                np.copyto(target, array)
                del target  # no export left behind to block a later remap
        return (name, array.dtype.str, tuple(array.shape), offset, nbytes)

    def _write_chunks(self, name: str, tensor: Serialized) -> Header:
        offset = self._reserve(tensor.nbytes)
        at = offset
        for chunk in tensor.chunks:
            assert self._map is not None
            self._map[at : at + len(chunk)] = chunk
            at += len(chunk)
        return (name, BYTES, tensor.shape, offset, tensor.nbytes)

    def _copy_bytes(self, offset: int, array: np.ndarray) -> bool:
        """A C-contiguous array's bytes at ``offset`` in one copy, without building an array
        over the map (a third of the time for a small tensor); False for a dtype that
        exports no buffer."""
        assert self._map is not None
        try:
            view = array.data.cast("B")
        except (ValueError, TypeError):
            return False
        self._map[offset : offset + len(view)] = view
        return True

    def read(self, header: Header, copy: bool = True) -> np.ndarray:
        """The tensor a header describes; ``copy=False`` views the arena (valid until reset)."""
        _, dtype, shape, offset, nbytes = header
        self._ensure_mapped(offset + nbytes)
        if dtype == BYTES:
            assert self._map is not None
            return deserialize_bytes(memoryview(self._map)[offset : offset + nbytes], shape)
        if nbytes == 0 or self._map is None:
            return np.zeros(shape, dtype=np.dtype(dtype))
        view = np.ndarray(shape, np.dtype(dtype), buffer=self._map, offset=offset)
        return view.copy() if copy else view

    def raw(self, header: Header) -> bytes:
        """A tensor's bytes as they lie in the arena, copied out (one copy): a BYTES
        tensor's serialized form, to decode later, e.g. on another thread."""
        _, _, _, offset, nbytes = header
        self._ensure_mapped(offset + nbytes)
        if nbytes == 0 or self._map is None:
            return b""
        return self._map[offset : offset + nbytes]

    # ---- one-byte flags (request cancellation) ---------------------------------------
    def zero_flags(self, count: int) -> int:
        """``count`` bytes set to 0 at the cursor; their offset."""
        offset = self._reserve(count)
        if count:
            assert self._map is not None
            self._map[offset : offset + count] = bytes(count)
        return offset

    def set_flag(self, offset: int, on: bool = True) -> None:
        """Set the byte at ``offset`` (from ``zero_flags``) to 1 (``on``) or back to 0."""
        self._ensure_mapped(offset + 1)
        assert self._map is not None
        self._map[offset] = int(on)

    def flag(self, offset: int) -> bool:
        self._ensure_mapped(offset + 1)
        return self._map is not None and self._map[offset] != 0

    def close(self) -> None:
        if self._map is not None:
            with contextlib.suppress(BufferError):
                self._map.close()
            self._map = None
        if self.owner:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)
