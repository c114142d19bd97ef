"""API keys, Triton's restricted API groups, CORS and request limits over HTTP and gRPC,
with the real tritonclient against ``kiln serve`` subprocesses."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import requests
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from kiln.examples import build_example_repository
from tests.conftest import KilnProcess

KEY = "s3cret-key"
# gRPC metadata keys are lowercase. Pass copies: tritonclient.http adds its own headers
# to the dict it is given.
AUTH = {"authorization": f"Bearer {KEY}"}
ADMIN = {"admin": "yes"}
GRPC_ADMIN = {"triton-grpc-protocol-admin": "yes"}
ORIGIN = "https://app.example"


@pytest.fixture(scope="module")
def secured(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KilnProcess]:
    repo = tmp_path_factory.mktemp("secured") / "models"
    build_example_repository(repo, ["simple"])
    server = KilnProcess(
        repo,
        [
            "--api-key", KEY,
            "--http-restricted-api", "model-repository,logging:admin=yes",
            "--grpc-restricted-protocol", "model-repository,logging:admin=yes",
            "--http-cors-allow-origin", ORIGIN,
            "--max-input-tensors", "2",
            "--max-tensor-elements", "16",
            "--model-control-mode", "explicit",
            "--load-model", "simple",
            "--no-history",
        ],
    ).start()  # fmt: skip
    yield server
    server.stop()


def _inputs(module: object, batch: int = 1, extra: bool = False) -> list[object]:
    data = np.arange(16 * batch, dtype=np.int32).reshape(batch, 16)
    names = ["INPUT0", "INPUT1", *(["INPUT2"] if extra else [])]
    out = []
    for name in names:
        t = module.InferInput(name, [batch, 16], "INT32")  # type: ignore[attr-defined]
        t.set_data_from_numpy(data)
        out.append(t)
    return out


# ---- API key ------------------------------------------------------------------------------
def test_http_without_key_is_401_and_health_stays_open(secured: KilnProcess) -> None:
    base = f"http://{secured.http_url}"
    for path in ("/v2", "/v2/models/simple", "/v2/models/simple/config", "/api/live"):
        r = requests.get(base + path, timeout=10)
        assert r.status_code == 401, path
        assert r.headers["WWW-Authenticate"] == "Bearer"
        assert "missing API key" in r.json()["error"]
    r = requests.get(base + "/v2", headers={"Authorization": "Bearer wrong"}, timeout=10)
    assert r.status_code == 401 and r.json()["error"] == "invalid API key"
    for path in ("/v2/health/live", "/v2/health/ready", "/v2/models/simple/ready"):
        assert requests.get(base + path, timeout=10).status_code == 200, path
    # the metrics port is Prometheus' and stays open
    assert requests.get(secured.metrics_url, timeout=10).status_code == 200


def test_http_infer_with_key(secured: KilnProcess) -> None:
    client = httpclient.InferenceServerClient(secured.http_url)
    with pytest.raises(InferenceServerException, match="missing API key"):
        client.infer("simple", _inputs(httpclient))
    for headers in (AUTH, {"x-api-key": KEY}):
        result = client.infer("simple", _inputs(httpclient), headers=dict(headers))
        data = np.arange(16, dtype=np.int32).reshape(1, 16)
        np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), data + data)
    assert client.is_server_live() and client.is_server_ready()


def test_grpc_without_key_is_unauthenticated(secured: KilnProcess) -> None:
    client = grpcclient.InferenceServerClient(secured.grpc_url)
    with pytest.raises(InferenceServerException) as info:
        client.infer("simple", _inputs(grpcclient))
    assert info.value.status() == "StatusCode.UNAUTHENTICATED"
    assert "missing API key" in info.value.message()
    with pytest.raises(InferenceServerException) as info:
        client.get_server_metadata(headers={"authorization": "Bearer nope"})
    assert info.value.status() == "StatusCode.UNAUTHENTICATED"
    assert client.is_server_live() and client.is_model_ready("simple")


def test_grpc_with_key(secured: KilnProcess) -> None:
    client = grpcclient.InferenceServerClient(secured.grpc_url)
    for headers in ({"authorization": f"Bearer {KEY}"}, {"x-api-key": KEY}):
        result = client.infer("simple", _inputs(grpcclient), headers=dict(headers))
        assert result.as_numpy("OUTPUT1").shape == (1, 16)
        assert client.get_server_metadata(headers=dict(headers)).name == "kiln"


def test_grpc_stream_needs_key(secured: KilnProcess) -> None:
    client = grpcclient.InferenceServerClient(secured.grpc_url)
    errors: list[object] = []
    client.start_stream(callback=lambda result, error: errors.append(error))
    # the refusal may close the stream before the request is even queued
    with contextlib.suppress(InferenceServerException):
        client.async_stream_infer("simple", _inputs(grpcclient))
    client.stop_stream()
    assert errors and "missing API key" in str(errors[0])
    results: list[object] = []
    client.start_stream(
        callback=lambda result, error: results.append(error or result), headers={**AUTH}
    )
    client.async_stream_infer("simple", _inputs(grpcclient))
    client.stop_stream()
    assert len(results) == 1 and results[0].as_numpy("OUTPUT0").shape == (1, 16)  # type: ignore[attr-defined]


# ---- restricted groups ---------------------------------------------------------------------
def test_http_restricted_group_needs_header(secured: KilnProcess) -> None:
    client = httpclient.InferenceServerClient(secured.http_url)
    with pytest.raises(
        InferenceServerException, match="This API is restricted, expecting header 'admin'"
    ):
        client.get_model_repository_index(headers={**AUTH})
    with pytest.raises(InferenceServerException, match="This API is restricted"):
        client.load_model("simple", headers={**AUTH, "admin": "no"})
    r = requests.get(f"http://{secured.http_url}/v2/logging", headers={**AUTH}, timeout=10)
    assert r.status_code == 403
    rows = client.get_model_repository_index(headers={**AUTH, **ADMIN})
    assert [row["name"] for row in rows] == ["simple"]
    client.load_model("simple", headers={**AUTH, **ADMIN})
    # anonymous callers never reach model control, even with the restricted header
    with pytest.raises(InferenceServerException, match="missing API key"):
        client.unload_model("simple", headers=ADMIN)
    assert client.is_model_ready("simple")


def test_grpc_restricted_protocol_needs_header(secured: KilnProcess) -> None:
    client = grpcclient.InferenceServerClient(secured.grpc_url)
    with pytest.raises(InferenceServerException) as info:
        client.get_model_repository_index(headers={**AUTH})
    assert info.value.status() == "StatusCode.UNAVAILABLE"
    assert info.value.message() == (
        "This protocol is restricted, expecting header 'triton-grpc-protocol-admin'"
    )
    with pytest.raises(InferenceServerException) as info:
        client.get_log_settings(headers={**AUTH, "admin": "yes"})  # HTTP's name is not enough
    assert info.value.status() == "StatusCode.UNAVAILABLE"
    index = client.get_model_repository_index(headers={**AUTH, **GRPC_ADMIN})
    assert [m.name for m in index.models] == ["simple"]
    assert client.get_log_settings(headers={**AUTH, **GRPC_ADMIN}).settings


# ---- CORS ----------------------------------------------------------------------------------
def test_cors_only_for_the_configured_origin(
    secured: KilnProcess, kiln_server: KilnProcess
) -> None:
    url = f"http://{secured.http_url}/v2"
    preflight = {"Origin": ORIGIN, "Access-Control-Request-Method": "GET",
                 "Access-Control-Request-Headers": "authorization"}  # fmt: skip
    r = requests.options(url, headers=preflight, timeout=10)
    assert r.status_code == 200  # answered before the key is asked for
    assert r.headers["access-control-allow-origin"] == ORIGIN
    r = requests.get(url, headers={**AUTH, "Origin": ORIGIN}, timeout=10)
    assert r.headers["access-control-allow-origin"] == ORIGIN
    r = requests.get(url, headers={**AUTH, "Origin": "https://evil.example"}, timeout=10)
    assert "access-control-allow-origin" not in r.headers
    # off by default
    r = requests.get(f"http://{kiln_server.http_url}/v2", headers={"Origin": ORIGIN}, timeout=10)
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers


# ---- auth off ------------------------------------------------------------------------------
def test_no_key_configured_means_open(kiln_server: KilnProcess) -> None:
    client = httpclient.InferenceServerClient(kiln_server.http_url)
    assert client.get_server_metadata()["name"] == "kiln"
    assert grpcclient.InferenceServerClient(kiln_server.grpc_url).get_server_metadata().name


# ---- limits --------------------------------------------------------------------------------
def test_limits_refused_alike_over_http_and_grpc(secured: KilnProcess) -> None:
    http = httpclient.InferenceServerClient(secured.http_url)
    grpc = grpcclient.InferenceServerClient(secured.grpc_url)
    cases = [
        ({"batch": 2}, "input 'INPUT0' for model 'simple' has 32 elements (shape [2,16]), more "
         "than the server's limit of 16 (--max-tensor-elements)"),
        ({"extra": True}, "inference request for model 'simple' has 3 inputs, more than the "
         "server's limit of 2 (--max-input-tensors)"),
    ]  # fmt: skip
    for kwargs, message in cases:
        with pytest.raises(InferenceServerException) as h:
            http.infer("simple", _inputs(httpclient, **kwargs), headers={**AUTH})
        assert h.value.message() == message and h.value.status() == "400"
        with pytest.raises(InferenceServerException) as g:
            grpc.infer("simple", _inputs(grpcclient, **kwargs), headers={**AUTH})
        assert g.value.message() == message
        assert g.value.status() == "StatusCode.INVALID_ARGUMENT"
    assert (
        http.infer("simple", _inputs(httpclient), headers={**AUTH}).as_numpy("OUTPUT0") is not None
    )


# ---- dashboard -----------------------------------------------------------------------------
def test_dashboard_key_cookie_opens_api_gets(secured: KilnProcess) -> None:
    base = f"http://{secured.http_url}"
    assert requests.get(base + "/dashboard/", timeout=10).status_code == 200  # the shell
    wrong = {"authorization": "Bearer wrong"}
    assert requests.post(base + "/dashboard/session", headers=wrong, timeout=10).status_code == 401
    with requests.Session() as s:
        # the page's key form: the key in a header, never in the URL
        assert s.post(base + "/dashboard/session", headers=AUTH, timeout=10).status_code == 204
        assert s.get(base + "/api/live", timeout=10).status_code == 200
        # the cookie never authorises anything but monitoring reads
        assert s.get(base + "/v2", timeout=10).status_code == 401


def test_server_keeps_serving_after_refusals(secured: KilnProcess) -> None:
    client = httpclient.InferenceServerClient(secured.http_url)
    for _ in range(3):
        with pytest.raises(InferenceServerException):
            client.infer("simple", _inputs(httpclient))
    assert (
        client.infer("simple", _inputs(httpclient), headers={**AUTH}).as_numpy("OUTPUT1")
        is not None
    )


def test_kiln_monitor_sends_the_api_key(secured: KilnProcess) -> None:
    """``kiln monitor`` against a server with API keys: refused with a hint without a key,
    served with ``--api-key`` or ``KILN_API_KEY``."""
    import os
    import subprocess
    import sys

    def monitor(*extra: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        cmd = [sys.executable, "-m", "kiln", "monitor", "live", secured.http_url, "--once",
               "--interval", "0.2", *extra]  # fmt: skip
        full_env = {k: v for k, v in os.environ.items() if k != "KILN_API_KEY"}
        full_env.update({"COLUMNS": "200", **(env or {})})
        return subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=full_env)

    refused = monitor()
    assert refused.returncode != 0
    assert "HTTP 401" in refused.stderr and "--api-key" in refused.stderr
    wrong = monitor("--api-key", "nope")
    assert wrong.returncode != 0 and "wrong API key" in wrong.stderr
    for ok in (monitor("--api-key", KEY), monitor(env={"KILN_API_KEY": KEY})):
        assert ok.returncode == 0, ok.stderr
        assert "alerts:" in ok.stdout and "simple" in ok.stdout  # a whole frame, with the model


@pytest.mark.parametrize("grpc", [False, True])
def test_kiln_bench_sends_the_api_key(secured: KilnProcess, tmp_path: Path, grpc: bool) -> None:
    """``kiln bench`` against a server with API keys: a clear failure without the key; with
    ``--api-key`` (or ``KILN_API_KEY``) every request is authorised and counted."""
    import json
    import os
    import subprocess
    import sys

    url = secured.grpc_url if grpc else secured.http_url
    flags = ["-i", "grpc"] if grpc else []
    report = tmp_path / "bench.json"

    def bench(*extra: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        cmd = [sys.executable, "-m", "kiln", "bench", "simple", "-u", url, *flags,
               "--concurrency", "1", "--duration", "0.5", "--json", str(report),
               *extra]  # fmt: skip
        drop = ("KILN_API_KEY", "OPENAI_API_KEY")
        full_env = {k: v for k, v in os.environ.items() if k not in drop}
        full_env.update(env or {})
        return subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=full_env)

    refused = bench()
    assert refused.returncode != 0
    assert "401" in refused.stderr or "UNAUTHENTICATED" in refused.stderr, refused.stderr
    for done in (bench("--api-key", KEY), bench(env={"KILN_API_KEY": KEY})):
        assert done.returncode == 0, done.stderr
        total = json.loads(report.read_text())["total"]
        assert total["requests"] > 0 and total["errors"] == 0
