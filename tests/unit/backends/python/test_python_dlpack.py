"""Triton's DLPack API on ``pb_utils.Tensor``: ``to_dlpack()``, ``Tensor.from_dlpack()``
and the ``__dlpack__`` protocol, with NumPy and torch on either side."""

from __future__ import annotations

import sys
from typing import Any

import numpy as np
import pytest
import torch
import torch.utils.dlpack as tdl

from kiln.backends.python import dlpack
from kiln.backends.python.pb_utils import Tensor, TritonModelException


def test_an_input_reaches_torch_without_a_copy() -> None:
    array = np.arange(6, dtype=np.float32).reshape(2, 3)
    tensor = Tensor("IN", array)
    viewed = tdl.from_dlpack(tensor.to_dlpack())
    assert viewed.data_ptr() == array.ctypes.data
    viewed[0, 0] = 42.0  # the same memory
    assert array[0, 0] == 42.0
    # The protocol form: torch.from_dlpack takes the Tensor itself.
    again = torch.from_dlpack(tensor)
    assert again.data_ptr() == array.ctypes.data and again.shape == (2, 3)
    assert tensor.__dlpack_device__() == (dlpack.DL_CPU, 0)


def test_numpy_reads_a_tensor_through_the_protocol() -> None:
    array = np.arange(10, dtype=np.int64)[::3]  # strided
    got = np.from_dlpack(Tensor("IN", array))
    assert np.shares_memory(got, array) and got.tolist() == [0, 3, 6, 9]


@pytest.mark.parametrize(
    "make",
    [
        lambda t: tdl.to_dlpack(t),  # a capsule, the common form in Triton models
        lambda t: t,  # an object with __dlpack__
    ],
    ids=["capsule", "protocol"],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.int64, torch.bool])
def test_from_dlpack_views_a_cpu_torch_tensor(make: Any, dtype: torch.dtype) -> None:
    source = (torch.arange(6) % 2).to(dtype).reshape(3, 2)
    tensor = Tensor.from_dlpack("OUT", make(source))
    assert tensor.name() == "OUT" and tensor.shape() == [3, 2] and tensor.is_cpu()
    np.testing.assert_array_equal(tensor.as_numpy(), source.numpy())
    assert tensor.as_numpy().ctypes.data == source.data_ptr()  # no copy


def test_from_dlpack_of_a_strided_tensor_keeps_its_layout() -> None:
    source = torch.arange(12.0).reshape(3, 4).t()  # a transposed view
    got = Tensor.from_dlpack("T", tdl.to_dlpack(source)).as_numpy()
    np.testing.assert_array_equal(got, source.numpy())


def test_bfloat16_becomes_float32_as_kiln_holds_bf16() -> None:
    source = torch.tensor([1.5, -2.0, 0.25], dtype=torch.bfloat16)
    for given in (source, tdl.to_dlpack(source)):
        got = Tensor.from_dlpack("B", given).as_numpy()
        assert got.dtype == np.float32 and got.tolist() == [1.5, -2.0, 0.25]


def test_dlpack_1_0_versioned_capsules_are_taken_too() -> None:
    """``__dlpack__(max_version=(1, 0))`` gives a ``dltensor_versioned`` capsule, whose
    tensor sits after a header: its device and dtype are read from there."""
    numbers = np.arange(4, dtype=np.int16)
    capsule = numbers.__dlpack__(max_version=(1, 0))
    assert "dltensor_versioned" in repr(capsule)
    assert dlpack.capsule_device(capsule) == (dlpack.DL_CPU, 0)
    got = Tensor.from_dlpack("V", capsule).as_numpy()
    assert np.shares_memory(got, numbers)
    bf16 = torch.tensor([0.5, 3.0], dtype=torch.bfloat16).__dlpack__(max_version=(1, 0))
    assert Tensor.from_dlpack("W", bf16).as_numpy().tolist() == [0.5, 3.0]


def test_a_roundtrip_through_pb_utils_tensors() -> None:
    first = Tensor("A", np.array([[1, 2], [3, 4]], dtype=np.int32))
    second = Tensor.from_dlpack("B", first.to_dlpack())
    assert np.shares_memory(first.as_numpy(), second.as_numpy())
    third = Tensor.from_dlpack("C", second)  # a pb_utils.Tensor is a producer too
    assert third.as_numpy().tolist() == [[1, 2], [3, 4]]


def test_a_read_only_array_is_exported_as_a_copy() -> None:
    array = np.arange(3, dtype=np.float64)
    array.flags.writeable = False  # e.g. np.frombuffer over bytes
    viewed = tdl.from_dlpack(Tensor("R", array).to_dlpack())
    assert viewed.tolist() == [0.0, 1.0, 2.0]
    assert viewed.data_ptr() != array.ctypes.data


# ---- errors name the tensor ----------------------------------------------------------------


def test_a_capsule_can_be_consumed_only_once() -> None:
    capsule = tdl.to_dlpack(torch.zeros(2))
    Tensor.from_dlpack("FIRST", capsule)
    with pytest.raises(TritonModelException, match=r"Tensor 'SECOND': .*consumed only once"):
        Tensor.from_dlpack("SECOND", capsule)


def test_from_dlpack_refuses_what_is_not_dlpack() -> None:
    with pytest.raises(TritonModelException, match=r"Tensor 'X': .*got list"):
        Tensor.from_dlpack("X", [1, 2, 3])
    with pytest.raises(TritonModelException, match="name first"):
        Tensor.from_dlpack(tdl.to_dlpack(torch.zeros(1)), "X")  # type: ignore[arg-type]


def test_a_bytes_tensor_has_no_dlpack_form() -> None:
    tensor = Tensor("TEXT", np.array([b"a", b"b"], dtype=object))
    with pytest.raises(TritonModelException, match=r"Tensor 'TEXT': to_dlpack: a BYTES"):
        tensor.to_dlpack()
    with pytest.raises(BufferError, match="Tensor 'TEXT'"):
        tensor.__dlpack__()


class _OnDevice:
    """A producer that says its data is in GPU memory (as a CUDA tensor would)."""

    def __init__(self, device_type: int) -> None:
        self.device_type = device_type

    def __dlpack__(self, **_: Any) -> Any:
        raise BufferError("no such device here")

    def __dlpack_device__(self) -> tuple[int, int]:
        return (self.device_type, 1)


def test_a_device_tensor_goes_through_torch_and_its_failure_says_where() -> None:
    """On a machine without a GPU, torch cannot take the CUDA tensor: the error names the
    tensor and the device (tests/gpu copies a real CUDA tensor)."""
    with pytest.raises(TritonModelException, match=r"Tensor 'G': .*GPU memory \(cuda:1\)"):
        Tensor.from_dlpack("G", _OnDevice(dlpack.DL_CUDA))


def test_without_torch_a_device_tensor_asks_for_the_extra(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "torch", None)  # import torch raises ImportError
    with pytest.raises(TritonModelException, match=r"kiln-serve\[torch\]") as err:
        Tensor.from_dlpack("G", _OnDevice(dlpack.DL_CUDA))
    assert "Tensor 'G'" in str(err.value)
