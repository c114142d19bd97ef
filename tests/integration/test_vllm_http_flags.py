"""vLLM's HTTP-server flags on a real ``kiln serve``: CORS with --allowed-origins,
--allowed-methods, --allowed-headers and --allow-credentials; X-Request-Id as the base of a
completion's id and, with --enable-request-id-headers, on every answer (the fast KServe
path too); and HTTP over a Unix domain socket (--uds)."""

from __future__ import annotations

import json
import os
import socket
import stat
import time
from collections.abc import Iterator

import httpx
import pytest

pytest.importorskip("transformers")

from kiln.examples import build_example_repository
from tests.conftest import KilnProcess
from tests.llm_models import build_tiny_llm

PAGE = "https://page.example"
INFER = "/v2/models/simple/infer"
HEX = frozenset("0123456789abcdef")


def _infer_body() -> bytes:
    data = [{"name": f"INPUT{i}", "shape": [1, 16], "datatype": "INT32", "data": [i] * 16}
            for i in (0, 1)]  # fmt: skip
    return json.dumps({"inputs": data}).encode()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KilnProcess]:
    home = tmp_path_factory.mktemp("vllm-http")
    repo = home / "repo"
    build_example_repository(repo, ["simple"])
    folder = build_tiny_llm(home / "tiny")
    args = [
        "--model", str(folder), "--served-model-name", "tiny", "--dtype", "float32",
        "--max-model-len", "128", "--kv-cache-memory", "1M", "--no-history",
        "--allowed-origins", json.dumps([PAGE]), "--allowed-methods", '["GET", "POST", "PUT"]',
        "--allowed-headers", '["content-type", "x-custom"]', "--allow-credentials",
        "--enable-request-id-headers",
    ]  # fmt: skip
    proc = KilnProcess(repo, args=args).start(timeout=120)
    yield proc
    proc.stop()


@pytest.fixture
def http(server: KilnProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=f"http://{server.http_url}", timeout=60) as client:
        yield client


def _fresh_id(value: str | None) -> bool:
    return value is not None and len(value) == 32 and set(value) <= HEX


def test_cors_preflight_answers_with_vllms_lists(http: httpx.Client) -> None:
    asked = {"Origin": PAGE, "Access-Control-Request-Method": "PUT",
             "Access-Control-Request-Headers": "x-custom"}  # fmt: skip
    r = http.options("/v1/completions", headers=asked)
    assert r.status_code == 200
    assert r.headers["access-control-allow-origin"] == PAGE
    assert r.headers["access-control-allow-credentials"] == "true"
    assert set(r.headers["access-control-allow-methods"].split(", ")) == {"GET", "POST", "PUT"}
    assert "x-custom" in r.headers["access-control-allow-headers"].lower()
    # a method or header not listed is refused; another origin gets no CORS answer
    r = http.options(
        "/v1/completions", headers={**asked, "Access-Control-Request-Method": "DELETE"}
    )
    assert r.status_code == 400
    r = http.options(
        "/v1/completions", headers={**asked, "Access-Control-Request-Headers": "x-api-key"}
    )
    assert r.status_code == 400
    r = http.options("/v1/completions", headers={**asked, "Origin": "https://other.example"})
    assert "access-control-allow-origin" not in r.headers


def test_cors_headers_on_an_answer_to_the_allowed_origin(http: httpx.Client) -> None:
    body = {"model": "tiny", "prompt": "a b", "max_tokens": 2}
    r = http.post("/v1/completions", json=body, headers={"Origin": PAGE})
    assert r.status_code == 200, r.text
    assert r.headers["access-control-allow-origin"] == PAGE
    assert r.headers["access-control-allow-credentials"] == "true"
    assert "x-request-id" in r.headers["access-control-expose-headers"].lower()
    # the browser guard takes --allowed-origins' origins as its own; others are refused
    r = http.post("/v1/completions", json=body, headers={"Origin": "https://evil.example"})
    assert r.status_code == 403
    assert _fresh_id(r.headers.get("x-request-id"))  # even a refusal carries the header


def test_x_request_id_names_the_completion_and_comes_back(http: httpx.Client) -> None:
    body = {"model": "tiny", "prompt": "a b", "max_tokens": 2, "request_id": "from-body"}
    r = http.post("/v1/completions", json=body, headers={"X-Request-Id": "abc-123"})
    assert r.status_code == 200, r.text
    assert r.json()["id"] == "cmpl-abc-123"  # the header over the body's request_id
    assert r.headers["x-request-id"] == "abc-123"
    r = http.post("/v1/completions", json=body)
    assert r.json()["id"] == "cmpl-from-body"
    assert _fresh_id(r.headers["x-request-id"])
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    r = http.post("/v1/chat/completions", json=chat, headers={"X-Request-Id": "c-1"})
    assert r.json()["id"] == "chatcmpl-c-1" and r.headers["x-request-id"] == "c-1"
    with http.stream("POST", "/v1/chat/completions", json={**chat, "stream": True},
                     headers={"X-Request-Id": "s-1"}) as streamed:  # fmt: skip
        assert streamed.headers["x-request-id"] == "s-1"
        chunks = [json.loads(line[6:]) for line in streamed.iter_lines()
                  if line.startswith("data: {")]  # fmt: skip
    assert chunks and {c["id"] for c in chunks} == {"chatcmpl-s-1"}
    r = http.post("/v1/completions", json={k: v for k, v in body.items() if k != "request_id"})
    rid = r.json()["id"]
    assert rid.startswith("cmpl-") and _fresh_id(rid[5:])


def test_an_overlong_x_request_id_is_refused(http: httpx.Client) -> None:
    body = {"model": "tiny", "prompt": "a", "max_tokens": 1}
    r = http.post("/v1/completions", json=body, headers={"X-Request-Id": "x" * 513})
    assert r.status_code == 400
    assert "X-Request-Id header is 513 characters long: at most 512" in r.text
    r = http.post("/v1/completions", json=body, headers={"X-Request-Id": "x" * 512})
    assert r.status_code == 200 and r.json()["id"] == "cmpl-" + "x" * 512


def test_every_route_carries_x_request_id(http: httpx.Client, server: KilnProcess) -> None:
    for path in ("/v2/health/ready", "/v1/models", "/v2/models/simple", "/no/such/route"):
        assert http.get(path, headers={"X-Request-Id": "r-" + path}).headers["x-request-id"] == (
            "r-" + path
        )
        assert _fresh_id(http.get(path).headers["x-request-id"])
    # KServe inference, answered inside the HTTP protocol (the fast path) ...
    headers = {"Content-Type": "application/json", "X-Request-Id": "k-1"}
    r = http.post(INFER, content=_infer_body(), headers=headers)
    assert r.status_code == 200 and r.headers["x-request-id"] == "k-1"
    r = http.post(INFER, content=_infer_body(), headers={"Content-Type": "application/json"})
    assert r.status_code == 200 and _fresh_id(r.headers["x-request-id"])
    r = http.post(INFER, content=b"{", headers=headers)  # its errors too
    assert r.status_code == 400 and r.headers["x-request-id"] == "k-1"
    # ... and by the ASGI app (a chunked body)
    r = http.post(INFER, content=iter([_infer_body()]), headers=headers)
    assert r.status_code == 200 and r.headers["x-request-id"] == "k-1"
    assert r.request.headers.get("transfer-encoding") == "chunked"
    # the metrics port as well
    metrics = httpx.get(server.metrics_url, headers={"X-Request-Id": "m-1"})
    assert metrics.headers["x-request-id"] == "m-1"


@pytest.fixture(scope="module")
def uds_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[KilnProcess, str]]:
    home = tmp_path_factory.mktemp("uds")
    repo = home / "repo"
    build_example_repository(repo, ["simple"])
    # a short path: sun_path holds 107 bytes
    path = f"/tmp/kiln-test-{os.getpid()}-{time.monotonic_ns()}.sock"
    args = ["--uds", path, "--no-history", "--enable-request-id-headers"]
    proc = KilnProcess(repo, args=args).start(wait_ready=False)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        assert proc.proc is not None and proc.proc.poll() is None, proc.log()
        try:
            with httpx.Client(transport=httpx.HTTPTransport(uds=path)) as c:
                if c.get("http://kiln/v2/health/ready").status_code == 200:
                    break
        except httpx.TransportError:
            time.sleep(0.1)
    else:
        pytest.fail(f"not ready on {path}:\n{proc.log()}")
    yield proc, path
    proc.stop()


def test_uds_serves_http_on_the_socket(uds_server: tuple[KilnProcess, str]) -> None:
    proc, path = uds_server
    assert stat.S_ISSOCK(os.stat(path).st_mode)
    assert f"kiln listening: HTTP unix:{path}, gRPC 127.0.0.1:{proc.grpc_port}" in proc.log()
    # nothing listens on the HTTP port
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", proc.http_port), timeout=5).close()
    # any Host: no browser can rebind a name to a socket file (and clients send made-up ones)
    with httpx.Client(transport=httpx.HTTPTransport(uds=path), timeout=30) as c:
        for host in ("kiln", "localhost", "example.com"):
            r = c.get(f"http://{host}/v2/models/simple")
            assert r.status_code == 200 and r.json()["name"] == "simple"
        headers = {"Content-Type": "application/json", "X-Request-Id": "u-1"}
        r = c.post(f"http://kiln{INFER}", content=_infer_body(), headers=headers)  # fast path
        assert r.status_code == 200, r.text
        assert r.json()["outputs"][0]["data"] == [1] * 16
        assert r.headers["x-request-id"] == "u-1"
        r = c.post(f"http://kiln{INFER}", content=iter([_infer_body()]), headers=headers)
        assert r.status_code == 200 and r.json()["outputs"][0]["data"] == [1] * 16
        # a browser's cross-site POST is still refused
        r = c.post(f"http://kiln{INFER}", content=_infer_body(),
                   headers={**headers, "Origin": "https://evil.example"})  # fmt: skip
        assert r.status_code == 403
    # metrics stay on TCP
    assert httpx.get(proc.metrics_url).status_code == 200
    # stopping removes the socket file
    assert proc.stop() == 0
    assert not os.path.exists(path)
