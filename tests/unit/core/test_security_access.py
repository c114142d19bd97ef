"""The access policy, API-group mapping, path checks and request limits, without a server."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from kiln.config.model_config_pb2 import ModelConfig
from kiln.config.signature import check_request_limits
from kiln.core.access import AccessConfigError, AccessPolicy, ApiGroup, Restriction
from kiln.core.errors import KilnError, Status
from kiln.core.types import DataType, InferenceRequest, InferInput
from kiln.frontends.grpc.access import GRPC_HEADER_PREFIX, rpc_group
from kiln.frontends.http.access import api_group
from kiln.repository.safety import check_config_paths, check_tree_inside


def test_restriction_parses_triton_syntax() -> None:
    r = Restriction.parse("model-repository,shared-memory:Admin-Key=s3cret", "--flag")
    assert r.groups == {ApiGroup.MODEL_REPOSITORY, ApiGroup.SHARED_MEMORY}
    assert (r.key, r.value) == ("admin-key", "s3cret")


@pytest.mark.parametrize(
    "text,fragment",
    [("inference", "expected <API>"), ("inference:key", "expected <API>"),
     ("infer:k=v", "unknown API 'infer'"), ("monitoring:k=v", "unknown API 'monitoring'")],
)  # fmt: skip
def test_restriction_refuses_bad_text(text: str, fragment: str) -> None:
    with pytest.raises(AccessConfigError, match=fragment):
        Restriction.parse(text, "--http-restricted-api")


def test_a_group_restricted_twice_is_refused() -> None:
    a = Restriction.parse("inference:a=1", "f")
    b = Restriction.parse("inference,health:b=2", "f")
    with pytest.raises(AccessConfigError, match="'inference' is restricted more than once"):
        AccessPolicy((), (a, b))


def _headers(**values: str) -> dict[str, str]:
    return {k.replace("_", "-"): v for k, v in values.items()}


def test_api_key_policy() -> None:
    policy = AccessPolicy(("k1", "k2"))
    assert policy.check(ApiGroup.HEALTH, {}.get) is None
    denial = policy.check(ApiGroup.INFERENCE, {}.get)
    assert denial is not None and denial.kind == "unauthenticated"
    assert "missing API key" in denial.message
    assert policy.check(ApiGroup.INFERENCE, _headers(authorization="Bearer k2").get) is None
    assert policy.check(ApiGroup.INFERENCE, _headers(x_api_key="k1").get) is None
    bad = policy.check(ApiGroup.MODEL_REPOSITORY, _headers(authorization="Basic k1").get)
    assert bad is not None and bad.kind == "unauthenticated"
    wrong = policy.check(ApiGroup.INFERENCE, _headers(x_api_key="k3").get)
    assert wrong is not None and wrong.message == "invalid API key"
    assert policy.check(ApiGroup.MONITORING, {}.get, ["k1"]) is None  # cookie credential


def test_restricted_messages_follow_triton() -> None:
    r = Restriction.parse("health:key=v", "f")
    http = AccessPolicy((), (r,))
    denial = http.check(ApiGroup.HEALTH, {}.get)
    assert denial is not None and denial.kind == "restricted"
    assert denial.message == "This API is restricted, expecting header 'key'"
    assert http.check(ApiGroup.HEALTH, {"key": "v"}.get) is None
    assert http.check(ApiGroup.INFERENCE, {}.get) is None
    grpc = AccessPolicy((), (r,), GRPC_HEADER_PREFIX)
    denial = grpc.check(ApiGroup.HEALTH, {"key": "v"}.get)
    assert denial is not None
    assert denial.message == (
        "This protocol is restricted, expecting header 'triton-grpc-protocol-key'"
    )
    assert grpc.check(ApiGroup.HEALTH, {"triton-grpc-protocol-key": "v"}.get) is None


#: vLLM's development / RL routes (VLLM_SERVER_DEV_MODE): model control
DEV_PATHS = (
    "/sleep", "/wake_up", "/is_sleeping", "/release_kv_cache_memory", "/pause", "/resume",
    "/is_paused", "/abort_requests", "/get_world_size", "/server_info", "/reset_prefix_cache",
    "/reset_mm_cache", "/reset_encoder_cache", "/update_weight_version", "/weight_info",
    "/init_weight_transfer_engine", "/update_weights", "/finish_weight_update",
    "/weight_checker",
)  # fmt: skip


@pytest.mark.parametrize(
    "path,group",
    [
        ("/v2/models/simple/infer", ApiGroup.INFERENCE),
        ("/v2/models/simple/versions/1/infer", ApiGroup.INFERENCE),
        ("/v2/health/ready", ApiGroup.HEALTH),
        ("/v2/models/simple/ready", ApiGroup.HEALTH),
        ("/v2", ApiGroup.METADATA),
        ("/v2/models/simple", ApiGroup.METADATA),
        ("/v2/models/simple/config", ApiGroup.MODEL_CONFIG),
        ("/v2/models/stats", ApiGroup.STATISTICS),
        ("/v2/models/simple/versions/2/stats", ApiGroup.STATISTICS),
        ("/v2/repository/index", ApiGroup.MODEL_REPOSITORY),
        ("/v2/repository/models/x/load", ApiGroup.MODEL_REPOSITORY),
        ("/v2/systemsharedmemory/region/r/register", ApiGroup.SHARED_MEMORY),
        ("/v2/cudasharedmemory/status", ApiGroup.SHARED_MEMORY),
        ("/v2/trace/setting", ApiGroup.TRACE),
        ("/v2/models/simple/trace/setting", ApiGroup.TRACE),
        ("/v2/logging", ApiGroup.LOGGING),
        ("/api/live", ApiGroup.MONITORING),
        ("/v1/completions", ApiGroup.INFERENCE),
        # vLLM's runtime LoRA loading reads server folders: restricted with model control
        ("/v1/load_lora_adapter", ApiGroup.MODEL_REPOSITORY),
        ("/v1/unload_lora_adapter", ApiGroup.MODEL_REPOSITORY),
        *((path, ApiGroup.MODEL_REPOSITORY) for path in DEV_PATHS),
        ("/sleeping", ApiGroup.MONITORING),
        ("/tokenize", ApiGroup.INFERENCE),
        ("/detokenize", ApiGroup.INFERENCE),
        ("/health", ApiGroup.HEALTH),
        ("/v1/responses/resp_1", ApiGroup.INFERENCE),
        ("/v1/models/tiny", ApiGroup.INFERENCE),
        # vLLM's SageMaker routes
        ("/ping", ApiGroup.HEALTH),
        ("/invocations", ApiGroup.INFERENCE),
        # vLLM's score and rerank APIs, beside /v1
        ("/score", ApiGroup.INFERENCE),
        ("/rerank", ApiGroup.INFERENCE),
        ("/v2/rerank", ApiGroup.INFERENCE),
        ("/pooling", ApiGroup.INFERENCE),
        ("/v1/score", ApiGroup.INFERENCE),
        ("/version", ApiGroup.METADATA),
        ("/generative_scoring", ApiGroup.INFERENCE),
        ("/v2/embed", ApiGroup.INFERENCE),
        ("/tokenizer_info", ApiGroup.METADATA),
        # vLLM's profiler writes traces into the operator's folder: restricted with trace
        ("/start_profile", ApiGroup.TRACE),
        ("/stop_profile", ApiGroup.TRACE),
        ("/v1/messages", ApiGroup.INFERENCE),
        # vLLM's scale-out API: render and derender under /v1, tokens in/out, abort
        ("/v1/chat/completions/render", ApiGroup.INFERENCE),
        ("/v1/completions/derender", ApiGroup.INFERENCE),
        ("/inference/v1/generate", ApiGroup.INFERENCE),
        ("/inference/v1/abort_requests", ApiGroup.INFERENCE),
        ("/nowhere", ApiGroup.MONITORING),
        ("/dashboard/", None),
        ("/v2/openapi.json", None),
    ],
)
def test_http_paths_map_to_triton_groups(path: str, group: ApiGroup | None) -> None:
    assert api_group(path) is group


def test_grpc_methods_map_to_triton_groups() -> None:
    svc = "/inference.GRPCInferenceService/"
    assert rpc_group(svc + "ModelStreamInfer") is ApiGroup.INFERENCE
    assert rpc_group(svc + "RepositoryModelLoad") is ApiGroup.MODEL_REPOSITORY
    assert rpc_group(svc + "SystemSharedMemoryRegister") is ApiGroup.SHARED_MEMORY
    assert rpc_group(svc + "LogSettings") is ApiGroup.LOGGING
    assert rpc_group("/grpc.health.v1.Health/Check") is ApiGroup.HEALTH


@pytest.mark.parametrize("value", ["../x.onnx", "/etc/passwd", "a/../../b", "C:\\x", "..\\x"])
def test_config_paths_refused(value: str) -> None:
    config = ModelConfig(name="m", default_model_filename=value)
    with pytest.raises(KilnError, match="default_model_filename") as info:
        check_config_paths(config, "m")
    assert info.value.status is Status.INVALID_ARG


def test_config_paths_accepted() -> None:
    config = ModelConfig(name="m", default_model_filename="sub/model.onnx")
    config.cc_model_filenames["8.0"] = "model.plan"
    check_config_paths(config, "m")


def test_tree_inside(tmp_path: Path) -> None:
    repo, outside = tmp_path / "repo", tmp_path / "outside"
    (repo / "m" / "1").mkdir(parents=True)
    outside.mkdir()
    (outside / "secret").write_text("x")
    check_tree_inside(repo / "m", repo, "m")
    (repo / "m" / "1" / "model.onnx").symlink_to(outside / "secret")
    with pytest.raises(KilnError, match=r"'m/1/model\.onnx' is a symlink that resolves outside"):
        check_tree_inside(repo / "m", repo, "m")


def _request(*shapes: tuple[int, ...]) -> InferenceRequest:
    inputs = [
        InferInput(f"IN{i}", DataType.INT32, s, np.zeros(s, np.int32)) for i, s in enumerate(shapes)
    ]
    return InferenceRequest("m", inputs=inputs)


def test_request_limits() -> None:
    check_request_limits(_request((2, 8), (16,)), 2, 16)
    check_request_limits(_request((1000,), (1000,), (1000,)), 0, 0)  # 0: no limit
    with pytest.raises(KilnError, match="has 3 inputs, more than the server's limit of 2"):
        check_request_limits(_request((1,), (1,), (1,)), 2, 0)
    with pytest.raises(KilnError, match=r"'IN1' for model 'm' has 17 elements \(shape \[17\]\)"):
        check_request_limits(_request((1,), (17,)), 0, 16)
