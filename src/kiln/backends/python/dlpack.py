"""DLPack for ``pb_utils.Tensor``: Triton's ``to_dlpack()`` / ``Tensor.from_dlpack()``.

Triton Python models written with PyTorch pass tensors without copies::

    x = torch.utils.dlpack.from_dlpack(pb_utils.get_input_tensor_by_name(r, "IN").to_dlpack())
    out = pb_utils.Tensor.from_dlpack("OUT", torch.utils.dlpack.to_dlpack(y))

kiln's Python backend keeps tensors in host memory as NumPy arrays, so both directions are
NumPy's own DLPack support: an input's capsule views the shared-memory arena, and a CPU
tensor taken in is viewed, not copied. A tensor in GPU memory (a CUDA tensor of the model's
own) is copied to the host through torch, which is how it could have been made; the model
then sees ``is_cpu()`` True, where Triton would have kept it on the GPU. A bfloat16 tensor
becomes float32, as kiln holds ``TYPE_BF16`` everywhere (NumPy has no bfloat16).

``from_dlpack`` takes what Triton takes: a DLPack capsule (``"dltensor"``, or DLPack 1.0's
``"dltensor_versioned"``), or any object with ``__dlpack__`` (a torch tensor, a NumPy or
CuPy array, another ``pb_utils.Tensor``). A capsule can be consumed only once.
"""

from __future__ import annotations

import ctypes
import struct
from typing import Any

import numpy as np

# DLDeviceType values (dlpack.h)
DL_CPU = 1
DL_CUDA = 2
DL_CUDA_HOST = 3
_HOST = (DL_CPU, DL_CUDA_HOST)

_pythonapi = ctypes.pythonapi
_pythonapi.PyCapsule_IsValid.restype = ctypes.c_int
_pythonapi.PyCapsule_IsValid.argtypes = [ctypes.py_object, ctypes.c_char_p]
_pythonapi.PyCapsule_GetPointer.restype = ctypes.c_void_p
_pythonapi.PyCapsule_GetPointer.argtypes = [ctypes.py_object, ctypes.c_char_p]

# Where the DLTensor starts in what each capsule points to: DLManagedTensor begins with it;
# DLManagedTensorVersioned has its version, manager_ctx, deleter and flags first (8 bytes
# each on a 64-bit machine).
_CAPSULES = ((b"dltensor", 0), (b"dltensor_versioned", 32))
_DEVICE = struct.Struct("=ii")  # DLDevice: device_type, device_id (int32 each)


class DLPackError(Exception):
    """What went wrong, for ``pb_utils`` to raise as TritonModelException."""


def is_capsule(obj: Any) -> bool:
    return type(obj).__name__ == "PyCapsule"


def _dltensor(capsule: Any) -> int | None:
    """The address of an unused capsule's DLTensor, None when it is no such capsule."""
    for name, offset in _CAPSULES:
        if _pythonapi.PyCapsule_IsValid(capsule, name):
            return int(_pythonapi.PyCapsule_GetPointer(capsule, name)) + offset
    return None


def capsule_device(capsule: Any) -> tuple[int, int]:
    """``(device_type, device_id)`` of an unused DLPack capsule."""
    tensor = _dltensor(capsule)
    if tensor is None:
        raise DLPackError(
            "the capsule is not an unused DLPack tensor (a DLPack capsule can be consumed "
            "only once)"
        )
    # the device follows the data pointer
    raw = ctypes.string_at(tensor + ctypes.sizeof(ctypes.c_void_p), _DEVICE.size)
    device_type, device_id = _DEVICE.unpack(raw)
    return device_type, device_id


class _Capsule:
    """A bare capsule as NumPy's ``from_dlpack`` takes producers (with ``__dlpack__``)."""

    def __init__(self, capsule: Any, device: tuple[int, int]) -> None:
        self._capsule = capsule
        self._device = device

    def __dlpack__(self, **_: Any) -> Any:
        return self._capsule

    def __dlpack_device__(self) -> tuple[int, int]:
        return self._device


def to_numpy(source: Any) -> np.ndarray:
    """The array a DLPack producer or capsule holds: viewed when in host memory, copied
    from a GPU through torch."""
    if is_capsule(source):
        device = capsule_device(source)
        producer: Any = _Capsule(source, device)
    elif hasattr(source, "__dlpack__") and hasattr(source, "__dlpack_device__"):
        device_type, device_id = source.__dlpack_device__()
        device = (int(device_type), int(device_id))
        producer = source
    else:
        raise DLPackError(
            f"expected a DLPack capsule or an object with __dlpack__, got {type(source).__name__}"
        )
    if device[0] not in _HOST:
        return _through_torch(source, device)
    try:
        return np.from_dlpack(producer)
    except (BufferError, TypeError, ValueError, RuntimeError) as exc:
        if _is_bfloat16(source):
            # NumPy has no bfloat16; kiln holds TYPE_BF16 tensors as float32 everywhere.
            return _through_torch(source, device)
        raise DLPackError(str(exc)) from None


def _is_bfloat16(source: Any) -> bool:
    if is_capsule(source):
        return _capsule_dtype(source) == (_DL_BFLOAT, 16)
    return "bfloat16" in str(getattr(source, "dtype", ""))


_DL_BFLOAT = 4  # DLDataTypeCode kDLBfloat
_DTYPE = struct.Struct("=BBH")  # DLDataType: code, bits, lanes


def _capsule_dtype(capsule: Any) -> tuple[int, int] | None:
    """``(type code, bits)`` of an unused capsule's elements."""
    tensor = _dltensor(capsule)
    if tensor is None:
        return None
    # after data (a pointer), device (8 bytes) and ndim (4 bytes)
    at = tensor + ctypes.sizeof(ctypes.c_void_p) + _DEVICE.size + 4
    code, bits, _ = _DTYPE.unpack(ctypes.string_at(at, _DTYPE.size))
    return code, bits


def _through_torch(source: Any, device: tuple[int, int]) -> np.ndarray:
    """A copy in host memory, through torch: of a device tensor, or of a bfloat16 one
    (as float32)."""
    where = "bfloat16"
    if device[0] == DL_CUDA:
        where = f"in GPU memory (cuda:{device[1]})"
    elif device[0] not in _HOST:
        where = f"on DLPack device type {device[0]}:{device[1]}"
    try:
        import torch
        import torch.utils.dlpack
    except ImportError:
        raise DLPackError(
            f"it is {where}; kiln's Python backend holds tensors as NumPy arrays in host "
            "memory and converts such tensors through torch, which is not installed "
            "(install kiln-serve[torch], or convert it first)"
        ) from None
    try:
        tensor = torch.utils.dlpack.from_dlpack(source).detach()
        if tensor.dtype == torch.bfloat16:
            tensor = tensor.float()
        return tensor.cpu().numpy()
    except Exception as exc:  # torch's own (e.g. AssertionError: not compiled with CUDA)
        raise DLPackError(f"it is {where} and could not be converted: {exc}") from None


def capsule_of(array: np.ndarray, **kwargs: Any) -> Any:
    """A DLPack capsule of ``array`` (zero copy when it can be)."""
    if array.dtype.kind in ("O", "S", "U"):
        raise DLPackError("a BYTES tensor has no DLPack form (DLPack holds numbers only)")
    if not array.flags.writeable:
        # DLPack before 1.0 cannot say read-only: NumPy refuses to export such an array.
        array = array.copy()
    try:
        return array.__dlpack__(**kwargs)
    except (BufferError, TypeError, ValueError) as exc:
        raise DLPackError(str(exc)) from None
