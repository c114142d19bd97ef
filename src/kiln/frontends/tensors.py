"""Element encodings shared by the HTTP binary extension and gRPC raw contents."""

from __future__ import annotations

import struct

import numpy as np

from kiln.core.errors import invalid_arg
from kiln.core.offloop import OFF_LOOP_ENCODE_ELEMENTS as OFF_LOOP_ENCODE_ELEMENTS
from kiln.core.types import DataType, element_count

_LEN = struct.Struct("<I")
# Requests larger than this (HTTP bodies, gRPC messages) decode off the event loop: JSON
# values, typed gRPC contents and BYTES elements cost Python work each.
OFF_LOOP_DECODE_BYTES = 1 << 20
# ``OFF_LOOP_ENCODE_ELEMENTS`` (in kiln.core, for the backends too): a response with more
# elements than that which cost Python work each (JSON values, BYTES elements in any
# encoding) is encoded on a worker thread.


def python_elements(datatype: DataType, data: np.ndarray) -> int:
    """The elements of a tensor written raw (binary, gRPC raw contents, shared memory)
    that cost Python work each: a BYTES tensor's; other types are one copy."""
    return int(data.size) if datatype is DataType.BYTES else 0


def serialize_bytes(data: np.ndarray) -> bytes:
    """BYTES tensor -> 4-byte little-endian length + bytes per element."""
    parts = []
    for v in data.ravel():
        b = v if isinstance(v, bytes) else str(v).encode()
        parts.append(_LEN.pack(len(b)))
        parts.append(b)
    return b"".join(parts)


def deserialize_bytes(name: str, buf: memoryview | bytes, count: int) -> np.ndarray:
    """The inverse of :func:`serialize_bytes`; every length is checked against the buffer."""
    view = memoryview(buf)
    pos, end = 0, len(view)
    # Each element needs its 4-byte length: when the buffer cannot hold ``count`` of them,
    # nothing is sized by the client's shape (np.empty(2**31) is 16 GiB of pointers) and
    # the walk below, which then must fail within end // 4 steps, only finds the error.
    out = np.empty(count, dtype=object) if count <= end // 4 else None
    for i in range(count):
        if pos + 4 > end:
            raise invalid_arg(f"input '{name}': BYTES data ends after {i} of {count} elements")
        (length,) = _LEN.unpack_from(view, pos)
        pos += 4
        if pos + length > end:
            raise invalid_arg(
                f"input '{name}': BYTES element {i} has length {length}, which runs past the "
                f"end of its buffer ({end - pos} bytes left)"
            )
        if out is not None:
            out[i] = bytes(view[pos : pos + length])
        pos += length
    if pos != end:
        raise invalid_arg(
            f"input '{name}': {end - pos} bytes left over after {count} BYTES elements"
        )
    assert out is not None  # count <= end // 4 whenever the walk gets here
    return out


def bf16_to_fp32(raw: np.ndarray) -> np.ndarray:
    """BF16 is the high half of a float32."""
    return (raw.astype(np.uint32) << 16).view(np.float32)


def fp32_to_bf16(data: np.ndarray) -> np.ndarray:
    """Truncate float32 to its high 16 bits (what tritonclient's serializer does)."""
    bits = np.ascontiguousarray(data, dtype=np.float32).view(np.uint32)
    return (bits >> 16).astype("<u2")


def from_binary(
    name: str,
    datatype: DataType,
    shape: tuple[int, ...],
    buf: memoryview | bytes,
    source: str = "binary data",
) -> np.ndarray:
    """Decode one tensor's little-endian bytes; ``source`` names them in errors."""
    count = element_count(shape)
    if datatype is DataType.BYTES:
        return deserialize_bytes(name, buf, count).reshape(shape)
    expected = count * datatype.itemsize
    if len(buf) != expected:
        raise invalid_arg(
            f"input '{name}': {len(buf)} bytes of {source}, but shape {list(shape)} of "
            f"{datatype.value} needs {expected}"
        )
    if datatype is DataType.BF16:
        return bf16_to_fp32(np.frombuffer(buf, dtype="<u2")).reshape(shape)
    return np.frombuffer(buf, dtype=datatype.numpy_dtype.newbyteorder("<")).reshape(shape)


def to_binary(datatype: DataType, data: np.ndarray) -> bytes:
    if datatype is DataType.BYTES:
        return serialize_bytes(data)
    if datatype is DataType.BF16:
        return fp32_to_bf16(data).tobytes()
    return np.ascontiguousarray(data, dtype=datatype.numpy_dtype.newbyteorder("<")).tobytes()
