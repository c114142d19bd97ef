"""The real ``tritonclient.http`` (sync and aio) against ``kiln serve`` on the example models;
answers checked against onnxruntime run in-process on the same file and against NumPy."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import pytest
import tritonclient.http as httpclient
import tritonclient.http.aio as aioclient
from tritonclient.utils import InferenceServerException

from kiln.examples import EXAMPLE_MODELS, reference_outputs
from tests.conftest import KilnProcess

RNG = np.random.default_rng(7)


def _inputs(model: str, batch: int) -> dict[str, np.ndarray]:
    if model == "simple":
        return {
            "INPUT0": RNG.integers(-1000, 1000, (batch, 16), dtype=np.int32),
            "INPUT1": RNG.integers(-1000, 1000, (batch, 16), dtype=np.int32),
        }
    if model == "simple_string":
        ints = [RNG.integers(-1000, 1000, (batch, 16)) for _ in range(2)]
        return {
            f"INPUT{i}": np.vectorize(lambda v: str(v).encode(), otypes=[object])(x)
            for i, x in enumerate(ints)
        }
    if model == "mlp":
        return {"INPUT": RNG.standard_normal((batch, 64), dtype=np.float32)}
    return {"IMAGE": RNG.random((batch, 1, 28, 28), dtype=np.float32)}


def _ort(repo: Path, model: str, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    session = ort.InferenceSession(
        str(repo / model / "1" / "model.onnx"), providers=["CPUExecutionProvider"]
    )
    feed = {
        k: (v.astype(str) if v.dtype == object else v)  # ORT wants str, not bytes
        for k, v in inputs.items()
    }
    names = [o.name for o in session.get_outputs()]
    return dict(zip(names, session.run(names, feed), strict=True))


def _check(model: str, got: dict[str, Any], repo: Path, inputs: dict[str, np.ndarray]) -> None:
    expected_ort = _ort(repo, model, inputs)
    expected_ref = reference_outputs(model, inputs)
    assert set(got) == set(expected_ort) == set(expected_ref)
    for name, value in got.items():
        if value.dtype == object:
            # tritonclient hands JSON BYTES back as str, binary ones as bytes
            value = np.vectorize(
                lambda v: v.encode() if isinstance(v, str) else v, otypes=[object]
            )(value)
            assert value.tolist() == expected_ref[name].tolist()
            assert value.tolist() == np.char.encode(expected_ort[name].astype(str)).tolist()
        else:
            assert value.dtype == expected_ort[name].dtype
            np.testing.assert_allclose(value, expected_ort[name], rtol=1e-5, atol=1e-6)
            np.testing.assert_allclose(value, expected_ref[name], rtol=1e-4, atol=1e-5)


def _triton_inputs(
    module: Any, inputs: dict[str, np.ndarray], binary: bool
) -> list[httpclient.InferInput]:
    out = []
    for name, value in inputs.items():
        datatype = (
            "BYTES" if value.dtype == object else {"i": "INT32", "f": "FP32"}[value.dtype.kind]
        )
        tensor = module.InferInput(name, list(value.shape), datatype)
        tensor.set_data_from_numpy(value, binary_data=binary)
        out.append(tensor)
    return out


MODELS = {
    "simple": ["OUTPUT0", "OUTPUT1"],
    "simple_string": ["OUTPUT0", "OUTPUT1"],
    "mlp": ["LOGITS", "PROBABILITIES"],
    "cnn": ["PROBABILITIES"],
}


@pytest.mark.parametrize("binary", [False, True], ids=["json", "binary"])
@pytest.mark.parametrize("model", list(MODELS))
def test_sync_infer(kiln_server: KilnProcess, example_repo: Path, model: str, binary: bool) -> None:
    client = httpclient.InferenceServerClient(kiln_server.http_url)
    inputs = _inputs(model, batch=3)
    outputs = [httpclient.InferRequestedOutput(n, binary_data=binary) for n in MODELS[model]]
    result = client.infer(
        model, _triton_inputs(httpclient, inputs, binary), outputs=outputs, request_id="req-7"
    )
    response = result.get_response()
    assert response["model_name"] == model and response["model_version"] == "1"
    assert response["id"] == "req-7"
    for out in response["outputs"]:
        assert ("data" in out) is not binary
    _check(model, {n: result.as_numpy(n) for n in MODELS[model]}, example_repo, inputs)


@pytest.mark.parametrize("model", list(MODELS))
def test_sync_infer_client_defaults(
    kiln_server: KilnProcess, example_repo: Path, model: str
) -> None:
    # no outputs named: tritonclient asks for every output in binary
    client = httpclient.InferenceServerClient(kiln_server.http_url)
    inputs = _inputs(model, batch=2)
    result = client.infer(model, _triton_inputs(httpclient, inputs, True), model_version="1")
    _check(model, {n: result.as_numpy(n) for n in MODELS[model]}, example_repo, inputs)


@pytest.mark.parametrize("model", list(MODELS))
async def test_aio_infer(kiln_server: KilnProcess, example_repo: Path, model: str) -> None:
    async with aioclient.InferenceServerClient(kiln_server.http_url) as client:
        assert await client.is_server_live()
        assert await client.is_model_ready(model)
        for binary in (False, True):
            inputs = _inputs(model, batch=4)
            outputs = [aioclient.InferRequestedOutput(n, binary_data=binary) for n in MODELS[model]]
            result = await client.infer(
                model, _triton_inputs(aioclient, inputs, binary), outputs=outputs
            )
            _check(model, {n: result.as_numpy(n) for n in MODELS[model]}, example_repo, inputs)


def test_one_output_only(kiln_server: KilnProcess, example_repo: Path) -> None:
    client = httpclient.InferenceServerClient(kiln_server.http_url)
    inputs = _inputs("mlp", batch=1)
    result = client.infer(
        "mlp",
        _triton_inputs(httpclient, inputs, True),
        outputs=[httpclient.InferRequestedOutput("PROBABILITIES")],
    )
    assert result.as_numpy("LOGITS") is None
    expected = reference_outputs("mlp", inputs)["PROBABILITIES"]
    np.testing.assert_allclose(result.as_numpy("PROBABILITIES"), expected, rtol=1e-4, atol=1e-6)


def test_health_and_server_metadata(kiln_server: KilnProcess) -> None:
    client = httpclient.InferenceServerClient(kiln_server.http_url)
    assert client.is_server_live() and client.is_server_ready()
    meta = client.get_server_metadata()
    assert meta["name"] == "kiln" and meta["version"]
    assert {"model_repository", "binary_tensor_data", "statistics"} <= set(meta["extensions"])


async def test_aio_health_and_metadata(kiln_server: KilnProcess) -> None:
    async with aioclient.InferenceServerClient(kiln_server.http_url) as client:
        assert await client.is_server_ready()
        assert (await client.get_server_metadata())["name"] == "kiln"
        meta = await client.get_model_metadata("cnn")
        assert meta["inputs"] == [{"name": "IMAGE", "datatype": "FP32", "shape": [-1, 1, 28, 28]}]
        config = await client.get_model_config("cnn")
        assert config["max_batch_size"] == 32
        index = await client.get_model_repository_index()
        assert {r["name"] for r in index} == set(EXAMPLE_MODELS)


def test_model_metadata_and_readiness(kiln_server: KilnProcess) -> None:
    client = httpclient.InferenceServerClient(kiln_server.http_url)
    meta = client.get_model_metadata("simple")
    assert meta["name"] == "simple" and meta["versions"] == ["1"]
    assert meta["platform"] == "onnxruntime_onnx"
    assert meta["inputs"] == [
        {"name": "INPUT0", "datatype": "INT32", "shape": [-1, 16]},
        {"name": "INPUT1", "datatype": "INT32", "shape": [-1, 16]},
    ]
    assert [o["name"] for o in meta["outputs"]] == ["OUTPUT0", "OUTPUT1"]
    assert client.get_model_metadata("simple", "1") == meta
    string_meta = client.get_model_metadata("simple_string")
    assert {t["datatype"] for t in string_meta["inputs"] + string_meta["outputs"]} == {"BYTES"}
    assert client.is_model_ready("simple") and client.is_model_ready("simple", "1")
    assert not client.is_model_ready("simple", "2")
    assert not client.is_model_ready("nope")
    with pytest.raises(InferenceServerException) as info:
        client.get_model_metadata("nope")
    assert "Request for unknown model: 'nope'" in info.value.message()
    assert info.value.status() == "404"


def test_model_config_is_the_completed_one(kiln_server: KilnProcess) -> None:
    client = httpclient.InferenceServerClient(kiln_server.http_url)
    config = client.get_model_config("simple")
    assert config["name"] == "simple" and config["max_batch_size"] == 8
    assert config["input"][0]["data_type"] == "TYPE_INT32"
    assert config["input"][0]["dims"] == [16]
    assert config["instance_group"][0]["kind"] == "KIND_CPU"
    # auto-complete's additions: the backend, the file name, dynamic_batching for batch > 1
    assert config["backend"] == "onnxruntime"
    assert config["default_model_filename"] == "model.onnx"
    assert "dynamic_batching" in config
    assert client.get_model_config("simple", "1") == config
    mlp = client.get_model_config("mlp")
    assert mlp["output"][1]["label_filename"] == "labels.txt"


def test_statistics_move_after_requests(kiln_server: KilnProcess) -> None:
    client = httpclient.InferenceServerClient(kiln_server.http_url)

    def mlp_stats() -> dict[str, Any]:
        (stats,) = client.get_inference_statistics("mlp")["model_stats"]
        return stats

    before = mlp_stats()
    for batch in (1, 3):
        client.infer("mlp", _triton_inputs(httpclient, _inputs("mlp", batch), True))
    with pytest.raises(InferenceServerException):  # a refused request counts nowhere
        client.infer(
            "mlp", _triton_inputs(httpclient, {"INPUT": np.zeros((1, 3), np.float32)}, True)
        )
    after = mlp_stats()
    assert after["name"] == "mlp" and after["version"] == "1"
    assert after["inference_count"] == before["inference_count"] + 4
    assert after["execution_count"] == before["execution_count"] + 2
    success = after["inference_stats"]["success"]
    assert success["count"] == before["inference_stats"]["success"]["count"] + 2
    assert success["ns"] > before["inference_stats"]["success"]["ns"]
    assert after["last_inference"] >= before["last_inference"] and after["last_inference"] > 0
    assert {b["batch_size"] for b in after["batch_stats"]} >= {1, 3}
    assert client.get_inference_statistics("mlp", "1")["model_stats"] == [after]
    every = client.get_inference_statistics()["model_stats"]
    assert {s["name"] for s in every} == set(EXAMPLE_MODELS)
    with pytest.raises(InferenceServerException) as info:
        client.get_inference_statistics("nope")
    assert info.value.status() == "404"
