"""The ASGI fast path for ``/infer``: same answers, limits and errors as the Starlette route,
and everything that is not an inference POST falls through to Starlette.

Driven at the ASGI level with scripted ``receive`` messages, so body chunking and client
disconnects are exact. The wire-level behaviour is covered by the integration tests.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kiln.examples import reference_outputs
from kiln.frontends.http.app import HttpFrontend
from kiln.frontends.http.fast_infer import FastInfer
from kiln.server.server import ControlMode, Server, ServerOptions

X = np.linspace(-1, 1, 64, dtype=np.float32).reshape(1, 64)


@pytest.fixture
def server(example_repo: Path) -> AsyncIterator[Server]:
    async def make() -> Server:
        srv = Server(
            ServerOptions([example_repo], ControlMode.EXPLICIT, ["mlp"], max_request_bytes=4096)
        )
        await srv.start()
        return srv

    loop = asyncio.new_event_loop()
    srv = loop.run_until_complete(make())
    srv.loop = loop  # type: ignore[attr-defined]
    yield srv  # type: ignore[misc]
    loop.run_until_complete(srv.stop())
    loop.close()


def call(
    srv: Server, method: str, path: str, messages: list[dict[str, Any]], headers: dict[str, str]
) -> list[dict[str, Any]]:
    app = HttpFrontend(srv).app()
    assert isinstance(app, FastInfer)
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": method,
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [(k.lower().encode(), v.encode()) for k, v in headers.items()],
        "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 8000),
    }
    pending = list(messages)
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        if pending:
            return pending.pop(0)
        await asyncio.sleep(3600)  # a client that never sends more
        raise AssertionError

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    srv.loop.run_until_complete(app(scope, receive, send))  # type: ignore[attr-defined]
    return sent


def binary_body() -> tuple[bytes, dict[str, str]]:
    header = json.dumps(
        {
            "inputs": [
                {"name": "INPUT", "shape": [1, 64], "datatype": "FP32",
                 "parameters": {"binary_data_size": 256}},
            ],
            "outputs": [{"name": "LOGITS", "parameters": {"binary_data": True}}],
        }
    ).encode()  # fmt: skip
    body = header + X.tobytes()
    return body, {"inference-header-content-length": str(len(header))}


def chunks(body: bytes, n: int) -> list[dict[str, Any]]:
    step = max(1, len(body) // n)
    parts = [body[i : i + step] for i in range(0, len(body), step)]
    return [
        {"type": "http.request", "body": p, "more_body": i < len(parts) - 1}
        for i, p in enumerate(parts)
    ]


def start_of(sent: list[dict[str, Any]]) -> tuple[int, dict[bytes, bytes], bytes]:
    assert sent[0]["type"] == "http.response.start"
    return sent[0]["status"], dict(sent[0]["headers"]), sent[1]["body"]


@pytest.mark.parametrize("pieces", [1, 5])
def test_binary_infer_matches_reference_whatever_the_chunking(server: Server, pieces: int) -> None:
    body, headers = binary_body()
    sent = call(server, "POST", "/v2/models/mlp/infer", chunks(body, pieces), headers)
    status, head, out = start_of(sent)
    assert status == 200
    json_length = int(head[b"inference-header-content-length"])
    meta = json.loads(out[:json_length])
    assert meta["model_name"] == "mlp" and meta["outputs"][0]["name"] == "LOGITS"
    assert int(head[b"content-length"]) == len(out)
    logits = np.frombuffer(out[json_length:], dtype=np.float32).reshape(1, 10)
    np.testing.assert_allclose(logits, reference_outputs("mlp", {"INPUT": X})["LOGITS"], rtol=1e-5)


def test_versioned_path_and_json_body(server: Server) -> None:
    body = json.dumps(
        {"inputs": [{"name": "INPUT", "shape": [1, 64], "datatype": "FP32",
                     "data": X.ravel().tolist()}]}
    ).encode()  # fmt: skip
    sent = call(server, "POST", "/v2/models/mlp/versions/1/infer", chunks(body, 1), {})
    status, head, out = start_of(sent)
    assert status == 200 and head[b"content-type"] == b"application/json"
    assert {o["name"] for o in json.loads(out)["outputs"]} == {"LOGITS", "PROBABILITIES"}


def test_body_over_the_limit_across_chunks_is_413(server: Server) -> None:
    body = b"x" * 5000  # no Content-Length: only the running total can catch it
    status, _, out = start_of(call(server, "POST", "/v2/models/mlp/infer", chunks(body, 10), {}))
    assert status == 413
    assert "exceeds the limit of 4096 bytes" in json.loads(out)["error"]


def test_declared_length_over_the_limit_is_413_before_reading(server: Server) -> None:
    sent = call(server, "POST", "/v2/models/mlp/infer", [], {"content-length": "5000"})
    status, _, out = start_of(sent)
    assert status == 413 and "5000 bytes" in json.loads(out)["error"]


def test_unknown_model_and_bad_header_length_are_precise(server: Server) -> None:
    body, headers = binary_body()
    sent = call(server, "POST", "/v2/models/nope/infer", chunks(body, 1), headers)
    status, _, out = start_of(sent)
    assert status == 404 and "'nope'" in json.loads(out)["error"]
    bad = {"inference-header-content-length": "abc"}
    status, _, out = start_of(call(server, "POST", "/v2/models/mlp/infer", chunks(body, 1), bad))
    assert status == 400 and "must be an integer >= 0, got 'abc'" in json.loads(out)["error"]


def test_client_disconnect_mid_body_sends_nothing(server: Server) -> None:
    body, headers = binary_body()
    messages = [*chunks(body, 4)[:2], {"type": "http.disconnect"}]
    assert call(server, "POST", "/v2/models/mlp/infer", messages, headers) == []
    # ... and the model still answers the next request.
    status, _, _ = start_of(call(server, "POST", "/v2/models/mlp/infer", chunks(body, 1), headers))
    assert status == 200


def test_other_routes_and_methods_fall_through_to_starlette(server: Server) -> None:
    status, _, out = start_of(call(server, "GET", "/v2/models/mlp", [], {}))
    assert status == 200 and json.loads(out)["name"] == "mlp"
    status, _, _ = start_of(call(server, "GET", "/v2/models/mlp/infer", [], {}))
    assert status == 405  # Starlette's answer for a known path with the wrong method
