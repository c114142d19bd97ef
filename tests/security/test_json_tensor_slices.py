"""A JSON tensor's values become an array a slice at a time (``codec.from_json``).

The body of a large infer or ``generate`` request is decoded on a worker thread, but a
C call (``np.array`` over a list, ``map`` over it, ``chain``) holds the GIL throughout:
over a 32 M-element ``data`` list one of them held the event loop for 1.5 s from that
thread. The check here is how many elements one such call takes, never how long it took.
"""

from __future__ import annotations

from collections.abc import Iterable
from itertools import chain
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from kiln.core.errors import KilnError
from kiln.core.types import DataType
from kiln.frontends.http import codec
from kiln.frontends.json_pieces import ENCODE_SLICE

COUNT = 5 * ENCODE_SLICE + 7


class _Sizes:
    """The largest list any wrapped call took."""

    def __init__(self) -> None:
        self.largest = 0

    def saw(self, value: Any) -> None:
        if isinstance(value, list):
            self.largest = max(self.largest, len(value))


@pytest.fixture
def sizes(monkeypatch: pytest.MonkeyPatch) -> _Sizes:
    seen = _Sizes()

    def array(obj: Any, *args: Any, **kwargs: Any) -> np.ndarray:
        seen.saw(obj)
        return np.array(obj, *args, **kwargs)

    def mapped(fn: Any, iterable: Iterable[Any]) -> Any:
        seen.saw(iterable)
        return map(fn, iterable)

    def from_iterable(groups: Iterable[list[Any]]) -> Any:
        groups = list(groups)
        seen.largest = max(seen.largest, sum(map(len, groups)))
        return chain.from_iterable(groups)

    numpy = SimpleNamespace(**{k: getattr(np, k) for k in dir(np) if not k.startswith("__")})
    numpy.array = array
    monkeypatch.setattr(codec, "np", numpy)
    monkeypatch.setattr(codec, "map", mapped, raising=False)
    monkeypatch.setattr(codec, "chain", SimpleNamespace(from_iterable=from_iterable))
    return seen


@pytest.mark.parametrize(
    ("datatype", "values"),
    [
        (DataType.FP32, [i / 4 for i in range(COUNT)]),
        (DataType.INT32, list(range(-(COUNT // 2), COUNT - COUNT // 2))),
        (DataType.UINT64, [2**64 - 1 - i for i in range(COUNT)]),
        (DataType.BOOL, [i % 3 == 0 for i in range(COUNT)]),
    ],
)
def test_a_flat_data_list_is_converted_a_slice_at_a_time(
    sizes: _Sizes, datatype: DataType, values: list[Any]
) -> None:
    arr = codec.from_json("X", datatype, (COUNT,), values)
    assert sizes.largest <= ENCODE_SLICE
    want = np.array(values, dtype=np.float64 if datatype is DataType.FP32 else None)
    assert arr.dtype == datatype.numpy_dtype
    assert np.array_equal(arr, want.astype(datatype.numpy_dtype))


def test_nested_data_is_flattened_a_slice_at_a_time(sizes: _Sizes) -> None:
    rows = 3 * ENCODE_SLICE
    nested = [[i, -i] for i in range(rows)]
    arr = codec.from_json("X", DataType.INT64, (rows, 2), nested)
    assert sizes.largest <= ENCODE_SLICE
    assert np.array_equal(arr, np.array(nested, dtype=np.int64))
    wide = [list(range(COUNT)), list(range(COUNT))]  # two rows, each over a slice
    arr = codec.from_json("X", DataType.INT64, (2, COUNT), wide)
    assert sizes.largest <= ENCODE_SLICE
    assert np.array_equal(arr, np.array(wide, dtype=np.int64))


@pytest.mark.parametrize(
    ("datatype", "bad", "message"),
    [
        (DataType.INT8, 128, "128 is out of range"),
        (DataType.INT64, 2**63, "a value is out of range"),
        (DataType.UINT64, -1, "out of range"),
        (DataType.FP32, "1", "expected numbers, got strings"),
    ],
)
def test_a_bad_value_past_the_first_slice_is_still_a_precise_400(
    sizes: _Sizes, datatype: DataType, bad: Any, message: str
) -> None:
    values: list[Any] = [1] * COUNT
    values[-3] = bad
    with pytest.raises(KilnError) as caught:
        codec.from_json("X", datatype, (COUNT,), values)
    assert caught.value.status.http_status == 400
    assert f"input 'X': unable to parse 'data' as {datatype.value}" in caught.value.message
    assert message in caught.value.message
    assert sizes.largest <= ENCODE_SLICE
