"""Triton's header forwarding behind a real ``kiln serve`` and the real Triton clients:
``--http-header-forward-pattern`` / ``--grpc-header-forward-pattern`` make the matching
headers string request parameters of infer (HTTP on the fast path and off it, gRPC unary
and streaming) and of generate; a model reads them from ``request.parameters()``, and a
rollout is sticky on one (a gateway's user id header) as on a body parameter."""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import textwrap
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from tests.conftest import KilnProcess

# Y = X; P: the request's parameters as JSON, and the version that answered
MODEL = """
import json
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def initialize(self, args):
        self.version = int(args["model_version"])

    def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "X").as_numpy()
            params = json.loads(request.parameters())
            params["answered_by"] = self.version
            p = np.array([json.dumps(params, sort_keys=True).encode()], dtype=np.object_)
            responses.append(pb_utils.InferenceResponse(
                [pb_utils.Tensor("Y", x), pb_utils.Tensor("P", p)]))
        return responses
"""

CONFIG = """
name: "echo"
backend: "python"
max_batch_size: 0
version_policy { all {} }
input [ { name: "X" data_type: TYPE_FP32 dims: [ 2 ] } ]
output [ { name: "Y" data_type: TYPE_FP32 dims: [ 2 ] } ]
output [ { name: "P" data_type: TYPE_STRING dims: [ 1 ] } ]
"""

PATTERNS = ["--http-header-forward-pattern", "^x-user-",
            "--grpc-header-forward-pattern", "^x-user-"]  # fmt: skip
HEADERS = {"X-User-Id": "alice", "X-User-Tier": "gold", "X-Other": "not this",
           "Priority": "3", "Triton_Thing": "reserved"}  # fmt: skip
FORWARDED = {"x-user-id": "alice", "x-user-tier": "gold"}
#: gRPC metadata keys are lower case (the client refuses others)
METADATA = {k.lower(): v for k, v in HEADERS.items()}


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("forward") / "models"
    for v in (1, 2):
        (root / "echo" / str(v)).mkdir(parents=True)
        (root / "echo" / str(v) / "model.py").write_text(textwrap.dedent(MODEL))
    (root / "echo" / "config.pbtxt").write_text(textwrap.dedent(CONFIG))
    return root


def _serve(repo: Path, *args: str, env: dict[str, str] | None = None) -> KilnProcess:
    saved = {k: os.environ.get(k) for k in env or {}}
    os.environ.update(env or {})
    try:
        return KilnProcess(repo, list(args)).start()
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.fixture(scope="module")
def server(repo: Path) -> Iterator[KilnProcess]:
    proc = _serve(repo, *PATTERNS)
    yield proc
    proc.stop()


def _x() -> np.ndarray:
    return np.array([1.0, 2.0], dtype=np.float32)


def _params(raw: Any) -> dict[str, Any]:
    value = raw[0]
    out: dict[str, Any] = json.loads(value.decode() if isinstance(value, bytes) else value)
    return out


def _http(server: KilnProcess, headers: dict[str, str], **kw: Any) -> dict[str, Any]:
    with httpclient.InferenceServerClient(server.http_url) as client:
        tensor = httpclient.InferInput("X", [2], "FP32")
        tensor.set_data_from_numpy(_x())
        result = client.infer("echo", [tensor], model_version="1", headers=headers, **kw)
        return _params(result.as_numpy("P"))


def _grpc(server: KilnProcess, headers: dict[str, str], **kw: Any) -> dict[str, Any]:
    client = grpcclient.InferenceServerClient(server.grpc_url)
    try:
        tensor = grpcclient.InferInput("X", [2], "FP32")
        tensor.set_data_from_numpy(_x())
        result = client.infer("echo", [tensor], model_version="1", headers=headers, **kw)
        return _params(result.as_numpy("P"))
    finally:
        client.close()


def _forwarded(params: dict[str, Any]) -> dict[str, Any]:
    """The parameters but the model's own and the HTTP client's ``binary_data_output``."""
    return {k: v for k, v in params.items() if k not in ("answered_by", "binary_data_output")}


def test_matching_headers_become_parameters_over_http(server: KilnProcess) -> None:
    assert _forwarded(_http(server, HEADERS)) == FORWARDED
    # alongside the body's own; a forwarded header wins over a body parameter of its name
    got = _http(server, HEADERS, parameters={"mine": "kept", "x-user-id": "body"})
    assert _forwarded(got) == {**FORWARDED, "mine": "kept"}
    assert _forwarded(_http(server, {"X-Other": "no"})) == {}


def test_matching_metadata_becomes_parameters_over_grpc(server: KilnProcess) -> None:
    assert _forwarded(_grpc(server, METADATA)) == FORWARDED
    got = _grpc(server, METADATA, parameters={"mine": "kept"})
    assert _forwarded(got) == {**FORWARDED, "mine": "kept"}


def test_a_grpc_stream_forwards_its_metadata_to_every_request(server: KilnProcess) -> None:
    answers: queue.Queue[Any] = queue.Queue()
    client = grpcclient.InferenceServerClient(server.grpc_url)
    try:
        client.start_stream(lambda result, error: answers.put(error or result), headers=METADATA)
        for _ in range(3):
            tensor = grpcclient.InferInput("X", [2], "FP32")
            tensor.set_data_from_numpy(_x())
            client.async_stream_infer("echo", [tensor], model_version="1")
        for _ in range(3):
            result = answers.get(timeout=60)
            assert _forwarded(_params(result.as_numpy("P"))) == FORWARDED
        client.stop_stream()
    finally:
        client.close()


def test_generate_forwards_them_too(server: KilnProcess) -> None:
    req = urllib.request.Request(
        f"http://{server.http_url}/v2/models/echo/versions/1/generate",
        data=json.dumps({"X": [1.0, 2.0]}).encode(),
        headers={"Content-Type": "application/json", **HEADERS},
    )
    with urllib.request.urlopen(req, timeout=60) as resp:
        body = json.loads(resp.read())
    assert _forwarded(json.loads(body["P"])) == FORWARDED


def test_a_rollout_is_sticky_on_a_forwarded_header(server: KilnProcess) -> None:
    """A gateway's user id header keeps each user on one version, the version the same id
    as a body parameter draws."""
    policy = {"traffic_split": "1:50,2:50", "sticky_key": "parameter:x-user-id"}
    req = urllib.request.Request(
        f"http://{server.http_url}/v2/repository/models/echo/rollout",
        data=json.dumps(policy).encode(),
    )
    with urllib.request.urlopen(req, timeout=60) as resp:
        assert resp.status == 200

    def version(headers: dict[str, str], parameters: dict[str, str] | None = None) -> int:
        with httpclient.InferenceServerClient(server.http_url) as client:
            tensor = httpclient.InferInput("X", [2], "FP32")
            tensor.set_data_from_numpy(_x())
            result = client.infer("echo", [tensor], headers=headers, parameters=parameters)
            return int(_params(result.as_numpy("P"))["answered_by"])

    by_header = {u: {version({"X-User-Id": u}) for _ in range(5)} for u in ("ann", "bo", "cy")}
    assert all(len(v) == 1 for v in by_header.values()), by_header
    users = [f"user-{i}" for i in range(24)]
    chosen = [version({"X-User-Id": u}) for u in users]
    assert chosen == [version({}, {"x-user-id": u}) for u in users]
    assert set(chosen) == {1, 2}  # 24 users over two halves: both versions drawn


def test_the_asgi_path_and_grpcio_forward_them_and_no_pattern_forwards_nothing(repo: Path) -> None:
    """``KILN_HTTP_FAST_PATH=0`` (infer through the ASGI app) and grpcio's server
    (``--grpc-implementation grpcio``) forward the same headers; a server started without
    the patterns forwards none, over HTTP and gRPC."""
    slow = _serve(repo, *PATTERNS, "--grpc-implementation", "grpcio",
                  env={"KILN_HTTP_FAST_PATH": "0"})  # fmt: skip
    try:
        assert _forwarded(_http(slow, HEADERS)) == FORWARDED
        assert _forwarded(_grpc(slow, METADATA)) == FORWARDED
    finally:
        slow.stop()
    plain = _serve(repo)
    try:
        assert _forwarded(_http(plain, HEADERS)) == {}
        assert _forwarded(_grpc(plain, METADATA)) == {}
    finally:
        plain.stop()


def test_a_bad_pattern_stops_kiln_serve_naming_the_flag(repo: Path) -> None:
    cmd = [sys.executable, "-m", "kiln", "serve", "--model-repository", str(repo),
           "--grpc-header-forward-pattern", "x-user-(", "--http-port", "0"]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "--grpc-header-forward-pattern: 'x-user-(' is not a regular expression" in done.stderr
