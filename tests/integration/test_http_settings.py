"""Trace and log settings over HTTP (shared with gRPC), and the advertised extensions."""

from __future__ import annotations

from pathlib import Path

import pytest
import requests
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from tests.conftest import KilnProcess


@pytest.fixture
def server(make_server: type[KilnProcess], example_repo: Path) -> KilnProcess:
    return make_server(example_repo).start()


def test_trace_settings_round_trip_and_are_shared_with_grpc(server: KilnProcess) -> None:
    client = httpclient.InferenceServerClient(server.http_url)
    settings = client.get_trace_settings()
    assert settings["trace_level"] == ["OFF"]
    assert settings["trace_rate"] == "1000"

    updated = client.update_trace_settings(
        settings={"trace_level": ["TIMESTAMPS"], "trace_rate": "50"}
    )
    assert updated["trace_level"] == ["TIMESTAMPS"]
    assert updated["trace_rate"] == "50"

    # A per-model override, then cleared back to the global value with null.
    model = client.update_trace_settings("simple", settings={"trace_count": "7"})
    assert model["trace_count"] == "7"
    assert model["trace_rate"] == "50"
    assert client.get_trace_settings()["trace_count"] == "-1"
    cleared = client.update_trace_settings("simple", settings={"trace_count": None})
    assert cleared["trace_count"] == "-1"

    grpc = grpcclient.InferenceServerClient(server.grpc_url)
    over_grpc = grpc.get_trace_settings(as_json=True)["settings"]
    assert over_grpc["trace_rate"]["value"] == ["50"]


def test_log_settings_round_trip(server: KilnProcess) -> None:
    client = httpclient.InferenceServerClient(server.http_url)
    assert client.get_log_settings()["log_info"] is True
    assert client.update_log_settings({"log_verbose_level": 1})["log_verbose_level"] == 1
    assert client.get_log_settings()["log_verbose_level"] == 1


@pytest.mark.parametrize(
    ("path", "body", "message"),
    [
        ("/v2/trace/setting", {"trace_colour": "red"}, "unknown trace setting 'trace_colour'"),
        ("/v2/trace/setting", {"trace_level": ["LOUD"]}, "trace_level must be one of"),
        ("/v2/trace/setting", {"trace_rate": "often"}, "must be an integer"),
        # Triton's types: int() took these (a negative count, '1_0', a rate past uint32)
        (
            "/v2/trace/setting",
            {"trace_count": "-5"},
            "trace setting 'trace_count' must be an integer from -1 to 2147483647, got '-5'",
        ),
        (
            "/v2/trace/setting",
            {"trace_rate": "1_0"},
            "trace setting 'trace_rate' must be an integer from 0 to 4294967295, got '1_0'",
        ),
        (
            "/v2/trace/setting",
            {"log_frequency": "99999999999"},
            "'log_frequency' must be an integer from 0 to 4294967295",
        ),
        ("/v2/trace/setting", {"trace_rate": {"x": 1}}, "string or list of strings"),
        ("/v2/logging", {"log_info": "yes"}, "'log_info' must be a bool"),
        ("/v2/logging", {"log_volume": 3}, "unknown log setting 'log_volume'"),
    ],
)
def test_bad_settings_are_refused(
    kiln_server: KilnProcess, path: str, body: dict, message: str
) -> None:
    r = requests.post(f"http://{kiln_server.http_url}{path}", json=body, timeout=10)
    assert r.status_code == 400
    assert message in r.json()["error"]


def test_unknown_model_trace_settings(kiln_server: KilnProcess) -> None:
    client = httpclient.InferenceServerClient(kiln_server.http_url)
    with pytest.raises(InferenceServerException, match="unknown model"):
        client.get_trace_settings("nope")


def test_extensions_are_exactly_what_kiln_serves(kiln_server: KilnProcess) -> None:
    http = httpclient.InferenceServerClient(kiln_server.http_url).get_server_metadata()
    grpc = grpcclient.InferenceServerClient(kiln_server.grpc_url).get_server_metadata(as_json=True)
    assert http["extensions"] == grpc["extensions"]
    assert set(http["extensions"]) == {
        "model_repository", "model_repository(unload_dependents)", "model_configuration",
        "binary_tensor_data", "parameters",
        "statistics", "system_shared_memory", "classification", "sequence", "trace", "logging",
    }  # fmt: skip
