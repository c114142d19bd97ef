"""Explicit model control over REST with tritonclient: index, load (with config override and
files), unload, a broken config, and reloads under continuous load with no failed request."""

from __future__ import annotations

import json
import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import requests
import tritonclient.http as httpclient
import tritonclient.http.aio as aioclient
from tritonclient.utils import InferenceServerException

from kiln.examples import EXAMPLE_MODELS, reference_outputs
from tests.conftest import KilnProcess

BROKEN_LINE = 3
BROKEN_CONFIG = 'name: "broken"\nplatform: "onnxruntime_onnx"\nmax_batch_sise: 8\n'


def wait_model_ready(server: KilnProcess, model: str, timeout: float = 60.0) -> None:
    """Server readiness stays false while a model is broken (strict readiness), so wait on
    the model instead."""
    server.wait_ready(timeout, path=f"/v2/models/{model}/ready")


@pytest.fixture(scope="module")
def explicit_server(
    example_repo: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[KilnProcess]:
    repo = tmp_path_factory.mktemp("explicit") / "repo"
    shutil.copytree(example_repo, repo)
    broken = repo / "broken"
    shutil.copytree(repo / "simple" / "1", broken / "1")
    (broken / "config.pbtxt").write_text(BROKEN_CONFIG)
    args = ["--model-control-mode", "explicit", "--load-model", "simple", "--load-model", "broken"]
    server = KilnProcess(repo, args).start(wait_ready=False)
    try:
        wait_model_ready(server, "simple")
        yield server
    finally:
        server.stop()


def _simple_inputs(batch: int = 1) -> tuple[list[httpclient.InferInput], dict[str, np.ndarray]]:
    arrays = {
        "INPUT0": np.arange(16 * batch, dtype=np.int32).reshape(batch, 16),
        "INPUT1": np.full((batch, 16), 5, dtype=np.int32),
    }
    tensors = []
    for name, value in arrays.items():
        tensor = httpclient.InferInput(name, list(value.shape), "INT32")
        tensor.set_data_from_numpy(value)
        tensors.append(tensor)
    return tensors, reference_outputs("simple", arrays)


def _infer_simple(client: httpclient.InferenceServerClient, model: str = "simple") -> None:
    tensors, expected = _simple_inputs()
    result = client.infer(model, tensors)
    for name, value in expected.items():
        np.testing.assert_array_equal(result.as_numpy(name), value)


def _index(client: httpclient.InferenceServerClient) -> dict[str, dict[str, str]]:
    return {row["name"]: row for row in client.get_model_repository_index()}


def test_index_after_start(explicit_server: KilnProcess) -> None:
    client = httpclient.InferenceServerClient(explicit_server.http_url)
    index = _index(client)
    assert set(index) == {"broken", *EXAMPLE_MODELS}
    assert (index["simple"]["state"], index["simple"]["version"]) == ("READY", "1")
    broken = index["broken"]
    assert broken["state"] == "UNAVAILABLE"
    config_path = Path(explicit_server.repository) / "broken" / "config.pbtxt"
    assert f"{config_path}:{BROKEN_LINE}:" in broken["reason"]
    assert 'unknown field "max_batch_sise"' in broken["reason"]
    assert index["mlp"]["state"] != "READY"  # not asked for at start
    assert not client.is_model_ready("mlp") and not client.is_model_ready("broken")
    _infer_simple(client)


def test_load_of_broken_config_fails_with_the_parse_error(explicit_server: KilnProcess) -> None:
    client = httpclient.InferenceServerClient(explicit_server.http_url)
    with pytest.raises(InferenceServerException) as info:
        client.load_model("broken")
    assert info.value.status() == "400"
    assert "failed to load 'broken'" in info.value.message()
    assert f"config.pbtxt:{BROKEN_LINE}:" in info.value.message()
    _infer_simple(client)


def test_load_infer_unload(explicit_server: KilnProcess) -> None:
    client = httpclient.InferenceServerClient(explicit_server.http_url)
    client.load_model("simple_string")
    assert client.is_model_ready("simple_string")
    assert _index(client)["simple_string"]["state"] == "READY"
    value = np.array([[str(i).encode() for i in range(16)]], dtype=object)
    tensors = [httpclient.InferInput(n, [1, 16], "BYTES") for n in ("INPUT0", "INPUT1")]
    for t in tensors:
        t.set_data_from_numpy(value)
    result = client.infer("simple_string", tensors)
    expected = reference_outputs("simple_string", {"INPUT0": value, "INPUT1": value})
    assert result.as_numpy("OUTPUT0").tolist() == expected["OUTPUT0"].tolist()

    client.unload_model("simple_string")
    assert not client.is_model_ready("simple_string")
    row = _index(client)["simple_string"]
    assert (row["state"], row["reason"]) == ("UNAVAILABLE", "unloaded")
    with pytest.raises(InferenceServerException) as info:
        client.infer("simple_string", tensors)
    assert "unknown model" in info.value.message() and info.value.status() == "404"
    _infer_simple(client)


def test_load_unknown_model(explicit_server: KilnProcess) -> None:
    client = httpclient.InferenceServerClient(explicit_server.http_url)
    with pytest.raises(InferenceServerException) as info:
        client.load_model("nope")
    assert info.value.status() == "404"
    assert "failed to load 'nope'" in info.value.message()
    assert "nope" not in _index(client)


def test_load_with_config_override(explicit_server: KilnProcess) -> None:
    client = httpclient.InferenceServerClient(explicit_server.http_url)
    client.load_model("mlp", config=json.dumps({"max_batch_size": 2}))
    config = client.get_model_config("mlp")
    assert config["max_batch_size"] == 2
    assert [i["name"] for i in config["input"]] == ["INPUT"]  # auto-completed from the model
    batch3 = httpclient.InferInput("INPUT", [3, 64], "FP32")
    batch3.set_data_from_numpy(np.zeros((3, 64), dtype=np.float32))
    with pytest.raises(InferenceServerException) as info:
        client.infer("mlp", [batch3])
    assert "batch-size must be <= 2" in info.value.message()

    with pytest.raises(InferenceServerException) as info:
        client.load_model("mlp", config=json.dumps({"max_batch_sise": 2}))
    assert 'unknown field "max_batch_sise"' in info.value.message()
    assert client.get_model_config("mlp")["max_batch_size"] == 2  # a failed reload keeps it

    client.load_model("mlp")  # from config.pbtxt again
    assert client.get_model_config("mlp")["max_batch_size"] == 64
    client.infer("mlp", [batch3])
    client.unload_model("mlp")


def test_load_with_files(explicit_server: KilnProcess) -> None:
    client = httpclient.InferenceServerClient(explicit_server.http_url)
    onnx_bytes = (Path(explicit_server.repository) / "simple" / "1" / "model.onnx").read_bytes()
    with pytest.raises(InferenceServerException) as info:
        client.load_model("uploaded", files={"file:1/model.onnx": onnx_bytes})
    assert "'config'" in info.value.message()
    config = json.dumps({"backend": "onnxruntime", "max_batch_size": 8})
    client.load_model("uploaded", config=config, files={"file:1/model.onnx": onnx_bytes})
    assert client.is_model_ready("uploaded")
    _infer_simple(client, "uploaded")
    with pytest.raises(InferenceServerException) as info:
        client.load_model("other", config=config, files={"file:../../escape": b"x"})
    assert "escapes the model folder" in info.value.message()
    client.unload_model("uploaded")
    assert not client.is_model_ready("uploaded")


@pytest.mark.parametrize(
    "path",
    # (a literal ".." never reaches a server: clients resolve it in the URL)
    ["..%2Fetc", "%2E%2E", "%2e%2e%2f%2e%2e", "a%5Cb", ".hidden", "a%2Fb", "x%00y"],
)
@pytest.mark.parametrize("action", ["load", "unload"])
def test_model_names_that_escape_are_refused(
    explicit_server: KilnProcess, path: str, action: str
) -> None:
    url = f"http://{explicit_server.http_url}/v2/repository/models/{path}/{action}"
    response = requests.post(url, timeout=10)
    assert response.status_code == 400, response.text
    assert "invalid model name" in response.json()["error"]
    _infer_simple(httpclient.InferenceServerClient(explicit_server.http_url))


def test_reload_under_continuous_load_fails_no_request(explicit_server: KilnProcess) -> None:
    stop = threading.Event()
    served: list[int] = []  # completion order; a counter the main thread can read
    failures: list[str] = []

    def hammer() -> None:
        client = httpclient.InferenceServerClient(explicit_server.http_url)
        tensors, expected = _simple_inputs(batch=2)
        for i in range(20_000):  # bounded even if the main thread never stops us
            if stop.is_set():
                return
            try:
                result = client.infer("simple", tensors)
                np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), expected["OUTPUT0"])
                served.append(i)
            except Exception as exc:
                failures.append(repr(exc))

    threads = [threading.Thread(target=hammer) for _ in range(2)]
    for t in threads:
        t.start()
    try:
        while not served and not failures:
            time.sleep(0.01)
        client = httpclient.InferenceServerClient(explicit_server.http_url)
        before = len(served)
        for _ in range(5):
            client.load_model("simple")
            assert client.is_model_ready("simple")
        during = len(served) - before
    finally:
        stop.set()
        for t in threads:
            t.join(60)
    assert failures == []
    assert during > 0


async def test_aio_repository_api(explicit_server: KilnProcess) -> None:
    async with aioclient.InferenceServerClient(explicit_server.http_url) as client:
        await client.load_model("cnn")
        assert await client.is_model_ready("cnn")
        index = {r["name"]: r for r in await client.get_model_repository_index()}
        assert index["cnn"]["state"] == "READY"
        await client.unload_model("cnn")
        assert not await client.is_model_ready("cnn")


def test_none_mode_refuses_load(kiln_server: KilnProcess) -> None:
    client = httpclient.InferenceServerClient(kiln_server.http_url)
    with pytest.raises(InferenceServerException) as info:
        client.load_model("simple")
    assert "explicit model load / unload is not allowed" in info.value.message()
    assert info.value.status() == "503"
    response = requests.post(
        f"http://{kiln_server.http_url}/v2/repository/models/..%2Fetc/load", timeout=10
    )
    assert response.status_code == 400 and "invalid model name" in response.json()["error"]
    assert client.is_model_ready("simple")
