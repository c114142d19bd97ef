"""KServe v2 REST bodies <-> core types: JSON tensors and the binary tensor data extension."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import orjson
import pytest
from tritonclient.utils import (
    deserialize_bf16_tensor,
    deserialize_bytes_tensor,
    serialize_bf16_tensor,
    serialize_byte_tensor,
)

from kiln.config.loader import parse_config_text
from kiln.config.signature import ModelSignature
from kiln.core.errors import KilnError, Status
from kiln.core.types import DataType, InferenceRequest, InferenceResponse, InferOutput
from kiln.frontends.http.codec import (
    decode_raw_request,
    decode_request,
    encode_response,
    parse_json,
)


def _one(datatype: str, shape: list[Any], data: Any) -> np.ndarray:
    body = {"inputs": [{"name": "x", "datatype": datatype, "shape": shape, "data": data}]}
    request = decode_request(orjson.dumps(body), None, "m", "")
    return request.inputs[0].data


def _error(body: bytes, header_length: int | None = None) -> str:
    with pytest.raises(KilnError) as info:
        decode_request(body, header_length, "m", "")
    assert info.value.status is Status.INVALID_ARG
    return info.value.message


def test_json_nested_and_flat_data_are_row_major() -> None:
    flat = _one("FP32", [2, 3], [1, 2, 3, 4, 5, 6.5])
    nested = _one("FP32", [2, 3], [[1, 2, 3], [4, 5, 6.5]])
    expected = np.array([[1, 2, 3], [4, 5, 6.5]], dtype=np.float32)
    for got in (flat, nested):
        assert got.dtype == np.float32
        np.testing.assert_array_equal(got, expected)


def test_request_fields() -> None:
    body = {
        "id": "r1",
        "parameters": {"priority": 1},
        "inputs": [
            {"name": "x", "datatype": "INT64", "shape": [2], "data": [1, -2],
             "parameters": {"p": "v"}}
        ],
        "outputs": [{"name": "y", "parameters": {"binary_data": True}}],
    }  # fmt: skip
    request = decode_request(orjson.dumps(body), None, "m", "3")
    assert (request.model_name, request.model_version, request.id) == ("m", "3", "r1")
    assert request.parameters == {"priority": 1}
    tensor = request.inputs[0]
    assert (tensor.name, tensor.datatype, tensor.shape) == ("x", DataType.INT64, (2,))
    assert tensor.parameters == {"p": "v"}
    np.testing.assert_array_equal(tensor.data, np.array([1, -2], dtype=np.int64))
    assert [(o.name, o.parameters) for o in request.outputs] == [("y", {"binary_data": True})]


def test_bytes_are_json_strings() -> None:
    got = _one("BYTES", [1, 3], [["12", "héllo", ""]])
    assert got.dtype == object and got.shape == (1, 3)
    assert list(got.ravel()) == [b"12", "héllo".encode(), b""]


def test_bool_must_be_json_booleans() -> None:
    np.testing.assert_array_equal(_one("BOOL", [3], [True, False, True]), [True, False, True])
    message = _error(
        orjson.dumps({"inputs": [{"name": "x", "datatype": "BOOL", "shape": [2], "data": [1, 0]}]})
    )
    assert "input 'x'" in message and "BOOL" in message


@pytest.mark.parametrize(
    ("datatype", "data"),
    [("INT32", [1, 2.5]), ("INT32", [True, False]), ("UINT8", [1, 256]), ("UINT8", [-1, 0]),
     ("INT32", ["1", "2"]), ("FP32", ["1.0", "2"]), ("FP32", [True, False]),
     ("INT64", [[1], 2]), ("UINT64", [2**64, 1])],
)  # fmt: skip
def test_numbers_of_the_wrong_kind_are_refused(datatype: str, data: list[Any]) -> None:
    body = {"inputs": [{"name": "x", "datatype": datatype, "shape": [2], "data": data}]}
    message = _error(json.dumps(body).encode())  # orjson cannot write 2**64
    assert f"input 'x': unable to parse 'data' as {datatype}" in message


def test_whole_floats_and_ints_fill_float_tensors() -> None:
    np.testing.assert_array_equal(_one("FP64", [3], [1, 2.5, -3]), [1.0, 2.5, -3.0])
    np.testing.assert_array_equal(_one("INT8", [2], [-128, 127]), [-128, 127])
    np.testing.assert_array_equal(_one("UINT64", [1], [2**64 - 1]), [2**64 - 1])
    assert _one("FP32", [0], []).shape == (0,)


@pytest.mark.parametrize("datatype", ["FP16", "BF16"])
def test_fp16_and_bf16_are_refused_in_json_with_tritons_message(datatype: str) -> None:
    body = {"inputs": [{"name": "x", "datatype": datatype, "shape": [1], "data": [1.0]}]}
    message = _error(orjson.dumps(body))
    assert message.startswith(
        f"receiving {datatype} data via JSON is not supported. Please use the binary data format"
    )
    assert "'x'" in message


@pytest.mark.parametrize(
    ("body", "words"),
    [
        (b"{bad", "failed to parse the request JSON"),
        (b"[1, 2]", "must be an object, got array"),
        (b'"text"', "must be an object, got str"),
        (b"{}", "needs an 'inputs' array"),
        (b'{"inputs": [1]}', "inputs[0] must be an object"),
        (b'{"inputs": [{"datatype": "FP32"}]}', "inputs[0] needs a 'name'"),
        (b'{"inputs": [{"name": "x", "shape": [1], "data": [1]}]}', "'datatype'"),
        (b'{"inputs": [{"name": "x", "datatype": "FP8", "shape": [1], "data": [1]}]}',
         "unknown datatype 'FP8'"),
        (b'{"inputs": [{"name": "x", "datatype": "FP32", "shape": [-1], "data": [1]}]}',
         "non-negative integers"),
        (b'{"inputs": [{"name": "x", "datatype": "FP32", "shape": [1.5], "data": [1]}]}',
         "non-negative integers"),
        (b'{"inputs": [{"name": "x", "datatype": "FP32", "shape": [true], "data": [1]}]}',
         "non-negative integers"),
        (b'{"inputs": [{"name": "x", "datatype": "FP32", "shape": "1", "data": [1]}]}',
         "'shape' must be an array"),
        (b'{"inputs": [{"name": "x", "datatype": "FP32", "shape": [3], "data": [1, 2]}]}',
         "shape [3] expects 3 elements, but 'data' holds 2"),
        (b'{"inputs": [{"name": "x", "datatype": "FP32", "shape": [2], "data": [[1], [2, 3]]}]}',
         "unable to parse 'data' as FP32"),
        (b'{"inputs": [{"name": "x", "datatype": "FP32", "shape": [1]}]}',
         "neither 'data' nor 'binary_data_size'"),
        (b'{"id": 5, "inputs": []}', "'id' must be a string"),
        (b'{"inputs": [], "outputs": [{"nom": "y"}]}', "outputs[0] must be an object"),
        (b'{"inputs": [], "parameters": []}', "'parameters' must be an object"),
    ],
)  # fmt: skip
def test_malformed_requests(body: bytes, words: str) -> None:
    assert words in _error(body)


def test_parse_json() -> None:
    assert parse_json(b'{"a": 1}') == {"a": 1}
    with pytest.raises(KilnError):
        parse_json(b"null")


# ---- binary tensor data extension ---------------------------------------------------------


def _binary_body(tensors: list[tuple[str, str, np.ndarray, bytes]]) -> tuple[bytes, int]:
    header = {
        "inputs": [
            {"name": n, "datatype": dt, "shape": list(a.shape),
             "parameters": {"binary_data_size": len(raw)}}
            for n, dt, a, raw in tensors
        ]
    }  # fmt: skip
    json_part = orjson.dumps(header)
    return json_part + b"".join(raw for *_, raw in tensors), len(json_part)


def test_binary_inputs_in_every_encoding() -> None:
    ints = np.arange(6, dtype=np.int32).reshape(2, 3)
    halves = np.array([0.5, -2.0], dtype=np.float16)
    strings = np.array([b"a\x00b", "ü".encode(), b""], dtype=object)
    bf16 = np.array([1.0, -2.5, 3.0], dtype=np.float32)
    bools = np.array([True, False])
    tensors = [
        ("i", "INT32", ints, ints.tobytes()),
        ("h", "FP16", halves, halves.tobytes()),
        ("s", "BYTES", strings, serialize_byte_tensor(strings).item()),
        ("b", "BF16", bf16, serialize_bf16_tensor(bf16).item()),
        ("t", "BOOL", bools, bools.tobytes()),
    ]
    body, length = _binary_body(tensors)
    request = decode_request(body, length, "m", "")
    got = {t.name: t.data for t in request.inputs}
    np.testing.assert_array_equal(got["i"], ints)
    assert got["h"].dtype == np.float16
    np.testing.assert_array_equal(got["h"], halves)
    assert list(got["s"]) == list(strings)
    np.testing.assert_array_equal(got["b"], bf16)  # exactly representable in bf16
    np.testing.assert_array_equal(got["t"], bools)


@pytest.mark.parametrize(
    ("size", "extra", "length_delta", "words"),
    [
        (12, b"", 0, "12 bytes of binary data, but shape [2] of INT32 needs 8"),
        (8, b"xx", 0, "add up to 8 bytes, but the request body holds 10"),
        (16, b"", 0, "runs past the end of the request body"),
        (8, b"", 10_000, "larger than the request body"),
    ],
)
def test_binary_size_mismatches(size: int, extra: bytes, length_delta: int, words: str) -> None:
    data = np.arange(3, dtype=np.int32).tobytes()[: min(size, 12)]
    header = orjson.dumps(
        {"inputs": [{"name": "x", "datatype": "INT32", "shape": [2],
                     "parameters": {"binary_data_size": size}}]}
    )  # fmt: skip
    assert words in _error(header + data + extra, len(header) + length_delta)


def test_bytes_element_running_past_its_buffer() -> None:
    raw = serialize_byte_tensor(np.array([b"abc"], dtype=object)).item()
    body, length = _binary_body([("s", "BYTES", np.empty(2, dtype=object), raw)])
    assert "BYTES data ends after 1 of 2 elements" in _error(body, length)


def _response(*outputs: InferOutput) -> InferenceResponse:
    return InferenceResponse("m", "1", id="r", outputs=list(outputs))


def test_json_response() -> None:
    out = [
        InferOutput("f", DataType.FP32, (2, 2), np.array([[1, 2], [3, 4.5]], dtype=np.float32)),
        InferOutput("s", DataType.BYTES, (2,), np.array([b"x", "é".encode()], dtype=object)),
        InferOutput("b", DataType.BOOL, (2,), np.array([True, False])),
    ]
    body, length = encode_response(_response(*out), InferenceRequest("m"))
    assert length is None
    data = orjson.loads(body)
    assert data["model_name"] == "m" and data["model_version"] == "1" and data["id"] == "r"
    assert data["outputs"] == [
        {"name": "f", "datatype": "FP32", "shape": [2, 2], "data": [1.0, 2.0, 3.0, 4.5]},
        {"name": "s", "datatype": "BYTES", "shape": [2], "data": ["x", "é"]},
        {"name": "b", "datatype": "BOOL", "shape": [2], "data": [True, False]},
    ]


def test_binary_response_round_trips_through_tritonclients_decoders() -> None:
    floats = np.array([[1, 2], [3, 4.5]], dtype=np.float32)
    strings = np.array([b"x\x00", b""], dtype=object)
    bf16 = np.array([1.0, 0.5], dtype=np.float32)
    out = [
        InferOutput("f", DataType.FP32, (2, 2), floats),
        InferOutput("s", DataType.BYTES, (2,), strings),
        InferOutput("b", DataType.BF16, (2,), bf16),
        InferOutput("j", DataType.INT32, (1,), np.array([7], dtype=np.int32)),
    ]
    request = decode_request(
        b'{"inputs": [], "parameters": {"binary_data_output": true},'
        b' "outputs": [{"name": "j", "parameters": {"binary_data": false}}]}',
        None, "m", "",
    )  # fmt: skip
    body, length = encode_response(_response(*out), request)
    assert length is not None
    header = orjson.loads(body[:length])
    sizes = [o.get("parameters", {}).get("binary_data_size") for o in header["outputs"]]
    assert sizes == [16, 4 + 2 + 4, 4, None]
    assert header["outputs"][3]["data"] == [7]
    raw = body[length:]
    np.testing.assert_array_equal(np.frombuffer(raw[:16], dtype="<f4").reshape(2, 2), floats)
    assert list(deserialize_bytes_tensor(raw[16:26])) == list(strings)
    np.testing.assert_array_equal(deserialize_bf16_tensor(raw[26:30]).ravel(), bf16)


def _raw_sig(config: str) -> ModelSignature:
    return ModelSignature(parse_config_text(config))


def test_raw_binary_request() -> None:
    sig = _raw_sig(
        'name: "r"\nmax_batch_size: 4\ninput [ { name: "x" data_type: TYPE_FP32 dims: [ -1 ] } ]'
    )
    values = np.array([1, 2, 3], dtype=np.float32)
    request = decode_raw_request(values.tobytes(), sig, "r", "")
    assert request.inputs[0].shape == (1, 3)
    np.testing.assert_array_equal(request.inputs[0].data, values.reshape(1, 3))
    assert request.parameters["binary_data_output"] is True
    with pytest.raises(KilnError) as info:
        decode_raw_request(b"12345", sig, "r", "")
    assert "5 bytes do not fit input 'x'" in info.value.message
    two = _raw_sig(
        'name: "t"\ninput [ { name: "a" data_type: TYPE_FP32 dims: [1] },'
        ' { name: "b" data_type: TYPE_FP32 dims: [1] } ]'
    )
    with pytest.raises(KilnError) as info:
        decode_raw_request(b"1234", two, "t", "")
    assert "exactly one input" in info.value.message
