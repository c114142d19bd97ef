"""BYTES tensors in the arena's serialized form, a slice at a time when large
(``bytes_tensors.py``): the same bytes and arrays as one pass, whatever the slice."""

from __future__ import annotations

import struct

import numpy as np
import pytest

from kiln.backends.python.arena import Arena
from kiln.backends.python.bytes_tensors import (
    deserialize_bytes,
    serialize_bytes,
    serialize_slices,
)
from kiln.core.offloop import ENCODE_SLICE


def _triton(values: list[bytes]) -> bytes:
    """Triton's form, written out by hand: a 4-byte little-endian length, then the bytes."""
    return b"".join(struct.pack("<I", len(v)) + v for v in values)


def _values(count: int) -> list[bytes]:
    rng = np.random.default_rng(count)
    return [rng.bytes(int(n)) for n in rng.integers(0, 12, count)]


@pytest.mark.parametrize("count", [0, 1, 7, 1000])
@pytest.mark.parametrize("slice_elements", [1, 3, 64, ENCODE_SLICE])
def test_slices_give_the_bytes_and_arrays_of_one_pass(count: int, slice_elements: int) -> None:
    values = _values(count)
    array = np.empty(count, dtype=object)
    array[:] = values
    serialized = serialize_slices(array, slice_elements)
    assert b"".join(serialized.chunks) == serialize_bytes(array) == _triton(values)
    assert serialized.nbytes == len(_triton(values)) and serialized.shape == (count,)
    assert len(serialized.chunks) == -(-count // slice_elements)  # a join per slice
    for buffer in (_triton(values), memoryview(_triton(values))):
        out = deserialize_bytes(buffer, (count,), slice_elements)
        assert out.dtype == object and out.shape == (count,)
        assert [type(v) for v in out] == [bytes] * count and list(out) == values


def test_strings_and_views_serialize_like_one_pass() -> None:
    grid = np.array([["a", "bé"], ["", "ccc"]], dtype=object).T  # not C-contiguous
    chunks = serialize_slices(grid, 1).chunks
    assert b"".join(chunks) == _triton([b"a", b"", "bé".encode(), b"ccc"])
    assert deserialize_bytes(b"".join(chunks), (2, 2), 1)[1, 0] == "bé".encode()


@pytest.mark.parametrize("slice_elements", [1, ENCODE_SLICE])
def test_a_length_past_the_end_is_refused(slice_elements: int) -> None:
    with pytest.raises(ValueError, match="element 1 runs past the end of its 10-byte buffer"):
        deserialize_bytes(b"\x01\x00\x00\x00a\x09\x00\x00\x00b", (2,), slice_elements)
    with pytest.raises(ValueError, match="needs at least 40 bytes"):
        deserialize_bytes(b"\x00" * 8, (10,), slice_elements)  # before anything is sized


def test_a_large_tensor_crosses_an_arena_unchanged() -> None:
    values = _values(ENCODE_SLICE * 2 + 5)
    array = np.empty(len(values), dtype=object)
    array[:] = values
    arena = Arena.create("kiln-test-bytes-", size=1 << 16)
    try:
        header = arena.write("S", array)  # written a slice at a time, growing the file
        assert header[1] == "BYTES" and header[4] == len(_triton(values))
        assert arena.raw(header) == _triton(values)
        assert list(arena.read(header)) == values
    finally:
        arena.close()
