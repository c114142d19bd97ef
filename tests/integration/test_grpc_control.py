"""The non-inference RPCs over gRPC, with tritonclient, compared with what HTTP answers."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from google.protobuf import json_format
from tritonclient.grpc import model_config_pb2 as triton_config_pb2
from tritonclient.grpc import service_pb2 as triton_pb2
from tritonclient.utils import InferenceServerException

from kiln.examples import EXAMPLE_MODELS
from kiln.frontends.grpc import grpc_service_pb2 as pb
from kiln.frontends.grpc import health_pb2
from kiln.frontends.grpc.services import health_stub, inference_stub
from tests.conftest import KilnProcess

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


@pytest.fixture(scope="module")
def explicit_server(example_repo: Path) -> Iterator[KilnProcess]:
    """A private server in explicit mode (its statistics and models are this module's)."""
    server = KilnProcess(
        example_repo, args=["--model-control-mode", "explicit", "--load-model", "*"]
    ).start()
    yield server
    server.stop()


@pytest.fixture
def grpc_client(explicit_server: KilnProcess) -> grpcclient.InferenceServerClient:
    return grpcclient.InferenceServerClient(explicit_server.grpc_url)


@pytest.fixture
def http_client(explicit_server: KilnProcess) -> httpclient.InferenceServerClient:
    return httpclient.InferenceServerClient(explicit_server.http_url)


def simple_inputs(batch: int = 1) -> list[grpcclient.InferInput]:
    data = np.arange(16 * batch, dtype=np.int32).reshape(batch, 16)
    items = [grpcclient.InferInput(n, [batch, 16], "INT32") for n in ("INPUT0", "INPUT1")]
    for item in items:
        item.set_data_from_numpy(data)
    return items


def health(server: KilnProcess, service: str = "") -> int:
    with grpc.insecure_channel(server.grpc_url) as channel:
        return int(
            health_stub(channel).Check(health_pb2.HealthCheckRequest(service=service)).status
        )


def test_health_and_metadata_match_http(
    grpc_client: grpcclient.InferenceServerClient, http_client: httpclient.InferenceServerClient
) -> None:
    assert grpc_client.is_server_live() and grpc_client.is_server_ready()
    assert grpc_client.is_model_ready("simple") and grpc_client.is_model_ready("simple", "1")
    assert not grpc_client.is_model_ready("simple", "7")
    assert not grpc_client.is_model_ready("no_such_model")
    meta = grpc_client.get_server_metadata(as_json=True)
    assert meta == http_client.get_server_metadata()
    for model in ("simple", "simple_string", "mlp", "cnn"):
        grpc_meta = grpc_client.get_model_metadata(model)
        http_meta = http_client.get_model_metadata(model)
        assert json_format.ParseDict(http_meta, triton_pb2.ModelMetadataResponse()) == grpc_meta


@pytest.mark.parametrize("model", ["simple", "simple_string", "mlp", "cnn"])
def test_model_config_is_the_http_config(
    grpc_client: grpcclient.InferenceServerClient,
    http_client: httpclient.InferenceServerClient,
    model: str,
) -> None:
    config = grpc_client.get_model_config(model).config
    http_json = http_client.get_model_config(model)
    assert json_format.ParseDict(http_json, triton_config_pb2.ModelConfig()) == config
    assert config.name == model and config.max_batch_size > 0


def test_statistics_count_grpc_traffic_like_http_reports_it(
    grpc_client: grpcclient.InferenceServerClient, http_client: httpclient.InferenceServerClient
) -> None:
    def stats() -> triton_pb2.ModelStatistics:
        return grpc_client.get_inference_statistics("simple").model_stats[0]

    before = stats()
    grpc_client.infer("simple", simple_inputs(3))
    grpc_client.infer("simple", simple_inputs(2))
    after = stats()
    assert after.inference_count - before.inference_count == 5
    assert after.execution_count - before.execution_count == 2
    success = after.inference_stats.success.count - before.inference_stats.success.count
    assert success == 2
    assert after.inference_stats.compute_infer.ns > before.inference_stats.compute_infer.ns
    assert after.last_inference > 0 and after.last_inference >= before.last_inference
    # the very same numbers as HTTP, field for field
    http_stats = http_client.get_inference_statistics("simple")
    assert json_format.ParseDict(http_stats, triton_pb2.ModelStatisticsResponse()) == (
        grpc_client.get_inference_statistics("simple")
    )
    everything = grpc_client.get_inference_statistics()
    assert {s.name for s in everything.model_stats} == set(EXAMPLE_MODELS)
    with pytest.raises(InferenceServerException) as err:
        grpc_client.get_inference_statistics("no_such_model")
    assert err.value.status() == "StatusCode.NOT_FOUND"


def test_repository_index_matches_http(
    grpc_client: grpcclient.InferenceServerClient, http_client: httpclient.InferenceServerClient
) -> None:
    index = grpc_client.get_model_repository_index()
    assert (
        json_format.ParseDict(
            {"models": http_client.get_model_repository_index()},
            triton_pb2.RepositoryIndexResponse(),
        )
        == index
    )
    assert {m.name for m in index.models if m.state == "READY"} >= {"simple", "mlp"}


def test_load_with_config_override_and_files_then_unload(
    grpc_client: grpcclient.InferenceServerClient, example_repo: Path, explicit_server: KilnProcess
) -> None:
    config = json.loads(
        json.dumps(
            httpclient.InferenceServerClient(explicit_server.http_url).get_model_config("simple")
        )
    )
    # override: the same model with a smaller max_batch_size
    config["max_batch_size"] = 2
    grpc_client.load_model("simple", config=json.dumps(config))
    assert grpc_client.get_model_config("simple").config.max_batch_size == 2
    with pytest.raises(InferenceServerException) as err:
        grpc_client.infer("simple", simple_inputs(3))
    assert err.value.status() == "StatusCode.INVALID_ARGUMENT"
    assert "batch-size must be <= 2" in err.value.message()
    grpc_client.load_model("simple")  # back to its config.pbtxt
    assert grpc_client.get_model_config("simple").config.max_batch_size == 8

    # files: a model that is not in the repository at all
    config["name"] = "simple_copy"
    model_bytes = (example_repo / "simple" / "1" / "model.onnx").read_bytes()
    grpc_client.load_model(
        "simple_copy", config=json.dumps(config), files={"file:1/model.onnx": model_bytes}
    )
    assert grpc_client.is_model_ready("simple_copy")
    result = grpc_client.infer("simple_copy", simple_inputs(2))
    np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), np.zeros((2, 16), np.int32))
    grpc_client.unload_model("simple_copy")
    assert not grpc_client.is_model_ready("simple_copy")
    with pytest.raises(InferenceServerException):
        grpc_client.infer("simple_copy", simple_inputs(1))


def test_failed_load_turns_health_not_serving_until_unloaded(
    grpc_client: grpcclient.InferenceServerClient, explicit_server: KilnProcess, example_repo: Path
) -> None:
    assert health(explicit_server) == SERVING
    assert health(explicit_server, "inference.GRPCInferenceService") == SERVING
    model_bytes = (example_repo / "simple" / "1" / "model.onnx").read_bytes()
    with pytest.raises(InferenceServerException) as err:
        grpc_client.load_model(
            "broken",
            config=json.dumps({"max_batch_size": -3}),
            files={"file:1/model.onnx": model_bytes},
        )
    assert err.value.status() == "StatusCode.INVALID_ARGUMENT"
    assert "failed to load 'broken'" in err.value.message()
    assert not grpc_client.is_server_ready()
    assert health(explicit_server) == NOT_SERVING
    grpc_client.unload_model("broken")
    assert grpc_client.is_server_ready()
    assert health(explicit_server) == SERVING
    with pytest.raises(grpc.RpcError) as rpc_err:
        health(explicit_server, "no.such.Service")
    assert rpc_err.value.code() == grpc.StatusCode.NOT_FOUND


def test_load_refused_without_explicit_mode(kiln_server: KilnProcess) -> None:
    client = grpcclient.InferenceServerClient(kiln_server.grpc_url)
    with pytest.raises(InferenceServerException) as err:
        client.load_model("simple")
    assert err.value.status() == "StatusCode.UNAVAILABLE"
    assert "explicit model load / unload is not allowed" in err.value.message()
    assert client.is_model_ready("simple")


def test_trace_settings_round_trip(grpc_client: grpcclient.InferenceServerClient) -> None:
    def values(response: triton_pb2.TraceSettingResponse) -> dict[str, list[str]]:
        return {k: list(v.value) for k, v in response.settings.items()}

    glob = values(grpc_client.get_trace_settings())
    assert glob["trace_level"] == ["OFF"]
    updated = values(grpc_client.update_trace_settings(settings={"trace_rate": "50"}))
    assert updated["trace_rate"] == ["50"]
    model = values(
        grpc_client.update_trace_settings("simple", {"trace_level": ["TIMESTAMPS", "TENSORS"]})
    )
    assert model["trace_level"] == ["TIMESTAMPS", "TENSORS"] and model["trace_rate"] == ["50"]
    assert values(grpc_client.get_trace_settings("simple")) == model
    assert values(grpc_client.get_trace_settings())["trace_level"] == ["OFF"]
    cleared = values(grpc_client.update_trace_settings("simple", {"trace_level": None}))
    assert cleared["trace_level"] == ["OFF"]
    for settings, needle in (
        ({"trace_sparkle": "1"}, "unknown trace setting 'trace_sparkle'"),
        ({"trace_level": "LOUD"}, "trace_level must be one of"),
        ({"trace_rate": "often"}, "'trace_rate' must be an integer"),
    ):
        with pytest.raises(InferenceServerException) as err:
            grpc_client.update_trace_settings(settings=settings)
        assert err.value.status() == "StatusCode.INVALID_ARGUMENT" and needle in err.value.message()
    with pytest.raises(InferenceServerException) as err:
        grpc_client.get_trace_settings("no_such_model")
    assert err.value.status() == "StatusCode.NOT_FOUND"


def test_log_settings_round_trip(
    grpc_client: grpcclient.InferenceServerClient, explicit_server: KilnProcess
) -> None:
    def values(response: triton_pb2.LogSettingsResponse) -> dict[str, object]:
        return {
            k: getattr(v, v.WhichOneof("parameter_choice")) for k, v in response.settings.items()
        }

    initial = values(grpc_client.get_log_settings())
    assert initial["log_info"] is True and initial["log_verbose_level"] == 0
    changed = values(grpc_client.update_log_settings({"log_verbose_level": 1, "log_info": False}))
    assert changed["log_verbose_level"] == 1 and changed["log_info"] is False
    assert values(grpc_client.get_log_settings()) == changed
    grpc_client.update_log_settings({"log_verbose_level": 0, "log_info": True})
    with pytest.raises(InferenceServerException) as err:
        grpc_client.update_log_settings({"log_colour": True})
    assert err.value.status() == "StatusCode.INVALID_ARGUMENT"
    assert "unknown log setting 'log_colour'" in err.value.message()
    # tritonclient types each known key itself; a hand-made request can get it wrong
    bad = pb.LogSettingsRequest()
    bad.settings["log_info"].string_param = "yes"
    with (
        grpc.insecure_channel(explicit_server.grpc_url) as channel,
        pytest.raises(grpc.RpcError) as rpc_err,
    ):
        inference_stub(channel).LogSettings(bad)
    assert rpc_err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "'log_info' must be a bool, got 'yes'" in str(rpc_err.value.details())
    with pytest.raises(InferenceServerException) as err:
        grpc_client.update_log_settings({"log_file": "/tmp/elsewhere.log"})
    assert err.value.status() == "StatusCode.UNIMPLEMENTED"
