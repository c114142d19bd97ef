"""Fuzzing the HTTP binary-body parser: random bodies never crash it; valid ones round-trip."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tritonclient.utils import serialize_byte_tensor

from kiln.core.errors import KilnError
from kiln.core.types import DataType, InferenceResponse, InferOutput
from kiln.frontends.http.codec import decode_request, encode_response

NUMERIC = [
    DataType.BOOL, DataType.UINT8, DataType.INT16, DataType.INT32, DataType.INT64,
    DataType.UINT64, DataType.FP16, DataType.FP32, DataType.FP64,
]  # fmt: skip


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(body=st.binary(max_size=512), header_length=st.integers(-5, 600))
def test_random_bodies_are_refused_cleanly(body: bytes, header_length: int) -> None:
    try:
        decode_request(body, header_length, "m", "")
    except KilnError as exc:
        assert exc.message  # a precise message, never a crash


def _tensor(name: str, shape: list[int], datatype: str, size: int) -> dict[str, Any]:
    return {"name": name, "shape": shape, "datatype": datatype,
            "parameters": {"binary_data_size": size}}  # fmt: skip


@settings(max_examples=200, deadline=None)
@given(
    header=st.fixed_dictionaries(
        {"inputs": st.lists(
            st.fixed_dictionaries({
                "name": st.text(min_size=1, max_size=4),
                "shape": st.lists(st.integers(-2, 4), max_size=3),
                "datatype": st.sampled_from([d.value for d in DataType] + ["NOPE"]),
                "parameters": st.fixed_dictionaries(
                    {"binary_data_size": st.integers(-3, 64) | st.text(max_size=2)}
                ),
            }),
            max_size=3,
        )}
    ),
    tail=st.binary(max_size=128),
)  # fmt: skip
def test_structured_headers_with_random_tensors(header: dict[str, Any], tail: bytes) -> None:
    head = json.dumps(header).encode()
    try:
        decode_request(head + tail, len(head), "m", "")
    except KilnError as exc:
        assert exc.message


@settings(max_examples=200, deadline=None)
@given(
    datatype=st.sampled_from(NUMERIC),
    shape=st.lists(st.integers(0, 4), min_size=1, max_size=3),
    seed=st.integers(0, 2**16),
)
def test_valid_numeric_tensors_round_trip(datatype: DataType, shape: list[int], seed: int) -> None:
    rng = np.random.default_rng(seed)
    dtype = datatype.numpy_dtype
    if datatype is DataType.BOOL:
        data = rng.integers(0, 2, shape).astype(bool)
    elif dtype.kind == "f":
        data = rng.standard_normal(shape).astype(dtype)
    else:
        info = np.iinfo(dtype)
        data = rng.integers(info.min, info.max, shape, dtype=dtype, endpoint=True)
    raw = data.astype(dtype.newbyteorder("<")).tobytes()
    head = json.dumps({"inputs": [_tensor("X", shape, datatype.value, len(raw))]}).encode()
    request = decode_request(head + raw, len(head), "m", "")
    np.testing.assert_array_equal(request.inputs[0].data, data)

    # ... and back out through the response encoder, binary.
    request.parameters["binary_data_output"] = True
    response = InferenceResponse("m", "1", outputs=[InferOutput("Y", datatype, tuple(shape), data)])
    body, json_len = encode_response(response, request)
    assert json_len is not None
    meta = json.loads(body[:json_len])
    assert meta["outputs"][0]["parameters"]["binary_data_size"] == len(raw)
    assert body[json_len:] == raw


@settings(max_examples=200, deadline=None)
@given(items=st.lists(st.binary(max_size=20), min_size=1, max_size=6))
def test_bytes_tensors_round_trip(items: list[bytes]) -> None:
    arr = np.array(items, dtype=np.object_)
    raw = serialize_byte_tensor(arr).item()
    head = json.dumps({"inputs": [_tensor("S", [len(items)], "BYTES", len(raw))]}).encode()
    request = decode_request(head + raw, len(head), "m", "")
    assert list(request.inputs[0].data) == items


@pytest.mark.parametrize("cut", [1, 3, 5])
def test_truncated_bytes_element_names_the_tensor(cut: int) -> None:
    raw = serialize_byte_tensor(np.array([b"hello", b"world"], dtype=np.object_)).item()
    raw = raw[:-cut]
    head = json.dumps({"inputs": [_tensor("S", [2], "BYTES", len(raw))]}).encode()
    with pytest.raises(KilnError, match="input 'S'"):
        decode_request(head + raw, len(head), "m", "")
