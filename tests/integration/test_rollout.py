"""Rollouts between the versions of one model behind a real ``kiln serve`` and real Triton
clients: the config's weighted split (HTTP) within binomial bounds, a sticky split (gRPC),
shadow isolation (a shadow that fails or sleeps changes nothing for callers, copies beyond
its queue are dropped and counted), a guarded canary promoted, and one rolled back by an
injected failing version, policies replaced at run time, and bad policies refused with the
previous one still serving."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import textwrap
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from prometheus_client.parser import text_string_to_metric_families
from tritonclient.utils import InferenceServerException

from tests.conftest import KilnProcess

# v1, v2: Y = X. v3 (the shadow): fails on X[0] == 13, else sleeps 2 s and answers X + 1.
# v4: fails every request (the bad canary).
MODEL = """
import time
import numpy as np
from prometheus_client.parser import text_string_to_metric_families
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def initialize(self, args):
        self.version = int(args["model_version"])

    def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "X").as_numpy()
            if self.version == 4 or (self.version == 3 and x[0] == 13):
                raise RuntimeError(f"version {self.version} fails")
            if self.version == 3:
                time.sleep(2.0)
                x = x + 1
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("Y", x)]))
        return responses
"""

CONFIG = """
name: "ab"
backend: "python"
max_batch_size: 0
version_policy { all {} }
input [ { name: "X" data_type: TYPE_FP32 dims: [ 4 ] } ]
output [ { name: "Y" data_type: TYPE_FP32 dims: [ 4 ] } ]
parameters { key: "rollout_traffic_split" value { string_value: "1:90,2:10" } }
"""

N = 2000


def _within(count: int, n: int, p: float, sigmas: float = 4.0) -> bool:
    return abs(count - n * p) <= sigmas * math.sqrt(n * p * (1 - p))


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KilnProcess]:
    repo = tmp_path_factory.mktemp("rollout") / "models"
    for v in (1, 2, 3, 4):
        (repo / "ab" / str(v)).mkdir(parents=True)
        (repo / "ab" / str(v) / "model.py").write_text(textwrap.dedent(MODEL))
    (repo / "ab" / "config.pbtxt").write_text(textwrap.dedent(CONFIG))
    proc = KilnProcess(repo, ["--model-control-mode=explicit", "--load-model=ab"]).start()
    yield proc
    proc.stop()


def _call(server: KilnProcess, path: str, body: Any = None) -> tuple[int, Any]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(f"http://{server.http_url}{path}", data=data)
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            raw = resp.read()
            return resp.status, json.loads(raw) if raw.strip() else None
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def _policy(server: KilnProcess, fields: dict[str, Any]) -> dict[str, Any]:
    status, body = _call(server, "/v2/repository/models/ab/rollout", fields)
    assert status == 200, body
    return body  # type: ignore[no-any-return]


def _rollout(server: KilnProcess) -> dict[str, Any]:
    status, body = _call(server, "/v2/repository/models/ab/rollout")
    assert status == 200
    return body  # type: ignore[no-any-return]


def _x(first: float = 1.0) -> np.ndarray:
    return np.array([first, 2, 3, 4], dtype=np.float32)


def _http_infer(
    client: httpclient.InferenceServerClient, x: np.ndarray, version: str = "", **kw: Any
) -> tuple[str, np.ndarray]:
    tensor = httpclient.InferInput("X", [4], "FP32")
    tensor.set_data_from_numpy(x)
    result = client.infer("ab", [tensor], model_version=version, **kw)
    return result.get_response()["model_version"], result.as_numpy("Y")


def _until(
    what: Callable[[], bool],
    timeout: float = 60.0,
    between: Callable[[], Any] = lambda: time.sleep(0.05),
) -> None:
    deadline = time.monotonic() + timeout
    while not what():
        assert time.monotonic() < deadline, "timed out"
        between()


def _metric(server: KilnProcess, name: str, labels: dict[str, str]) -> float:
    with urllib.request.urlopen(server.metrics_url, timeout=10) as resp:
        text = resp.read().decode()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and sample.labels == labels:
                return float(sample.value)
    raise AssertionError(f"no {name}{labels} in /metrics")


def _stats(server: KilnProcess) -> dict[str, int]:
    _, body = _call(server, "/v2/models/ab/stats")
    return {s["version"]: s["inference_stats"]["success"]["count"] for s in body["model_stats"]}


def test_config_split_within_binomial_bounds_http(server: KilnProcess) -> None:
    assert _rollout(server)["source"] == "config"
    before = _stats(server)
    client = httpclient.InferenceServerClient(server.http_url)
    served = []
    for _ in range(N):
        version, y = _http_infer(client, _x())
        np.testing.assert_array_equal(y, _x())
        served.append(version)
    assert set(served) == {"1", "2"}
    assert _within(served.count("2"), N, 0.10), served.count("2")
    # the statistics extension shows the split per version
    after = _stats(server)
    assert after["1"] - before["1"] == served.count("1")
    assert after["2"] - before["2"] == served.count("2")
    # a pinned version is served as named, whatever the split
    assert {_http_infer(client, _x(), "1")[0] for _ in range(20)} == {"1"}


def test_sticky_split_grpc(server: KilnProcess) -> None:
    body = _policy(server, {"traffic_split": "1:50,2:50", "sticky_key": "parameter:user_id"})
    assert body["source"] == "api" and body["weights"] == {"1": 50.0, "2": 50.0}
    client = grpcclient.InferenceServerClient(server.grpc_url)

    def version(user: str) -> str:
        tensor = grpcclient.InferInput("X", [4], "FP32")
        tensor.set_data_from_numpy(_x())
        result = client.infer("ab", [tensor], parameters={"user_id": user})
        return str(result.get_response().model_version)

    for user in ("alice", "bob", "carol"):
        assert len({version(user) for _ in range(10)}) == 1
    users = [version(f"user-{i}") for i in range(200)]
    assert _within(users.count("1"), 200, 0.5), users.count("1")


def test_shadow_that_fails_or_sleeps_changes_nothing_for_callers(server: KilnProcess) -> None:
    _policy(server, {"traffic_split": "1:1", "shadow": "3", "shadow_queue_size": "1"})
    client = httpclient.InferenceServerClient(server.http_url)
    # the shadow fails this one: the caller has the primary's answer
    version, y = _http_infer(client, _x(13))
    assert version == "1"
    np.testing.assert_array_equal(y, _x(13))
    _until(lambda: _rollout(server)["shadow"]["errors"] == 1)
    # the shadow sleeps 2 s on each: one runs, one waits, the rest are dropped
    for _ in range(10):
        version, y = _http_infer(client, _x())
        assert version == "1"
        np.testing.assert_array_equal(y, _x())

    def settled() -> bool:
        shadow = _rollout(server)["shadow"]
        return bool(shadow["compared"] >= 1 and shadow["sent"] + shadow["dropped"] == 11)

    _until(settled)
    shadow = _rollout(server)["shadow"]
    assert shadow["dropped"] >= 1
    assert shadow["sent"] + shadow["dropped"] == 11
    assert shadow["exact_agreement"] == 0.0  # it answers X + 1
    assert shadow["max_abs_diff"] == 1.0
    labels = {"model": "ab", "version": "3"}
    dropped = _metric(server, "kiln_shadow_requests_total", {**labels, "result": "dropped"})
    assert dropped == shadow["dropped"]
    assert _metric(server, "kiln_shadow_max_abs_diff", labels) == 1.0
    assert _metric(server, "kiln_shadow_agreement_total", {**labels, "kind": "exact"}) == 0
    _, live = _call(server, "/api/live")
    assert [r["model"] for r in live["rollouts"]] == ["ab"]
    assert live["rollouts"][0]["shadow"]["dropped"] == shadow["dropped"]


def _drive(server: KilnProcess, state: str) -> list[str]:
    """Unversioned requests until the rollout reaches ``state``; the versions served."""
    client = httpclient.InferenceServerClient(server.http_url)
    served: list[str] = []

    def one() -> None:
        try:
            served.append(_http_infer(client, _x())[0])
        except InferenceServerException:
            served.append("error")

    _until(lambda: _rollout(server)["state"] == state, timeout=90, between=one)
    return served


def test_canary_promoted_step_by_step(server: KilnProcess) -> None:
    body = _policy(
        server,
        {"canary": "2", "primary": "1", "steps": "20,60,100", "interval_secs": "1",
         "min_requests": "2", "max_error_rate_delta": "0.2"},  # p99: a unit test (timing)
    )  # fmt: skip
    assert body["state"] == "stepping" and body["weights"] == {"1": 80.0, "2": 20.0}
    served = _drive(server, "promoted")
    assert "error" not in served
    body = _rollout(server)
    assert [e["result"] for e in body["events"]] == ["step", "promoted"]
    assert body["weights"] == {"1": 0.0, "2": 100.0}
    client = httpclient.InferenceServerClient(server.http_url)
    assert {_http_infer(client, _x())[0] for _ in range(20)} == {"2"}
    assert _metric(server, "kiln_rollout_steps_total", {"model": "ab", "result": "promoted"}) == 1
    assert _metric(server, "kiln_rollout_weight", {"model": "ab", "version": "2"}) == 100


def test_failing_canary_rolled_back(server: KilnProcess) -> None:
    _policy(
        server,
        {"canary": "4", "primary": "1", "steps": "30,100", "interval_secs": "30",
         "min_requests": "3", "max_error_rate_delta": "0.2"},
    )  # fmt: skip
    served = _drive(server, "rolled_back")
    assert "error" in served  # the canary's callers saw its failures until the guard acted
    body = _rollout(server)
    assert body["events"][-1]["result"] == "rollback"
    assert "error rate" in body["events"][-1]["message"]
    assert body["weights"] == {"1": 100.0, "4": 0.0}
    client = httpclient.InferenceServerClient(server.http_url)
    assert {_http_infer(client, _x())[0] for _ in range(20)} == {"1"}


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({"traffic_split": "1:0,2:0"}, "traffic_split"),
        ({"traffic_split": "1:-5,2:10"}, "traffic_split"),
        ({"traffic_split": "1:1", "shadow": "9"}, "shadow"),
        ({"canary": "7", "steps": "10"}, "canary"),
        ({"canary": "2", "steps": "10", "max_p99_ratio": "fast"}, "max_p99_ratio"),
        ({"traffic_split": "1:1", "max_error_rate_delta": "0.1"}, "max_error_rate_delta"),
    ],
)
def test_bad_policy_400_previous_keeps_serving(
    server: KilnProcess, fields: dict[str, str], field: str
) -> None:
    good = _policy(server, {"traffic_split": "1:3,2:1"})
    status, body = _call(server, "/v2/repository/models/ab/rollout", fields)
    assert status == 400
    assert f"model 'ab': rollout field '{field}'" in body["error"]
    assert _rollout(server)["policy"] == good["policy"]
    client = httpclient.InferenceServerClient(server.http_url)
    assert {_http_infer(client, _x())[0] for _ in range(40)} <= {"1", "2"}


def test_unknown_model_404_and_body_must_be_object(server: KilnProcess) -> None:
    status, body = _call(server, "/v2/repository/models/nope/rollout", {"traffic_split": "1:1"})
    assert status == 404
    status, body = _call(server, "/v2/repository/models/ab/rollout", [1])
    assert status == 400 and "must be an object" in body["error"]


def test_bad_config_load_refused_previous_policy_kept(server: KilnProcess) -> None:
    good = _policy(server, {"traffic_split": "1:1"})
    config = {
        "name": "ab",
        "backend": "python",
        "max_batch_size": 0,
        "version_policy": {"all": {}},
        "input": [{"name": "X", "data_type": "TYPE_FP32", "dims": [4]}],
        "output": [{"name": "Y", "data_type": "TYPE_FP32", "dims": [4]}],
        "parameters": {"rollout_traffic_split": {"string_value": "1:10,9:1"}},
    }
    status, body = _call(
        server,
        "/v2/repository/models/ab/load",
        {"parameters": {"config": json.dumps(config)}},
    )
    assert status == 400
    assert "rollout field 'traffic_split'" in body["error"] and "'ab'" in body["error"]
    assert _rollout(server)["policy"] == good["policy"]
    client = httpclient.InferenceServerClient(server.http_url)
    assert {_http_infer(client, _x())[0] for _ in range(10)} == {"1"}


def test_kiln_repo_rollout_cli_sets_shows_and_refuses(server: KilnProcess) -> None:
    kiln = [sys.executable, "-m", "kiln", "repo", "rollout", server.http_url, "ab"]
    done = subprocess.run([*kiln, "traffic_split=1:1,2:1"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["weights"] == {"1": 1.0, "2": 1.0}
    shown = subprocess.run(kiln, capture_output=True, text=True)
    assert json.loads(shown.stdout)["policy"]["traffic_split"] == "1:1,2:1"
    bad = subprocess.run([*kiln, "traffic_split=1:-1"], capture_output=True, text=True)
    assert bad.returncode == 1 and "400" in bad.stderr and "traffic_split" in bad.stderr
    assert _rollout(server)["policy"]["traffic_split"] == "1:1,2:1"
