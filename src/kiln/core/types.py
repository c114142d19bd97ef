"""Datatypes and tensors shared by every layer.

The protocol datatype strings (``"FP32"``), the config enum names (``"TYPE_FP32"``) and
NumPy dtypes are three spellings of one thing; this module is the only place that maps
between them.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

import numpy as np


class DataType(enum.Enum):
    BOOL = "BOOL"
    UINT8 = "UINT8"
    UINT16 = "UINT16"
    UINT32 = "UINT32"
    UINT64 = "UINT64"
    INT8 = "INT8"
    INT16 = "INT16"
    INT32 = "INT32"
    INT64 = "INT64"
    FP16 = "FP16"
    FP32 = "FP32"
    FP64 = "FP64"
    BYTES = "BYTES"
    BF16 = "BF16"

    @classmethod
    def from_wire(cls, name: str) -> DataType:
        try:
            return cls(name)
        except ValueError:
            raise ValueError(f"unknown datatype '{name}'") from None

    # Members are singletons compared by identity, so identity hashing is exact; Enum's own
    # __hash__ is a Python-level call, and these are dict keys on every request's path.
    __hash__ = object.__hash__

    @classmethod
    def from_config(cls, name: str) -> DataType:
        """``TYPE_FP32`` -> FP32, ``TYPE_STRING`` -> BYTES."""
        if name == "TYPE_STRING":
            return cls.BYTES
        if not name.startswith("TYPE_") or name == "TYPE_INVALID":
            raise ValueError(f"invalid data_type '{name}'")
        return cls(name[5:])

    @property
    def config_name(self) -> str:
        return "TYPE_STRING" if self is DataType.BYTES else f"TYPE_{self.value}"

    @property
    def itemsize(self) -> int:
        """Bytes per element in the binary wire format (0 = variable, BYTES)."""
        return _ITEMSIZE[self]

    @property
    def numpy_dtype(self) -> np.dtype[Any]:
        """NumPy dtype used to hold this type in memory (BF16 is held as float32)."""
        return _NUMPY[self]

    @classmethod
    def from_numpy(cls, dtype: np.dtype[Any]) -> DataType:
        if dtype.kind in ("O", "S", "U"):
            return cls.BYTES
        try:
            return _FROM_NUMPY[np.dtype(dtype)]
        except KeyError:
            raise ValueError(f"no protocol datatype for numpy dtype {dtype}") from None


_ITEMSIZE = {
    DataType.BOOL: 1,
    DataType.UINT8: 1,
    DataType.UINT16: 2,
    DataType.UINT32: 4,
    DataType.UINT64: 8,
    DataType.INT8: 1,
    DataType.INT16: 2,
    DataType.INT32: 4,
    DataType.INT64: 8,
    DataType.FP16: 2,
    DataType.FP32: 4,
    DataType.FP64: 8,
    DataType.BYTES: 0,
    DataType.BF16: 2,
}

_NUMPY: dict[DataType, np.dtype[Any]] = {
    DataType.BOOL: np.dtype(np.bool_),
    DataType.UINT8: np.dtype(np.uint8),
    DataType.UINT16: np.dtype(np.uint16),
    DataType.UINT32: np.dtype(np.uint32),
    DataType.UINT64: np.dtype(np.uint64),
    DataType.INT8: np.dtype(np.int8),
    DataType.INT16: np.dtype(np.int16),
    DataType.INT32: np.dtype(np.int32),
    DataType.INT64: np.dtype(np.int64),
    DataType.FP16: np.dtype(np.float16),
    DataType.FP32: np.dtype(np.float32),
    DataType.FP64: np.dtype(np.float64),
    DataType.BYTES: np.dtype(object),
    DataType.BF16: np.dtype(np.float32),
}

_FROM_NUMPY = {v: k for k, v in _NUMPY.items() if k not in (DataType.BYTES, DataType.BF16)}


def element_count(shape: tuple[int, ...] | list[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


@dataclass(slots=True)
class InferInput:
    """One input tensor of a request, already decoded into a NumPy array.

    ``data`` has the request's ``shape`` and the dtype of ``datatype.numpy_dtype``
    (BYTES: an object array of ``bytes``).
    """

    name: str
    datatype: DataType
    shape: tuple[int, ...]
    data: np.ndarray
    parameters: dict[str, Any] = field(default_factory=dict)


@dataclass(slots=True)
class RequestedOutput:
    name: str
    parameters: dict[str, Any] = field(default_factory=dict)


@dataclass(slots=True)
class InferenceRequest:
    model_name: str
    model_version: str = ""
    id: str = ""
    inputs: list[InferInput] = field(default_factory=list)
    outputs: list[RequestedOutput] = field(default_factory=list)
    parameters: dict[str, Any] = field(default_factory=dict)
    # The id of a traced request this one serves (a Python model's BLS call made with
    # ``trace=request.trace()``): it is traced as that trace's child. 0: none.
    trace_parent: int = 0


@dataclass(slots=True)
class InferOutput:
    name: str
    datatype: DataType
    shape: tuple[int, ...]
    data: np.ndarray
    parameters: dict[str, Any] = field(default_factory=dict)


@dataclass(slots=True)
class InferenceResponse:
    model_name: str
    model_version: str
    id: str = ""
    outputs: list[InferOutput] = field(default_factory=list)
    parameters: dict[str, Any] = field(default_factory=dict)
