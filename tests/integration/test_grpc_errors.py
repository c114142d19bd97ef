"""Bad input over gRPC: the right status code, a message naming the tensor, the same
message HTTP gives for the same mistake, and a server that keeps serving."""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from kiln.frontends.grpc import grpc_service_pb2 as pb
from kiln.frontends.grpc.services import inference_stub
from tests.conftest import KilnProcess

DATA = np.arange(16, dtype=np.int32).reshape(1, 16)


@pytest.fixture
def stub(kiln_server: KilnProcess) -> Iterator[object]:
    with grpc.insecure_channel(kiln_server.grpc_url) as channel:
        yield inference_stub(channel)


def simple_request(raw: bool = True) -> pb.ModelInferRequest:
    msg = pb.ModelInferRequest(model_name="simple")
    for name in ("INPUT0", "INPUT1"):
        tensor = msg.inputs.add(name=name, datatype="INT32", shape=[1, 16])
        if raw:
            msg.raw_input_contents.append(DATA.tobytes())
        else:
            tensor.contents.int_contents.extend(DATA.ravel().tolist())
    return msg


def refused(stub: object, msg: pb.ModelInferRequest) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as err:
        stub.ModelInfer(msg)  # type: ignore[attr-defined]
    return err.value


def assert_still_serving(kiln_server: KilnProcess) -> None:
    client = grpcclient.InferenceServerClient(kiln_server.grpc_url)
    inputs = [grpcclient.InferInput(n, [1, 16], "INT32") for n in ("INPUT0", "INPUT1")]
    for item in inputs:
        item.set_data_from_numpy(DATA)
    np.testing.assert_array_equal(client.infer("simple", inputs).as_numpy("OUTPUT0"), DATA * 2)


def test_raw_count_mismatch_names_the_tensor(stub: object, kiln_server: KilnProcess) -> None:
    msg = simple_request()
    del msg.raw_input_contents[1]
    err = refused(stub, msg)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "1 raw_input_contents for 2 inputs" in err.details()
    assert "input 'INPUT1' has none" in err.details()
    msg = simple_request()
    msg.raw_input_contents.append(b"extra")
    err = refused(stub, msg)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "3 raw_input_contents for 2 inputs" in err.details()
    assert_still_serving(kiln_server)


def test_raw_and_typed_contents_together(stub: object, kiln_server: KilnProcess) -> None:
    msg = simple_request()
    msg.inputs[0].contents.int_contents.extend(DATA.ravel().tolist())
    err = refused(stub, msg)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "contents field must not be specified when using raw_input_contents" in err.details()
    assert "'INPUT0'" in err.details()
    assert_still_serving(kiln_server)


def test_wrong_raw_byte_size(stub: object, kiln_server: KilnProcess) -> None:
    msg = simple_request()
    msg.raw_input_contents[1] = DATA.tobytes()[:-4]
    err = refused(stub, msg)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "input 'INPUT1': 60 bytes of raw_input_contents" in err.details()
    assert "needs 64" in err.details()
    assert_still_serving(kiln_server)


def test_bytes_element_running_past_its_buffer(stub: object, kiln_server: KilnProcess) -> None:
    msg = pb.ModelInferRequest(model_name="simple_string")
    for name in ("INPUT0", "INPUT1"):
        msg.inputs.add(name=name, datatype="BYTES", shape=[1, 16])
        msg.raw_input_contents.append((1000).to_bytes(4, "little") + b"12")
    err = refused(stub, msg)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "input 'INPUT0': BYTES element 0 has length 1000" in err.details()
    assert_still_serving(kiln_server)


def test_typed_element_count_mismatch(stub: object, kiln_server: KilnProcess) -> None:
    msg = simple_request(raw=False)
    del msg.inputs[1].contents.int_contents[-1]
    err = refused(stub, msg)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "input 'INPUT1'" in err.details() and "holds 15" in err.details()
    assert_still_serving(kiln_server)


def test_unknown_model_is_not_found(kiln_server: KilnProcess) -> None:
    client = grpcclient.InferenceServerClient(kiln_server.grpc_url)
    item = grpcclient.InferInput("INPUT0", [1, 16], "INT32")
    item.set_data_from_numpy(DATA)
    for call in (
        lambda: client.infer("no_such_model", [item]),
        lambda: client.get_model_metadata("no_such_model"),
        lambda: client.get_model_config("no_such_model"),
    ):
        with pytest.raises(InferenceServerException) as err:
            call()
        assert err.value.status() == "StatusCode.NOT_FOUND"
        assert "Request for unknown model: 'no_such_model' is not found" in err.value.message()
    assert_still_serving(kiln_server)


@pytest.mark.parametrize(
    ("datatype", "array", "shape"),
    [
        ("FP32", DATA.astype(np.float32), [1, 16]),  # wrong datatype
        ("INT32", np.arange(15, dtype=np.int32).reshape(1, 15), [1, 15]),  # wrong shape
    ],
)
def test_core_refusals_read_the_same_over_grpc_and_http(
    kiln_server: KilnProcess, datatype: str, array: np.ndarray, shape: list[int]
) -> None:
    def build(module: object) -> list[object]:
        ok = module.InferInput("INPUT0", [1, 16], "INT32")  # type: ignore[attr-defined]
        ok.set_data_from_numpy(DATA)
        bad = module.InferInput("INPUT1", shape, datatype)  # type: ignore[attr-defined]
        bad.set_data_from_numpy(array)
        return [ok, bad]

    grpc_client = grpcclient.InferenceServerClient(kiln_server.grpc_url)
    http_client = httpclient.InferenceServerClient(kiln_server.http_url)
    with pytest.raises(InferenceServerException) as grpc_err:
        grpc_client.infer("simple", build(grpcclient))
    with pytest.raises(InferenceServerException) as http_err:
        http_client.infer("simple", build(httpclient))
    assert grpc_err.value.status() == "StatusCode.INVALID_ARGUMENT"
    assert "'INPUT1'" in grpc_err.value.message()
    assert grpc_err.value.message() == http_err.value.message()
    assert_still_serving(kiln_server)
