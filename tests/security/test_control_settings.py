"""Log and trace settings a client changes cannot leave the server unable to report them.

``log_verbose_level`` is Triton's uint32: a larger JSON integer used to be stored, after
which every gRPC ``LogSettings`` call (its answer carries the value as ``uint32_param``)
failed INTERNAL for every client until someone set it back."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import requests
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from tests.conftest import KilnProcess

UINT32_MAX = 2**32 - 1


@pytest.fixture
def base(kiln_server: KilnProcess) -> Iterator[str]:
    base = f"http://{kiln_server.http_url}"
    yield base
    requests.post(f"{base}/v2/logging", json={"log_verbose_level": 0}, timeout=30)


@pytest.mark.parametrize("level", [UINT32_MAX + 1, 2**63, 2**64 - 1])
def test_a_verbose_level_beyond_uint32_is_refused(
    base: str, kiln_server: KilnProcess, level: int
) -> None:
    response = requests.post(f"{base}/v2/logging", json={"log_verbose_level": level}, timeout=30)
    assert response.status_code == 400, response.text
    assert response.json()["error"] == (
        f"log setting 'log_verbose_level' must be an integer from 0 to {UINT32_MAX}, got {level}"
    )
    client = grpcclient.InferenceServerClient(kiln_server.grpc_url)
    try:
        settings = client.get_log_settings(as_json=True)["settings"]  # INTERNAL before
        assert settings["log_verbose_level"] == {"uint32_param": 0}
    finally:
        client.close()


def test_the_largest_uint32_level_is_taken_and_reported(
    base: str, kiln_server: KilnProcess
) -> None:
    response = requests.post(
        f"{base}/v2/logging", json={"log_verbose_level": UINT32_MAX}, timeout=30
    )
    assert response.status_code == 200, response.text
    client = grpcclient.InferenceServerClient(kiln_server.grpc_url)
    try:
        settings = client.get_log_settings(as_json=True)["settings"]
        assert settings["log_verbose_level"] == {"uint32_param": UINT32_MAX}
    finally:
        client.close()


@pytest.fixture
def trace_reset(kiln_server: KilnProcess) -> Iterator[str]:
    base = f"http://{kiln_server.http_url}"
    yield base
    requests.post(f"{base}/v2/trace/setting", json={"trace_level": None}, timeout=30)


def test_a_long_trace_level_list_is_refused(trace_reset: str, kiln_server: KilnProcess) -> None:
    """Each value was kept and repeated in every answer: 25 MB of "OFF" held 380 MB of
    the server's memory, and every later read of the settings sent 25 MB back."""
    before = requests.get(f"{trace_reset}/v2/trace/setting", timeout=30).json()["trace_level"]
    levels = ["OFF"] * 100_000
    response = requests.post(
        f"{trace_reset}/v2/trace/setting", json={"trace_level": levels}, timeout=30
    )
    assert response.status_code == 400, response.text[:200]
    assert response.json()["error"] == (
        "trace setting 'trace_level' takes at most 16 values, got 100000"
    )
    client = grpcclient.InferenceServerClient(kiln_server.grpc_url)
    try:
        with pytest.raises(InferenceServerException) as err:
            client.update_trace_settings(settings={"trace_level": levels})
        assert err.value.status() == "StatusCode.INVALID_ARGUMENT"
        assert "takes at most 16 values, got 100000" in str(err.value.message())
    finally:
        client.close()
    after = requests.get(f"{trace_reset}/v2/trace/setting", timeout=30).json()["trace_level"]
    assert after == before
    # a mistyped list is still named as before
    response = requests.post(
        f"{trace_reset}/v2/trace/setting", json={"trace_level": ["OFF", 3]}, timeout=30
    )
    assert response.status_code == 400, response.text
    assert response.json()["error"] == (
        "trace setting 'trace_level' must be a string or list of strings"
    )
