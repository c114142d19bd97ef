"""System shared memory over HTTP with tritonclient's own shared-memory helpers."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import numpy as np
import pytest
import requests
import tritonclient.http as httpclient
import tritonclient.utils.shared_memory as shm
from tritonclient.utils import InferenceServerException

from tests.conftest import KilnProcess

NBYTES = 16 * 4


@pytest.fixture
def client(kiln_server: KilnProcess) -> Iterator[httpclient.InferenceServerClient]:
    c = httpclient.InferenceServerClient(kiln_server.http_url)
    c.unregister_system_shared_memory()
    yield c
    c.unregister_system_shared_memory()
    c.close()


@pytest.fixture
def regions() -> Iterator[dict[str, object]]:
    """An input region holding INPUT0 then INPUT1, and an output region for two outputs."""
    tag = uuid.uuid4().hex[:8]
    handles = {
        "in": shm.create_shared_memory_region(f"in_{tag}", f"/kiln_in_{tag}", NBYTES * 2),
        "out": shm.create_shared_memory_region(f"out_{tag}", f"/kiln_out_{tag}", NBYTES * 2),
    }
    yield {"tag": tag, **handles}
    for handle in handles.values():
        shm.destroy_shared_memory_region(handle)


def _simple_request(tag: str, out_offset: int = 0) -> tuple[list, list]:
    inputs = [
        httpclient.InferInput("INPUT0", [1, 16], "INT32"),
        httpclient.InferInput("INPUT1", [1, 16], "INT32"),
    ]
    inputs[0].set_shared_memory(f"in_{tag}", NBYTES, offset=0)
    inputs[1].set_shared_memory(f"in_{tag}", NBYTES, offset=NBYTES)
    outputs = [
        httpclient.InferRequestedOutput("OUTPUT0"),
        httpclient.InferRequestedOutput("OUTPUT1"),
    ]
    outputs[0].set_shared_memory(f"out_{tag}", NBYTES, offset=out_offset)
    outputs[1].set_shared_memory(f"out_{tag}", NBYTES, offset=out_offset + NBYTES)
    return inputs, outputs


def test_infer_reads_and_writes_shared_memory(
    client: httpclient.InferenceServerClient, regions: dict
) -> None:
    tag = regions["tag"]
    a = np.arange(16, dtype=np.int32)
    b = np.full(16, 7, dtype=np.int32)
    shm.set_shared_memory_region(regions["in"], [a, b])
    client.register_system_shared_memory(f"in_{tag}", f"/kiln_in_{tag}", NBYTES * 2)
    client.register_system_shared_memory(f"out_{tag}", f"/kiln_out_{tag}", NBYTES * 2)
    status = client.get_system_shared_memory_status()
    assert {r["name"] for r in status} == {f"in_{tag}", f"out_{tag}"}
    assert {r["byte_size"] for r in status} == {NBYTES * 2}

    inputs, outputs = _simple_request(tag)
    result = client.infer("simple", inputs, outputs=outputs)
    out0 = result.get_output("OUTPUT0")
    assert out0["parameters"]["shared_memory_region"] == f"out_{tag}"
    assert out0["parameters"]["shared_memory_byte_size"] == NBYTES
    assert "data" not in out0  # the bytes are in shared memory, not in the body
    assert "binary_data_size" not in out0["parameters"]
    sum_ = shm.get_contents_as_numpy(regions["out"], np.int32, [1, 16], offset=0)
    diff = shm.get_contents_as_numpy(regions["out"], np.int32, [1, 16], offset=NBYTES)
    np.testing.assert_array_equal(sum_[0], a + b)
    np.testing.assert_array_equal(diff[0], a - b)


def test_unregister_removes_regions(
    client: httpclient.InferenceServerClient, regions: dict
) -> None:
    tag = regions["tag"]
    client.register_system_shared_memory(f"in_{tag}", f"/kiln_in_{tag}", NBYTES * 2)
    client.unregister_system_shared_memory(f"in_{tag}")
    assert client.get_system_shared_memory_status() == []
    with pytest.raises(InferenceServerException, match="Unable to find"):
        client.get_system_shared_memory_status(f"in_{tag}")


def test_register_twice_is_refused(client: httpclient.InferenceServerClient, regions: dict) -> None:
    tag = regions["tag"]
    client.register_system_shared_memory(f"in_{tag}", f"/kiln_in_{tag}", NBYTES * 2)
    with pytest.raises(InferenceServerException, match="already in manager"):
        client.register_system_shared_memory(f"in_{tag}", f"/kiln_in_{tag}", NBYTES * 2)


@pytest.mark.parametrize(
    ("key", "offset", "size", "message"),
    [
        ("/kiln_does_not_exist", 0, 8, "unable to open shared memory region"),
        (None, 0, NBYTES * 4, "does not fit"),  # bigger than the object
        (None, NBYTES * 2, 8, "does not fit"),  # offset past its end
        ("/../etc/passwd", 0, 8, "invalid key"),
    ],
)
def test_register_bad_regions(
    client: httpclient.InferenceServerClient,
    regions: dict,
    key: str | None,
    offset: int,
    size: int,
    message: str,
) -> None:
    tag = regions["tag"]
    with pytest.raises(InferenceServerException, match=message):
        client.register_system_shared_memory("bad", key or f"/kiln_in_{tag}", size, offset)
    assert client.get_system_shared_memory_status() == []


def test_request_outside_region_is_refused_and_memory_untouched(
    client: httpclient.InferenceServerClient, regions: dict, kiln_server: KilnProcess
) -> None:
    tag = regions["tag"]
    client.register_system_shared_memory(f"in_{tag}", f"/kiln_in_{tag}", NBYTES * 2)
    # The output window is only NBYTES: the second output would run past it.
    client.register_system_shared_memory(f"out_{tag}", f"/kiln_out_{tag}", NBYTES)
    shm.set_shared_memory_region(regions["out"], [np.full(32, -1, dtype=np.int32)])

    inputs, outputs = _simple_request(tag)
    with pytest.raises(InferenceServerException, match="outside region") as err:
        client.infer("simple", inputs, outputs=outputs)
    assert "OUTPUT1" in str(err.value)
    untouched = shm.get_contents_as_numpy(regions["out"], np.int32, [32])
    np.testing.assert_array_equal(untouched, np.full(32, -1, dtype=np.int32))

    # An input window past the end of its region.
    inputs[1].set_shared_memory(f"in_{tag}", NBYTES, offset=NBYTES * 2)
    with pytest.raises(InferenceServerException, match="outside region"):
        client.infer("simple", inputs)
    # An unknown region.
    inputs[1].set_shared_memory("nope", NBYTES)
    with pytest.raises(InferenceServerException, match="unable to find system shared memory"):
        client.infer("simple", inputs)
    # A window that is smaller than the tensor it claims to hold.
    inputs[1].set_shared_memory(f"in_{tag}", NBYTES - 4, offset=NBYTES)
    with pytest.raises(InferenceServerException, match="INPUT1"):
        client.infer("simple", inputs)

    # The server keeps serving.
    a = np.ones((1, 16), dtype=np.int32)
    good = [httpclient.InferInput("INPUT0", [1, 16], "INT32"),
            httpclient.InferInput("INPUT1", [1, 16], "INT32")]  # fmt: skip
    good[0].set_data_from_numpy(a)
    good[1].set_data_from_numpy(a)
    np.testing.assert_array_equal(client.infer("simple", good).as_numpy("OUTPUT0"), a * 2)


def test_status_codes(kiln_server: KilnProcess) -> None:
    base = f"http://{kiln_server.http_url}/v2"
    r = requests.get(f"{base}/systemsharedmemory/region/missing/status", timeout=10)
    assert r.status_code == 404
    r = requests.post(f"{base}/systemsharedmemory/region/x/register", data=b"[1]", timeout=10)
    assert r.status_code == 400
    assert "object" in r.json()["error"]
    r = requests.get(f"{base}/cudasharedmemory/status", timeout=10)
    assert r.status_code == 200
    assert r.json() == []
    r = requests.post(f"{base}/cudasharedmemory/region/g/register", json={}, timeout=10)
    assert r.status_code == 501
    assert "CUDA" in r.json()["error"]
