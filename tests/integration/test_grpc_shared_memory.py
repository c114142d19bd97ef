"""System shared memory over gRPC with tritonclient's own shared-memory helpers."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.utils.shared_memory as shm
from tritonclient.utils import InferenceServerException

from tests.conftest import KilnProcess

NBYTES = 16 * 4


@pytest.fixture
def client(kiln_server: KilnProcess) -> Iterator[grpcclient.InferenceServerClient]:
    c = grpcclient.InferenceServerClient(kiln_server.grpc_url)
    c.unregister_system_shared_memory()
    yield c
    c.unregister_system_shared_memory()
    c.close()


@pytest.fixture
def tag() -> Iterator[str]:
    tag = uuid.uuid4().hex[:8]
    handles = [
        shm.create_shared_memory_region(f"in_{tag}", f"/kiln_gin_{tag}", NBYTES * 2),
        shm.create_shared_memory_region(f"out_{tag}", f"/kiln_gout_{tag}", NBYTES * 2),
    ]
    a = np.arange(16, dtype=np.int32)
    shm.set_shared_memory_region(handles[0], [a, np.full(16, 5, dtype=np.int32)])
    yield tag
    for handle in handles:
        shm.destroy_shared_memory_region(handle)


def _request(tag: str) -> tuple[list, list]:
    inputs = [
        grpcclient.InferInput("INPUT0", [1, 16], "INT32"),
        grpcclient.InferInput("INPUT1", [1, 16], "INT32"),
    ]
    inputs[0].set_shared_memory(f"in_{tag}", NBYTES, offset=0)
    inputs[1].set_shared_memory(f"in_{tag}", NBYTES, offset=NBYTES)
    outputs = [
        grpcclient.InferRequestedOutput("OUTPUT0"),
        grpcclient.InferRequestedOutput("OUTPUT1"),
    ]
    outputs[0].set_shared_memory(f"out_{tag}", NBYTES)
    outputs[1].set_shared_memory(f"out_{tag}", NBYTES, offset=NBYTES)
    return inputs, outputs


def test_infer_through_shared_memory(client: grpcclient.InferenceServerClient, tag: str) -> None:
    client.register_system_shared_memory(f"in_{tag}", f"/kiln_gin_{tag}", NBYTES * 2)
    client.register_system_shared_memory(f"out_{tag}", f"/kiln_gout_{tag}", NBYTES * 2)
    status = client.get_system_shared_memory_status(as_json=True)["regions"]
    assert set(status) == {f"in_{tag}", f"out_{tag}"}
    assert int(status[f"in_{tag}"]["byte_size"]) == NBYTES * 2

    inputs, outputs = _request(tag)
    result = client.infer("simple", inputs, outputs=outputs)
    out1 = result.get_output("OUTPUT1")
    assert out1.parameters["shared_memory_region"].string_param == f"out_{tag}"
    handle = shm.create_shared_memory_region(f"r_{tag}", f"/kiln_gout_{tag}", NBYTES * 2)
    a = np.arange(16, dtype=np.int32)
    np.testing.assert_array_equal(shm.get_contents_as_numpy(handle, np.int32, [16]), a + 5)
    np.testing.assert_array_equal(
        shm.get_contents_as_numpy(handle, np.int32, [16], offset=NBYTES), a - 5
    )
    shm.destroy_shared_memory_region(handle)


def test_bad_regions_are_refused(client: grpcclient.InferenceServerClient, tag: str) -> None:
    with pytest.raises(InferenceServerException, match="does not fit") as err:
        client.register_system_shared_memory("big", f"/kiln_gin_{tag}", NBYTES * 8)
    assert err.value.status() == "StatusCode.INVALID_ARGUMENT"
    with pytest.raises(InferenceServerException, match="unable to open"):
        client.register_system_shared_memory("none", "/kiln_missing_key", 8)
    client.register_system_shared_memory(f"in_{tag}", f"/kiln_gin_{tag}", NBYTES * 2)
    with pytest.raises(InferenceServerException, match="already in manager") as err:
        client.register_system_shared_memory(f"in_{tag}", f"/kiln_gin_{tag}", NBYTES * 2)
    assert err.value.status() == "StatusCode.ALREADY_EXISTS"

    inputs, _ = _request(tag)
    inputs[1].set_shared_memory(f"in_{tag}", NBYTES, offset=NBYTES + 4)
    with pytest.raises(InferenceServerException, match="outside region") as err:
        client.infer("simple", inputs)
    assert "INPUT1" in err.value.message()
    inputs[1].set_shared_memory("nope", NBYTES)
    with pytest.raises(InferenceServerException, match="unable to find system shared memory"):
        client.infer("simple", inputs)

    # CUDA shared memory: no GPU here.
    with pytest.raises(InferenceServerException, match="CUDA shared memory is not supported"):
        client.register_cuda_shared_memory("g", b"\0" * 64, 0, 64)
    assert client.get_cuda_shared_memory_status(as_json=True) == {}

    # Still serving.
    good = [grpcclient.InferInput("INPUT0", [1, 16], "INT32"),
            grpcclient.InferInput("INPUT1", [1, 16], "INT32")]  # fmt: skip
    ones = np.ones((1, 16), dtype=np.int32)
    good[0].set_data_from_numpy(ones)
    good[1].set_data_from_numpy(ones)
    np.testing.assert_array_equal(client.infer("simple", good).as_numpy("OUTPUT0"), ones * 2)
