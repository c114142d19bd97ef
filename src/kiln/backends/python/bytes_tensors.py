"""BYTES tensors in Triton's serialized form (each element a 4-byte little-endian length,
then its bytes), as they cross the shared-memory arenas, a slice at a time when large.

Each element costs Python work: 16 M of them took ~6 s each way. The server does it on a
worker thread above ``OFF_LOOP_ENCODE_ELEMENTS`` elements a batch (``loopcall.py``), and
there no single C call may hold the GIL for the whole tensor (a ``bytes.join`` of 32 M
parts, an ``np.empty`` of 16 M objects): the work goes ``ENCODE_SLICE`` elements a call,
in Python loops the interpreter interrupts every switch interval, so the event loop gets
its turns meanwhile. Small tensors keep the one-pass code (the same bytes either way).
"""

from __future__ import annotations

import itertools
import struct
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from kiln.core.offloop import ENCODE_SLICE

_LEN = struct.Struct("<I")


@dataclass(slots=True)
class Serialized:
    """A BYTES tensor already serialized (``serialize_slices``): ``chunks`` joined are its
    arena bytes; the arena copies them in one after another."""

    shape: tuple[int, ...]
    chunks: list[bytes]
    nbytes: int


def _serialize(items: np.ndarray) -> bytes:
    """One pass over a flat array's elements (a str is UTF-8 encoded, anything else goes
    through ``bytes()``)."""
    pack = _LEN.pack
    parts: list[bytes] = []
    append = parts.append
    for item in items:
        if type(item) is bytes:
            data = item
        else:
            data = item.encode("utf-8") if isinstance(item, str) else bytes(item)
        append(pack(len(data)))
        append(data)
    return b"".join(parts)


def serialize_bytes(array: np.ndarray) -> bytes:
    """A BYTES tensor as one ``bytes`` (``pb_utils.serialize_byte_tensor``, small tensors)."""
    return _serialize(array.reshape(-1))


def serialize_slices(array: np.ndarray, slice_elements: int = ENCODE_SLICE) -> Serialized:
    """A BYTES tensor serialized ``slice_elements`` elements a ``bytes.join``, into chunks
    (never joined: the arena takes them one by one)."""
    count = int(array.size)
    # A view; else ``array.flat[a:b]`` copies one slice at a time, not the whole tensor.
    flat = array.reshape(-1) if array.flags.c_contiguous else None
    chunks = []
    for start in range(0, count, slice_elements):
        stop = min(start + slice_elements, count)
        chunks.append(_serialize(flat[start:stop] if flat is not None else array.flat[start:stop]))
    return Serialized(tuple(array.shape), chunks, sum(map(len, chunks)))


def _count(shape: tuple[int, ...], end: int) -> int:
    """The element count of ``shape`` (from the other process), checked against a buffer
    of ``end`` bytes before it sizes anything: each element needs its 4-byte length."""
    count = 1
    for d in shape:
        if d < 0:
            raise ValueError(f"BYTES tensor of shape {list(shape)}: negative dimension")
        count *= d
    if count > end // 4:
        raise ValueError(
            f"BYTES tensor of shape {list(shape)} needs at least {4 * count} bytes, "
            f"the arena holds {end}"
        )
    return count


def deserialize_bytes(
    buffer: memoryview | bytes, shape: tuple[int, ...], slice_elements: int = ENCODE_SLICE
) -> np.ndarray:
    """The inverse of :func:`serialize_bytes`; ``shape`` comes from the other process, so
    it is checked against the buffer before it sizes anything. Over ``slice_elements``
    elements the array is filled by ``np.fromiter`` from lists of that many elements, each
    built by a Python loop: no ``np.empty`` of the whole object array up front (16 M
    objects: one 0.2 s C call)."""
    view = buffer if isinstance(buffer, bytes) else memoryview(buffer)
    end = len(view)
    count = _count(shape, end)
    if count <= slice_elements:
        out = np.empty(count, dtype=object)
        out[:] = next(_slices(view, count, count), []) if count else []
        return out.reshape(shape)
    elements = itertools.chain.from_iterable(_slices(view, count, slice_elements))
    return np.fromiter(elements, dtype=object, count=count).reshape(shape)


def _slices(view: memoryview | bytes, count: int, slice_elements: int) -> Iterator[list[bytes]]:
    """The elements, ``slice_elements`` a list; a length past the end raises."""
    unpack = _LEN.unpack_from
    copy = not isinstance(view, bytes)  # a memoryview's slices are copied out as bytes
    end = len(view)
    pos = 0
    for start in range(0, count, slice_elements):
        items: list[bytes] = []
        append = items.append
        for i in range(start, min(start + slice_elements, count)):
            (length,) = unpack(view, pos)
            pos += 4
            stop = pos + length
            if stop > end:
                raise ValueError(f"BYTES element {i} runs past the end of its {end}-byte buffer")
            append(bytes(view[pos:stop]) if copy else view[pos:stop])  # type: ignore[arg-type]
            pos = stop
        yield items
