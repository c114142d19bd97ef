"""Browsers as confused deputies (issue #25, finding 5): a web page the operator opens must
not drive a key-less kiln on 127.0.0.1, neither by a cross-site "simple request" (a
``text/plain`` POST needs no CORS preflight) nor by rebinding its own host name to
127.0.0.1 (DNS rebinding) to read kiln's answers. Requests are sent raw (http.client) as a
browser would send them, against a real ``kiln serve``; tritonclient, which sends neither
``Origin`` nor ``Sec-Fetch-Site``, must see no difference."""

from __future__ import annotations

import base64
import http.client
import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import tritonclient.http as httpclient

from kiln.examples import build_example_repository
from kiln.frontends.http.browser import BrowserGuard
from tests.conftest import KilnProcess

EVIL = "http://evil.example"
APP = "http://app.example"  # the CORS-allowed origin
ALLOWED_HOST = "kiln.internal"
SIMPLE = [1] * 16
INFER = json.dumps(
    {
        "inputs": [
            {"name": n, "datatype": "INT32", "shape": [1, 16], "data": SIMPLE}
            for n in ("INPUT0", "INPUT1")
        ]
    }
).encode()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KilnProcess]:
    root = tmp_path_factory.mktemp("browser") / "model_repository"
    build_example_repository(root, ["simple"])
    proc = KilnProcess(
        root,
        args=[
            "--model-control-mode", "explicit", "--load-model", "simple",
            "--http-cors-allow-origin", APP, "--http-allowed-host", ALLOWED_HOST,
            "--no-allow-grpc",
        ],
    ).start()  # fmt: skip
    yield proc
    proc.stop()


def send(
    port: int,
    method: str,
    path: str,
    body: bytes = b"",
    headers: dict[str, str] | None = None,
    host: str | None = "",
) -> tuple[int, dict[str, str], bytes]:
    """One raw request; ``host``: the Host header ("" for 127.0.0.1:port, None for none)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        conn.putrequest(method, path, skip_host=True, skip_accept_encoding=True)
        if host is not None:
            conn.putheader("Host", host or f"127.0.0.1:{port}")
        for key, value in (headers or {}).items():
            conn.putheader(key, value)
        conn.putheader("Content-Length", str(len(body)))
        conn.endheaders(body)
        resp = conn.getresponse()
        data = resp.read()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, data
    finally:
        conn.close()


def model_ready(server: KilnProcess, name: str) -> bool:
    return send(server.http_port, "GET", f"/v2/models/{name}/ready")[0] == 200


def code_load(marker: Path) -> bytes:
    """A load whose model.py runs code as the server's user: it writes ``marker``."""
    model_py = (
        f"import pathlib\npathlib.Path({str(marker)!r}).write_text('ran')\n"
        "class TritonPythonModel:\n    def execute(self, requests):\n        return []\n"
    )
    config = {
        "backend": "python",
        "max_batch_size": 0,
        "input": [{"name": "X", "data_type": "TYPE_FP32", "dims": [-1]}],
        "output": [{"name": "Y", "data_type": "TYPE_FP32", "dims": [-1]}],
    }
    params = {
        "config": json.dumps(config),
        "file:1/model.py": base64.b64encode(model_py.encode()).decode(),
    }
    return json.dumps({"parameters": params}).encode()


def test_cross_site_text_plain_load_runs_no_code(server: KilnProcess, tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    body = code_load(marker)
    path = "/v2/repository/models/evil/load"
    browser = {"Content-Type": "text/plain;charset=UTF-8", "Origin": EVIL}
    status, headers, data = send(server.http_port, "POST", path, body, browser)
    assert status == 403, data
    assert json.loads(data)["error"].startswith(f"cross-origin POST from '{EVIL}' refused")
    assert headers.get("connection") == "close"  # the unread body cannot be a next request
    assert not marker.exists() and not model_ready(server, "evil")
    # The same request without a browser's headers (as tritonclient or curl send it) loads:
    # the refusal above is what stood between the page and code execution.
    status, _, data = send(server.http_port, "POST", path, body, {"Content-Type": "text/plain"})
    assert status == 200, data
    assert marker.read_text() == "ran" and model_ready(server, "evil")
    send(server.http_port, "POST", "/v2/repository/models/evil/unload", b"{}")


STATE_CHANGES = [
    ("/v2/repository/models/simple/unload", b"{}"),
    ("/v2/repository/index", b"{}"),
    ("/v2/logging", b'{"log_verbose_level": 3}'),
    ("/v2/trace/setting", b'{"trace_level": ["TIMESTAMPS"]}'),
    ("/v2/models/simple/trace/setting", b'{"trace_rate": "1"}'),
    ("/v2/systemsharedmemory/region/r/register", b'{"key": "/x", "byte_size": 8}'),
    ("/v2/systemsharedmemory/unregister", b""),
    ("/v2/models/simple/infer", INFER),  # the fast infer path
    ("/v2/models/simple/versions/1/infer", INFER),
    ("/v2/models/simple/generate", b"{}"),
    ("/v1/completions", b'{"model": "simple", "prompt": "hi"}'),
    ("/v1/chat/completions", b'{"model": "simple", "messages": []}'),
]


@pytest.mark.parametrize(
    "browser",
    [
        {"Origin": EVIL},
        {"Origin": "null"},  # sandboxed frames, file: pages, cross-site redirects
        {"Origin": EVIL, "Sec-Fetch-Site": "cross-site"},
        {"Sec-Fetch-Site": "cross-site"},  # no Origin: still a cross-site browser request
        {"Origin": "http://localhost:1", "Sec-Fetch-Site": "same-site"},  # another local port
    ],
)
def test_cross_site_state_changes_are_refused(server: KilnProcess, browser: dict[str, str]) -> None:
    before = send(server.http_port, "GET", "/v2/logging")[2]
    for path, body in STATE_CHANGES:
        headers = {"Content-Type": "text/plain", **browser}
        for method in ("POST", "PUT", "DELETE", "PATCH"):
            status, _, data = send(server.http_port, method, path, body, headers)
            assert status == 403, (method, path, data)
            assert "refused" in json.loads(data)["error"]
    assert model_ready(server, "simple")  # not unloaded
    assert send(server.http_port, "GET", "/v2/logging")[2] == before  # settings unchanged


def test_reads_and_own_origin_and_cors_origin_pass(server: KilnProcess) -> None:
    port = server.http_port
    # A cross-origin GET changes nothing, and without CORS headers the page cannot read it.
    status, headers, _ = send(port, "GET", "/v2", headers={"Origin": EVIL})
    assert status == 200 and "access-control-allow-origin" not in headers
    # kiln's own pages (the dashboard) post same-origin.
    own = {"Origin": f"http://127.0.0.1:{port}", "Sec-Fetch-Site": "same-origin"}
    assert send(port, "POST", "/v2/repository/index", b"{}", own)[0] == 200
    # A --http-cors-allow-origin page is cross-site by nature, and allowed.
    cors = {"Origin": APP, "Sec-Fetch-Site": "cross-site", "Content-Type": "application/json"}
    status, headers, data = send(port, "POST", "/v2/models/simple/infer", INFER, cors)
    assert status == 200, data
    assert headers["access-control-allow-origin"] == APP
    assert json.loads(data)["outputs"][0]["data"] == [2] * 16


@pytest.mark.parametrize("host", ["attacker.example", "attacker.example:{port}", "127.0.0.2"])
def test_rebound_host_gets_421_on_every_port(server: KilnProcess, host: str) -> None:
    json_ct = {"Content-Type": "application/json"}
    for port, method, path, body in [
        (server.http_port, "GET", "/v2", b""),
        (server.http_port, "GET", "/v2/models/simple/config", b""),
        (server.http_port, "POST", "/v2/models/simple/infer", INFER),  # the fast path
        (server.http_port, "POST", "/v2/repository/index", b"{}"),
        (server.http_port, "GET", "/api/live", b""),
        (server.metrics_port, "GET", "/metrics", b""),
    ]:
        name = host.format(port=port)
        status, _, data = send(port, method, path, body, json_ct, host=name)
        assert status == 421, (port, path, data)
        assert json.loads(data)["error"].startswith(
            f"kiln does not answer to host '{name.partition(':')[0]}'"
        )


@pytest.mark.parametrize(
    "host", ["localhost", "localhost:{port}", "127.0.0.1", "[::1]:{port}", ALLOWED_HOST,
             ALLOWED_HOST.upper() + ":{port}", None]
)  # fmt: skip
def test_local_and_allowed_hosts_are_answered(server: KilnProcess, host: str | None) -> None:
    json_ct = {"Content-Type": "application/json"}
    for port, method, path, body in [
        (server.http_port, "GET", "/v2", b""),
        (server.http_port, "POST", "/v2/models/simple/infer", INFER),
        (server.metrics_port, "GET", "/metrics", b""),
    ]:
        name = None if host is None else host.format(port=port)
        status, _, data = send(port, method, path, body, json_ct, host=name)
        assert status == 200, (name, path, data)


def test_tritonclient_is_unaffected(server: KilnProcess) -> None:
    client = httpclient.InferenceServerClient(server.http_url)
    try:
        a = np.arange(16, dtype=np.int32).reshape(1, 16)
        inputs = [httpclient.InferInput(n, [1, 16], "INT32") for n in ("INPUT0", "INPUT1")]
        for i in inputs:
            i.set_data_from_numpy(a)
        assert (client.infer("simple", inputs).as_numpy("OUTPUT0") == a + a).all()
        client.unload_model("simple")
        assert not client.is_model_ready("simple")
        client.load_model("simple")
        assert client.is_model_ready("simple")
        client.update_log_settings({"log_verbose_level": 0})
    finally:
        client.close()


def test_explicit_mode_without_a_key_warns_at_start(server: KilnProcess) -> None:
    log = server.log()
    assert "model control mode is explicit and no API key is set" in log
    assert "a load with file: parameters runs code as this user" in log


@pytest.mark.parametrize(
    ("bind", "allowed", "host", "answered"),
    [
        ("127.0.0.1", (), "attacker.example", False),
        ("127.0.0.1", (), "LOCALHOST:8000", True),
        ("::1", (), "[::1]:8000", True),
        ("localhost", (), "[::1]", True),
        ("127.0.0.5", (), "127.0.0.5:8000", True),  # the bind address itself
        ("0.0.0.0", (), "attacker.example", True),  # no list: any name may lead here
        ("0.0.0.0", ("kiln.example:8000",), "attacker.example", False),
        ("0.0.0.0", ("kiln.example:8000",), "kiln.example", True),
        ("10.1.2.3", ("kiln.example",), "10.1.2.3:8000", True),
        ("10.1.2.3", ("kiln.example",), "[::1", False),
    ],
)
def test_which_hosts_are_answered(
    bind: str, allowed: tuple[str, ...], host: str, answered: bool
) -> None:
    """The Host rule for the binds a test cannot listen on."""
    guard = BrowserGuard.create(bind, allowed)
    assert guard.host_ok(host.encode()) is answered
    refused = guard.refusal("GET", "http", host, None, None)
    assert (refused is None) is answered
