"""pb_utils' ``Tensor`` and its data types: Triton's type names and numbers as NumPy types,
and the BYTES (length-prefixed) encoding (re-exported by ``pb_utils``). Tensors are plain
NumPy arrays (kiln's Python backend runs on the CPU), exchanged with torch and others through
DLPack (``dlpack.py``).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kiln.backends.python import dlpack
from kiln.backends.python.arena import serialize_bytes
from kiln.backends.python.pb_errors import TritonModelException

__all__ = [
    "TRITON_STRING_TO_NUMPY",
    "TYPE_BYTES",
    "Tensor",
    "deserialize_bytes_tensor",
    "numpy_to_triton_type",
    "serialize_byte_tensor",
    "triton_string_to_numpy",
    "triton_to_numpy_type",
]

_NUMPY_TYPES: dict[str, Any] = {
    "TYPE_BOOL": np.bool_,
    "TYPE_UINT8": np.uint8,
    "TYPE_UINT16": np.uint16,
    "TYPE_UINT32": np.uint32,
    "TYPE_UINT64": np.uint64,
    "TYPE_INT8": np.int8,
    "TYPE_INT16": np.int16,
    "TYPE_INT32": np.int32,
    "TYPE_INT64": np.int64,
    "TYPE_FP16": np.float16,
    "TYPE_FP32": np.float32,
    "TYPE_FP64": np.float64,
    "TYPE_STRING": np.object_,
    "TYPE_BF16": np.float32,  # held as float32, as everywhere in kiln
}
TRITON_STRING_TO_NUMPY = _NUMPY_TYPES  # Triton's name for it; models read it directly

# TRITONSERVER_DataType's numbers (Tensor.triton_dtype(), triton_to_numpy_type), BOOL..BYTES
_TRITON_NUMBERS: dict[int, Any] = {
    1: np.bool_,
    2: np.uint8,
    3: np.uint16,
    4: np.uint32,
    5: np.uint64,
    6: np.int8,
    7: np.int16,
    8: np.int32,
    9: np.int64,
    10: np.float16,
    11: np.float32,
    12: np.float64,
    13: np.object_,
}
_NUMBERS_OF: dict[Any, int] = {np.dtype(t): n for n, t in _TRITON_NUMBERS.items()}
TYPE_BYTES = 13


class Tensor:
    __module__ = "kiln.backends.python.pb_utils"  # pb_utils' API, where it was defined

    def __init__(self, name: str, array: Any) -> None:
        if not isinstance(array, np.ndarray):
            raise TritonModelException(
                f"Tensor '{name}': expected a numpy array, got {type(array).__name__}"
            )
        self._name = name
        self._array = array

    def name(self) -> str:
        return self._name

    def as_numpy(self) -> np.ndarray:
        return self._array

    def shape(self) -> list[int]:
        return list(self._array.shape)

    def triton_dtype(self) -> int | None:
        """The tensor's TRITONSERVER_DataType number (11 for FP32, 13 for BYTES)."""
        return numpy_to_triton_type(self._array.dtype)

    def is_cpu(self) -> bool:
        return True

    # ---- DLPack (dlpack.py): tensors to and from torch etc. without copies ----
    def to_dlpack(self) -> Any:
        """A DLPack capsule of the tensor's data, e.g. for
        ``torch.utils.dlpack.from_dlpack``: an input's capsule views the shared memory."""
        try:
            return dlpack.capsule_of(self._array)
        except dlpack.DLPackError as exc:
            raise TritonModelException(f"Tensor '{self._name}': to_dlpack: {exc}") from None

    @classmethod
    def from_dlpack(cls, name: str, capsule: Any) -> Tensor:
        """A tensor named ``name`` from a DLPack capsule or an object with ``__dlpack__``
        (a torch tensor, a NumPy array...): a view of host memory, a copy of GPU memory."""
        if not isinstance(name, str):
            raise TritonModelException(
                f"Tensor.from_dlpack takes the tensor's name first, got {type(name).__name__}"
            )
        try:
            return cls(name, dlpack.to_numpy(capsule))
        except dlpack.DLPackError as exc:
            raise TritonModelException(f"Tensor '{name}': from_dlpack: {exc}") from None

    def __dlpack__(self, **kwargs: Any) -> Any:
        """The DLPack protocol: ``torch.from_dlpack(tensor)`` takes a pb_utils.Tensor."""
        try:
            return dlpack.capsule_of(self._array, **kwargs)
        except dlpack.DLPackError as exc:
            raise BufferError(f"Tensor '{self._name}': {exc}") from None

    def __dlpack_device__(self) -> tuple[int, int]:
        return (dlpack.DL_CPU, 0)

    def __repr__(self) -> str:
        return f"Tensor({self._name!r}, shape={self._array.shape}, dtype={self._array.dtype})"


def triton_string_to_numpy(triton_type: str) -> Any:
    try:
        return _NUMPY_TYPES[triton_type]
    except KeyError:
        raise TritonModelException(f"unknown data type '{triton_type}'") from None


def triton_to_numpy_type(data_type: int) -> Any:
    """The NumPy type of a TRITONSERVER_DataType number; None for one without (BF16)."""
    return _TRITON_NUMBERS.get(data_type)


def numpy_to_triton_type(data_type: Any) -> int | None:
    """The TRITONSERVER_DataType number of a NumPy dtype or type; None if it has none."""
    try:
        dtype = np.dtype(data_type)
    except TypeError:
        return None
    if dtype.kind in ("S", "U"):
        return TYPE_BYTES
    return _NUMBERS_OF.get(dtype)


def serialize_byte_tensor(array: np.ndarray) -> np.ndarray:
    """Triton's length-prefixed BYTES serialization, as a uint8 array."""
    return np.frombuffer(serialize_bytes(array), dtype=np.uint8)


def deserialize_bytes_tensor(encoded: bytes | np.ndarray) -> np.ndarray:
    raw = encoded.tobytes() if isinstance(encoded, np.ndarray) else bytes(encoded)
    items, pos = [], 0
    while pos < len(raw):
        length = int.from_bytes(raw[pos : pos + 4], "little")
        items.append(raw[pos + 4 : pos + 4 + length])
        pos += 4 + length
    out = np.empty(len(items), dtype=object)
    out[:] = items
    return out
