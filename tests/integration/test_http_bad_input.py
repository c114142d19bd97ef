"""Hand-made bad requests: each gets a precise error and the right status, and the server
keeps serving a good request right after."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import requests

from kiln.examples import reference_outputs
from tests.conftest import KilnProcess

ROW = list(range(16))


def _simple_body(batch: int = 1, **overrides: Any) -> dict[str, Any]:
    tensor = {"datatype": "INT32", "shape": [batch, 16], "data": [ROW] * batch}
    tensor.update(overrides)
    return {"inputs": [dict(tensor, name="INPUT0"), dict(tensor, name="INPUT1")]}


def _good_request_still_works(base: str) -> None:
    response = requests.post(f"{base}/v2/models/simple/infer", json=_simple_body(), timeout=10)
    assert response.status_code == 200, response.text
    outputs = {o["name"]: o["data"] for o in response.json()["outputs"]}
    row = np.array([ROW], dtype=np.int32)
    expected = reference_outputs("simple", {"INPUT0": row, "INPUT1": row})
    assert outputs == {k: v.ravel().tolist() for k, v in expected.items()}


@pytest.fixture
def base(kiln_server: KilnProcess) -> str:
    return f"http://{kiln_server.http_url}"


def _post(base: str, path: str, **kwargs: Any) -> requests.Response:
    return requests.post(f"{base}{path}", timeout=10, **kwargs)


CASES: list[tuple[str, str, Any, int, list[str]]] = [
    ("malformed JSON", "simple", b'{"inputs": [', 400,
     ["failed to parse the request JSON"]),
    ("body not an object", "simple", b"[1, 2, 3]", 400, ["must be an object, got array"]),
    ("missing input", "simple",
     {"inputs": _simple_body()["inputs"][:1]}, 400,
     ["expected 2 inputs but got 1", "missing required input(s) ['INPUT1']", "'simple'"]),
    ("extra input", "simple",
     {"inputs": [*_simple_body()["inputs"],
                 {"name": "INPUT9", "datatype": "INT32", "shape": [1, 16], "data": ROW}]},
     400, ["unexpected inference input 'INPUT9' for model 'simple'"]),
    ("unknown model", "nope", _simple_body(), 404, ["Request for unknown model: 'nope'"]),
    ("unknown version", "simple/versions/9", _simple_body(), 404,
     ["'simple' version 9 is not found"]),
    ("non-numeric version", "simple/versions/x", _simple_body(), 400, ["must be an integer"]),
    # int() reads these: '1_0' was version 10, '+1' and the Arabic-Indic one were 1
    ("underscored version", "simple/versions/1_0", _simple_body(), 400, ["must be an integer"]),
    ("signed version", "simple/versions/+1", _simple_body(), 400, ["must be an integer"]),
    ("non-ASCII version", "simple/versions/\u0661", _simple_body(), 400, ["must be an integer"]),
    ("unknown output", "simple", dict(_simple_body(), outputs=[{"name": "OUTPUT7"}]), 400,
     ["unexpected inference output 'OUTPUT7' for model 'simple'"]),
    ("datatype mismatch", "simple", _simple_body(datatype="FP32"), 400,
     ["datatype TYPE_FP32 for inference input 'INPUT0'", "expecting TYPE_INT32", "'simple'"]),
    ("shape and data disagree", "simple", _simple_body(shape=[1, 15]), 400,
     ["input 'INPUT0'", "shape [1, 15] expects 15 elements", "holds 16"]),
    ("wrong dims for the model", "simple", _simple_body(shape=[2, 8]), 400,
     ["unexpected shape for input 'INPUT0' for model 'simple'", "Expected [-1,16], got [2,8]"]),
    ("batch over max_batch_size", "simple", _simple_body(batch=9), 400,
     ["batch-size must be <= 8 for 'simple'"]),
    ("negative dim", "simple", _simple_body(shape=[1, -16]), 400,
     ["input 'INPUT0'", "non-negative integers", "[1, -16]"]),
    ("non-integer dim", "simple", _simple_body(shape=[1, 16.5]), 400,
     ["input 'INPUT0'", "non-negative integers"]),
    ("string dim", "simple", _simple_body(shape=["1", 16]), 400,
     ["input 'INPUT0'", "non-negative integers"]),
    ("float data for INT32", "simple", _simple_body(data=[[0.5] * 16]), 400,
     ["input 'INPUT0'", "unable to parse 'data' as INT32"]),
    ("unknown datatype", "simple", _simple_body(datatype="INT128"), 400,
     ["input 'INPUT0'", "unknown datatype 'INT128'"]),
    ("FP16 in JSON", "mlp",
     {"inputs": [{"name": "INPUT", "datatype": "FP16", "shape": [1, 64], "data": [0.0] * 64}]},
     400, ["receiving FP16 data via JSON is not supported. Please use the binary data format"]),
    ("BOOL as numbers", "simple",
     {"inputs": [{"name": "INPUT0", "datatype": "BOOL", "shape": [1], "data": [1]}]}, 400,
     ["input 'INPUT0'", "BOOL"]),
]  # fmt: skip


@pytest.mark.parametrize(
    ("model", "body", "status", "words"),
    [case[1:] for case in CASES],
    ids=[case[0] for case in CASES],
)
def test_bad_request(base: str, model: str, body: Any, status: int, words: list[str]) -> None:
    if isinstance(body, bytes):
        response = _post(base, f"/v2/models/{model}/infer", data=body)
    else:
        response = _post(base, f"/v2/models/{model}/infer", json=body)
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/json"
    error = response.json()["error"]
    for word in words:
        assert word in error
    _good_request_still_works(base)


def test_binary_header_length_errors(base: str) -> None:
    header = b'{"inputs": [{"name": "INPUT0", "datatype": "INT32", "shape": [1, 16], '
    header += b'"parameters": {"binary_data_size": 64}}]}'
    for length, words in (("abc", "must be an integer"), ("99999", "larger than the request")):
        response = _post(
            base,
            "/v2/models/simple/infer",
            data=header + bytes(64),
            headers={"Inference-Header-Content-Length": length},
        )
        assert response.status_code == 400 and words in response.json()["error"]
    _good_request_still_works(base)


def test_unknown_route_and_method(base: str) -> None:
    response = requests.get(f"{base}/v2/nonsense", timeout=10)
    assert response.status_code == 404 and response.json() == {"error": "Not Found"}
    response = requests.get(f"{base}/v2/models/simple/infer", timeout=10)
    assert response.status_code == 405
    _good_request_still_works(base)


def test_repository_index_bad_body(base: str) -> None:
    response = _post(base, "/v2/repository/index", json={"ready": "yes"})
    assert response.status_code == 400 and "'ready' must be a boolean" in response.json()["error"]
    response = _post(base, "/v2/repository/index", json={"ready": True})
    assert response.status_code == 200
    assert {r["state"] for r in response.json()} == {"READY"}


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
def test_body_over_the_limit_is_413(
    make_server: type[KilnProcess], example_repo: Path, chunked: bool
) -> None:
    limit = 4096
    server = make_server(example_repo, args=["--http-max-input-size", str(limit)]).start()
    base = f"http://{server.http_url}"
    big = b'{"inputs": [' + b" " * limit + b"]}"
    data: Any = iter([big[:100], big[100:]]) if chunked else big  # a generator: no length
    response = _post(base, "/v2/models/simple/infer", data=data)
    assert response.status_code == 413
    error = response.json()["error"]
    assert f"exceeds the limit of {limit} bytes" in error and "--http-max-input-size" in error
    _good_request_still_works(base)
