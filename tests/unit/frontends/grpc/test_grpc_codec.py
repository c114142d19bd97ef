"""ModelInferRequest/Response <-> core types, with the bytes tritonclient produces."""

from __future__ import annotations

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.grpc import service_pb2 as triton_pb2
from tritonclient.utils import deserialize_bf16_tensor, deserialize_bytes_tensor

from kiln.core.errors import KilnError, Status
from kiln.core.types import DataType, InferenceResponse, InferOutput
from kiln.frontends.grpc import grpc_service_pb2 as pb
from kiln.frontends.grpc.codec import decode_request, encode_response


def _from_tritonclient(inputs: list[grpcclient.InferInput]) -> pb.ModelInferRequest:
    """Build the request exactly as tritonclient would send it, then parse it as kiln."""
    request = triton_pb2.ModelInferRequest(model_name="m", id="7")
    for item in inputs:
        request.inputs.extend([item._get_tensor()])
        request.raw_input_contents.append(item._get_content())
    return pb.ModelInferRequest.FromString(request.SerializeToString())


@pytest.mark.parametrize(
    ("datatype", "array"),
    [
        ("FP32", np.linspace(-1, 1, 6, dtype=np.float32).reshape(2, 3)),
        ("FP16", np.array([[0.5, -2.0, 65504.0]], dtype=np.float16)),
        ("INT8", np.array([[-128, 0, 127]], dtype=np.int8)),
        ("UINT64", np.array([[0, 2**64 - 1]], dtype=np.uint64)),
        ("BOOL", np.array([[True, False, True]])),
        ("BYTES", np.array([[b"a", b"", b"\x00\xff nul and non-utf8"]], dtype=object)),
    ],
)
def test_raw_inputs_decode_as_sent(datatype: str, array: np.ndarray) -> None:
    item = grpcclient.InferInput("X", list(array.shape), datatype)
    item.set_data_from_numpy(array)
    request = decode_request(_from_tritonclient([item]))
    assert request.model_name == "m" and request.id == "7"
    tensor = request.inputs[0]
    assert tensor.datatype is DataType(datatype)
    assert tensor.shape == array.shape
    np.testing.assert_array_equal(tensor.data, array)


def test_bf16_raw_decodes_to_the_float32_it_truncates() -> None:
    values = np.array([[1.0, -2.5, 3.140625, 1e10]], dtype=np.float32)
    item = grpcclient.InferInput("X", [1, 4], "BF16")
    item.set_data_from_numpy(values)
    tensor = decode_request(_from_tritonclient([item])).inputs[0]
    assert tensor.data.dtype == np.float32
    expected = (values.view(np.uint32) & 0xFFFF0000).view(np.float32)  # high half kept
    np.testing.assert_array_equal(tensor.data, expected)


def test_outputs_encode_raw_one_per_output_in_order() -> None:
    out = [
        InferOutput("B", DataType.BYTES, (2,), np.array([b"x", b"yz"], dtype=object)),
        InferOutput("H", DataType.BF16, (2,), np.array([1.5, -4.0], dtype=np.float32)),
        InferOutput("F", DataType.FP16, (1, 2), np.array([[0.25, 8]], dtype=np.float16)),
    ]
    msg = encode_response(InferenceResponse("m", "1", id="r", outputs=out, parameters={"k": 3}))
    assert [o.name for o in msg.outputs] == ["B", "H", "F"]
    assert len(msg.raw_output_contents) == 3
    assert not any(o.HasField("contents") for o in msg.outputs)
    assert msg.parameters["k"].int64_param == 3
    raw = msg.raw_output_contents
    assert list(deserialize_bytes_tensor(raw[0])) == [b"x", b"yz"]
    np.testing.assert_array_equal(deserialize_bf16_tensor(raw[1]).ravel(), [1.5, -4.0])
    np.testing.assert_array_equal(np.frombuffer(raw[2], "<f2"), [0.25, 8])


def test_typed_contents_decode_per_datatype() -> None:
    msg = pb.ModelInferRequest(model_name="m")
    msg.inputs.add(name="i8", datatype="INT8", shape=[2]).contents.int_contents.extend([-1, 5])
    msg.inputs.add(name="u16", datatype="UINT16", shape=[1]).contents.uint_contents.append(7)
    msg.inputs.add(name="s", datatype="BYTES", shape=[1]).contents.bytes_contents.append(b"q")
    msg.inputs.add(name="f", datatype="FP64", shape=[1]).contents.fp64_contents.append(0.5)
    request = decode_request(msg)
    got = {t.name: t.data for t in request.inputs}
    assert got["i8"].dtype == np.int8 and list(got["i8"]) == [-1, 5]
    assert got["u16"].dtype == np.uint16 and list(got["u16"]) == [7]
    assert list(got["s"]) == [b"q"]
    assert got["f"].dtype == np.float64


@pytest.mark.parametrize(
    ("build", "needle"),
    [
        (lambda m: m.inputs.add(name="A", datatype="INT8", shape=[1]).contents.int_contents
         .append(300), "outside the range of INT8"),
        (lambda m: m.inputs.add(name="A", datatype="FP16", shape=[1]),
         "FP16 has no typed 'contents' field"),
        (lambda m: m.inputs.add(name="A", datatype="INT32", shape=[2]).contents.int_contents
         .append(1), "expects 2 elements, but contents.int_contents holds 1"),
        (lambda m: m.inputs.add(name="A", datatype="FLOAT", shape=[1]), "unknown datatype"),
    ],
)  # fmt: skip
def test_bad_typed_inputs_name_the_tensor(build: object, needle: str) -> None:
    msg = pb.ModelInferRequest(model_name="m")
    build(msg)  # type: ignore[operator]
    with pytest.raises(KilnError) as err:
        decode_request(msg)
    assert err.value.status is Status.INVALID_ARG
    assert "'A'" in err.value.message and needle in err.value.message
