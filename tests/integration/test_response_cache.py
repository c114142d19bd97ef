"""Response cache end to end: kiln serve --cache-config + tritonclient (HTTP and gRPC)."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from kiln.examples import reference_outputs
from tests.conftest import KilnProcess

ENABLE = "response_cache { enable: true }\n"


TAGGED_MODEL = """
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def initialize(self, args):
        self.calls = 0

    def execute(self, requests):
        self.calls += 1
        return [pb_utils.InferenceResponse(
            [pb_utils.Tensor("Y", pb_utils.get_input_tensor_by_name(r, "X").as_numpy() + 1)],
            parameters={"calls": self.calls}) for r in requests]
"""

TAGGED_CONFIG = """
name: "py_tagged"
backend: "python"
max_batch_size: 0
input [ { name: "X" data_type: TYPE_FP32 dims: [ 2 ] } ]
output [ { name: "Y" data_type: TYPE_FP32 dims: [ 2 ] } ]
"""


def repo_with_cache(example_repo: Path, dest: Path) -> Path:
    """simple and the Python model py_tagged opt in to the cache; mlp does not."""
    repo = dest / "repo"
    repo.mkdir(parents=True)
    for model in ("simple", "mlp"):
        shutil.copytree(example_repo / model, repo / model)
    config = repo / "simple" / "config.pbtxt"
    config.write_text(config.read_text() + ENABLE)
    (repo / "py_tagged" / "1").mkdir(parents=True)
    (repo / "py_tagged" / "1" / "model.py").write_text(TAGGED_MODEL)
    (repo / "py_tagged" / "config.pbtxt").write_text(TAGGED_CONFIG + ENABLE)
    return repo


@pytest.fixture(scope="module")
def cache_server(
    example_repo: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[KilnProcess]:
    repo = repo_with_cache(example_repo, tmp_path_factory.mktemp("cache"))
    server = KilnProcess(repo, args=["--cache-config", "local,size=1048576"]).start()
    yield server
    server.stop()


def stats(server: KilnProcess, model: str) -> dict[str, Any]:
    client = httpclient.InferenceServerClient(server.http_url)
    result: dict[str, Any] = client.get_inference_statistics(model_name=model)
    return result["model_stats"][0]


def simple_inputs(seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return (
        rng.integers(-100, 100, (1, 16), dtype=np.int32),
        rng.integers(-100, 100, (1, 16), dtype=np.int32),
    )


def infer_http(server: KilnProcess, a: np.ndarray, b: np.ndarray, binary: bool) -> Any:
    client = httpclient.InferenceServerClient(server.http_url)
    items = [httpclient.InferInput(n, list(a.shape), "INT32") for n in ("INPUT0", "INPUT1")]
    items[0].set_data_from_numpy(a, binary_data=binary)
    items[1].set_data_from_numpy(b, binary_data=binary)
    return client.infer("simple", items)


def infer_grpc(server: KilnProcess, a: np.ndarray, b: np.ndarray) -> Any:
    client = grpcclient.InferenceServerClient(server.grpc_url)
    items = [grpcclient.InferInput(n, list(a.shape), "INT32") for n in ("INPUT0", "INPUT1")]
    items[0].set_data_from_numpy(a)
    items[1].set_data_from_numpy(b)
    return client.infer("simple", items)


def check_simple(result: Any, a: np.ndarray, b: np.ndarray) -> None:
    expected = reference_outputs("simple", {"INPUT0": a, "INPUT1": b})
    for name in ("OUTPUT0", "OUTPUT1"):
        np.testing.assert_array_equal(result.as_numpy(name), expected[name])


def delta(before: dict[str, Any], after: dict[str, Any]) -> dict[str, int]:
    b, a = before["inference_stats"], after["inference_stats"]
    return {
        "hit": a["cache_hit"]["count"] - b["cache_hit"]["count"],
        "miss": a["cache_miss"]["count"] - b["cache_miss"]["count"],
        "success": a["success"]["count"] - b["success"]["count"],
        "executions": after["execution_count"] - before["execution_count"],
        "inferences": after["inference_count"] - before["inference_count"],
    }


def test_same_request_twice_is_a_hit_and_runs_the_model_once(cache_server: KilnProcess) -> None:
    a, b = simple_inputs(1)
    before = stats(cache_server, "simple")
    check_simple(infer_http(cache_server, a, b, binary=True), a, b)
    check_simple(infer_http(cache_server, a, b, binary=True), a, b)
    after = stats(cache_server, "simple")
    assert delta(before, after) == {
        "hit": 1, "miss": 1, "success": 2, "executions": 1, "inferences": 1,
    }  # fmt: skip
    assert (
        after["inference_stats"]["cache_hit"]["ns"] > before["inference_stats"]["cache_hit"]["ns"]
    )
    assert (
        after["inference_stats"]["cache_miss"]["ns"] > before["inference_stats"]["cache_miss"]["ns"]
    )


def test_a_different_input_is_a_miss(cache_server: KilnProcess) -> None:
    a, b = simple_inputs(2)
    infer_http(cache_server, a, b, binary=True)
    before = stats(cache_server, "simple")
    changed = a.copy()
    changed[0, 0] += 1
    check_simple(infer_http(cache_server, changed, b, binary=True), changed, b)
    assert delta(before, stats(cache_server, "simple"))["miss"] == 1
    assert delta(before, stats(cache_server, "simple"))["executions"] == 1


def test_json_binary_and_grpc_clients_share_entries(cache_server: KilnProcess) -> None:
    a, b = simple_inputs(3)
    before = stats(cache_server, "simple")
    check_simple(infer_http(cache_server, a, b, binary=False), a, b)
    check_simple(infer_http(cache_server, a, b, binary=True), a, b)
    check_simple(infer_grpc(cache_server, a, b), a, b)
    got = delta(before, stats(cache_server, "simple"))
    assert (got["hit"], got["miss"], got["executions"]) == (2, 1, 1)


def test_model_without_response_cache_never_caches(cache_server: KilnProcess) -> None:
    data = np.random.default_rng(4).standard_normal((2, 64)).astype(np.float32)
    client = httpclient.InferenceServerClient(cache_server.http_url)
    before = stats(cache_server, "mlp")
    for _ in range(2):
        item = httpclient.InferInput("INPUT", [2, 64], "FP32")
        item.set_data_from_numpy(data)
        client.infer("mlp", [item])
    got = delta(before, stats(cache_server, "mlp"))
    assert (got["hit"], got["miss"], got["executions"]) == (0, 0, 2)


def test_bad_input_is_rejected_before_the_cache(cache_server: KilnProcess) -> None:
    client = httpclient.InferenceServerClient(cache_server.http_url)
    before = stats(cache_server, "simple")
    items = [httpclient.InferInput(n, [1, 8], "INT32") for n in ("INPUT0", "INPUT1")]
    for item in items:
        item.set_data_from_numpy(np.zeros((1, 8), np.int32))
    for _ in range(2):
        with pytest.raises(InferenceServerException) as err:
            client.infer("simple", items)
        assert err.value.status() == "400"
        assert "unexpected shape for input 'INPUT0' for model 'simple'" in err.value.message()
    got = delta(before, stats(cache_server, "simple"))
    assert (got["hit"], got["miss"], got["success"]) == (0, 0, 0)
    a, b = simple_inputs(5)
    check_simple(infer_http(cache_server, a, b, binary=True), a, b)  # still serving


def test_cache_counters_reach_the_metrics_endpoint(cache_server: KilnProcess) -> None:
    a, b = simple_inputs(6)
    infer_http(cache_server, a, b, binary=True)
    infer_http(cache_server, a, b, binary=True)
    hits = stats(cache_server, "simple")["inference_stats"]["cache_hit"]["count"]
    with urllib.request.urlopen(cache_server.metrics_url, timeout=5) as resp:
        text = resp.read().decode()
    match = re.search(r'nv_cache_num_hits_per_model\{[^}]*model="simple"[^}]*\} (\S+)', text)
    assert match is not None and float(match.group(1)) == hits >= 1


def test_enabled_model_without_a_server_cache_runs_every_request(
    example_repo: Path, tmp_path: Path, make_server: type[KilnProcess]
) -> None:
    server = make_server(repo_with_cache(example_repo, tmp_path)).start()
    a, b = simple_inputs(7)
    for _ in range(2):
        check_simple(infer_http(server, a, b, binary=True), a, b)
    after = stats(server, "simple")
    assert after["execution_count"] == 2
    assert after["inference_stats"]["cache_hit"]["count"] == 0
    assert "start kiln with --cache-config local,size=BYTES" in server.log()


def test_bad_cache_config_flag_stops_the_server_with_the_reason(example_repo: Path) -> None:
    cmd = [sys.executable, "-m", "kiln", "serve", "--model-repository", str(example_repo)]
    done = subprocess.run(
        [*cmd, "--cache-config", "memcached,host=localhost"], capture_output=True, timeout=60
    )
    assert done.returncode == 2
    assert b"--cache-config" in done.stderr
    assert b"cache 'memcached' is not supported" in done.stderr


def test_a_cached_answer_keeps_the_response_parameters(cache_server: KilnProcess) -> None:
    """A Python model's response parameters are part of its answer: a cache hit returns
    them as the model set them for the first request (``calls`` is 1 both times)."""
    client = httpclient.InferenceServerClient(cache_server.http_url)
    x = httpclient.InferInput("X", [2], "FP32")
    x.set_data_from_numpy(np.array([1, 2], np.float32))
    first = client.infer("py_tagged", [x])
    second = client.infer("py_tagged", [x])
    for result in (first, second):
        assert result.as_numpy("Y").tolist() == [2, 3]
        assert result.get_response()["parameters"] == {"calls": 1}
    assert int(stats(cache_server, "py_tagged")["inference_stats"]["cache_hit"]["count"]) == 1
