"""Ensembles end to end with tritonclient (HTTP and gRPC) against ``kiln serve``: the
cnn_pipeline example against its composing models run in-process, statistics per step, a
failing step, explicit-mode loading, and broken ensemble configs in the repository index."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import requests
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from onnx import TensorProto, helper, numpy_helper
from tritonclient.utils import InferenceServerException

from kiln.examples import reference_outputs
from tests.conftest import KilnProcess
from tests.onnx_models import IR_VERSION, OPSET, identity_model

PIPELINE = ("image_preprocess", "cnn", "postprocess")
OUTPUTS = ("CLASS", "SCORE", "PROBABILITIES")


def _images(batch: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (batch, 28, 28, 1), dtype=np.uint8)


def _in_process(repo: Path, images: np.ndarray) -> dict[str, np.ndarray]:
    """The three composing models run one after the other with onnxruntime."""

    def run(model: str, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        path = str(repo / model / "1" / "model.onnx")
        return list(ort.InferenceSession(path, providers=["CPUExecutionProvider"]).run(None, feeds))

    (normalized,) = run("image_preprocess", {"IMAGE": images})
    (probabilities,) = run("cnn", {"IMAGE": normalized})
    cls, score = run("postprocess", {"PROBABILITIES": probabilities})
    return {"CLASS": cls, "SCORE": score, "PROBABILITIES": probabilities}


def _infer(module: Any, client: Any, model: str, arrays: dict[str, np.ndarray]) -> Any:
    items = []
    for name, array in arrays.items():
        datatype = {np.uint8: "UINT8", np.float32: "FP32"}[array.dtype.type]
        item = module.InferInput(name, list(array.shape), datatype)
        item.set_data_from_numpy(array)
        items.append(item)
    return client.infer(model, items)


def _success(stats: dict[str, Any], model: str) -> int:
    rows = [m for m in stats["model_stats"] if m["name"] == model]
    return sum(int(m["inference_stats"]["success"]["count"]) for m in rows)


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_pipeline_matches_composing_models_in_process(
    kiln_server: KilnProcess, example_repo: Path, protocol: str
) -> None:
    module: Any = httpclient if protocol == "http" else grpcclient
    url = kiln_server.http_url if protocol == "http" else kiln_server.grpc_url
    client = module.InferenceServerClient(url)
    images = _images(5, seed=7)
    result = _infer(module, client, "cnn_pipeline", {"IMAGE": images})
    expected = _in_process(example_repo, images)
    for name in OUTPUTS:
        got = result.as_numpy(name)
        assert got.dtype == expected[name].dtype and got.shape == expected[name].shape, name
        np.testing.assert_allclose(got, expected[name], rtol=1e-6, atol=1e-7, err_msg=name)
    # and the NumPy-only reference of the example repository agrees too
    np.testing.assert_array_equal(
        result.as_numpy("CLASS"), reference_outputs("cnn_pipeline", {"IMAGE": images})["CLASS"]
    )


def test_statistics_count_every_composing_model(kiln_server: KilnProcess) -> None:
    client = httpclient.InferenceServerClient(kiln_server.http_url)
    models = ("cnn_pipeline", *PIPELINE)
    before = client.get_inference_statistics()
    for batch in (1, 3):
        _infer(httpclient, client, "cnn_pipeline", {"IMAGE": _images(batch)})
    after = client.get_inference_statistics()
    for model in models:
        assert _success(after, model) - _success(before, model) == 2, model
    (row,) = client.get_inference_statistics("cnn_pipeline")["model_stats"]
    assert row["inference_stats"]["fail"]["count"] == 0


def test_metadata_is_the_ensemble_config(kiln_server: KilnProcess) -> None:
    client = httpclient.InferenceServerClient(kiln_server.http_url)
    metadata = client.get_model_metadata("cnn_pipeline")
    assert metadata["platform"] == "ensemble"
    assert metadata["inputs"] == [{"name": "IMAGE", "datatype": "UINT8", "shape": [-1, 28, 28, 1]}]
    assert [o["name"] for o in metadata["outputs"]] == list(OUTPUTS)
    config = client.get_model_config("cnn_pipeline")
    assert [s["model_name"] for s in config["ensemble_scheduling"]["step"]] == list(PIPELINE)


def test_bad_input_is_refused_by_the_ensemble_itself(kiln_server: KilnProcess) -> None:
    client = httpclient.InferenceServerClient(kiln_server.http_url)
    floats = np.zeros((1, 28, 28, 1), np.float32)
    with pytest.raises(InferenceServerException) as info:
        _infer(httpclient, client, "cnn_pipeline", {"IMAGE": floats})
    assert info.value.status() == "400"
    assert "TYPE_FP32" in info.value.message() and "'cnn_pipeline'" in info.value.message()


# ---- a private repository: a step that fails at run time, and broken ensembles --------


def _add4_model(path: Path) -> None:
    """``Y = X + [1, 2, 3, 4]``: onnxruntime refuses any X whose length is not 1 or 4."""
    graph = helper.make_graph(
        [helper.make_node("Add", ["X", "four"], ["Y"])],
        "add4",
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["n"])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["m"])],
        initializer=[numpy_helper.from_array(np.arange(1, 5, dtype=np.float32), "four")],
    )
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", OPSET)], ir_version=IR_VERSION
    )
    path.parent.mkdir(parents=True)
    onnx.save_model(model, path)


def _vector_model_config(name: str, inputs: str, outputs: str) -> str:
    return f"""
name: "{name}"
platform: "onnxruntime_onnx"
input [ {{ name: "{inputs}" data_type: TYPE_FP32 dims: [ -1 ] }} ]
output [ {{ name: "{outputs}" data_type: TYPE_FP32 dims: [ -1 ] }} ]
"""


def _ensemble_config(name: str, steps: str) -> str:
    return f"""
name: "{name}"
platform: "ensemble"
input [ {{ name: "X" data_type: TYPE_FP32 dims: [ -1 ] }} ]
output [ {{ name: "Y" data_type: TYPE_FP32 dims: [ -1 ] }} ]
ensemble_scheduling {{ step [ {steps} ] }}
"""


def _step(model: str, model_input: str, source: str, model_output: str, target: str) -> str:
    return (
        f'{{ model_name: "{model}" input_map {{ key: "{model_input}" value: "{source}" }} '
        f'output_map {{ key: "{model_output}" value: "{target}" }} }}'
    )


ENSEMBLES = {
    "fragile": [
        _step("identity", "INPUT", "X", "OUT0", "copied"),
        _step("add4", "X", "copied", "Y", "Y"),
    ],
    # identity reads what add4 writes and add4 reads what identity writes
    "cyclic": [
        _step("identity", "INPUT", "Y", "OUT0", "a"),
        _step("add4", "X", "a", "Y", "Y"),
    ],
    "gap": [_step("add4", "X", "nowhere", "Y", "Y")],
}


@pytest.fixture(scope="module")
def private_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KilnProcess]:
    repo = tmp_path_factory.mktemp("ensembles") / "repo"
    identity_model(repo / "identity" / "1" / "model.onnx", [("INPUT", TensorProto.FLOAT, ["n"])])
    (repo / "identity" / "config.pbtxt").write_text(
        _vector_model_config("identity", "INPUT", "OUT0")
    )
    _add4_model(repo / "add4" / "1" / "model.onnx")
    (repo / "add4" / "config.pbtxt").write_text(_vector_model_config("add4", "X", "Y"))
    for name, steps in ENSEMBLES.items():
        (repo / name / "1").mkdir(parents=True)
        (repo / name / "config.pbtxt").write_text(_ensemble_config(name, ", ".join(steps)))
    # the broken ensembles keep the server from being ready under strict readiness
    server = KilnProcess(repo, ["--no-strict-readiness"]).start()
    yield server
    server.stop()


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_failing_step_names_its_model_and_the_server_keeps_serving(
    private_server: KilnProcess, protocol: str
) -> None:
    module: Any = httpclient if protocol == "http" else grpcclient
    url = private_server.http_url if protocol == "http" else private_server.grpc_url
    client = module.InferenceServerClient(url)
    with pytest.raises(InferenceServerException) as info:
        _infer(module, client, "fragile", {"X": np.zeros(3, np.float32)})
    message = info.value.message()
    assert message.startswith("in ensemble 'fragile', step 1 model 'add4' failed: "), message
    assert "model 'add4' failed to execute" in message
    assert info.value.status() == ("500" if protocol == "http" else "StatusCode.INTERNAL")
    result = _infer(module, client, "fragile", {"X": np.ones(4, np.float32)})
    np.testing.assert_array_equal(result.as_numpy("Y"), np.arange(2, 6, dtype=np.float32))
    as_json = {"as_json": True} if protocol == "grpc" else {}
    (row,) = client.get_inference_statistics("fragile", **as_json)["model_stats"]
    assert int(row["inference_stats"]["fail"]["count"]) >= 1


def test_broken_ensembles_are_unavailable_with_the_reason(private_server: KilnProcess) -> None:
    client = httpclient.InferenceServerClient(private_server.http_url)
    index = {row["name"]: row for row in client.get_model_repository_index()}
    assert index["fragile"]["state"] == "READY"
    cyclic, gap = index["cyclic"], index["gap"]
    assert cyclic["state"] == gap["state"] == "UNAVAILABLE"
    assert (
        "in ensemble 'cyclic', steps form a cycle: step 0 (model 'identity') -> 'a' -> "
        "step 1 (model 'add4') -> 'Y' -> step 0 (model 'identity')" in cyclic["reason"]
    )
    assert (
        "in ensemble 'gap', step 0 (model 'add4') input 'X' reads tensor 'nowhere', which is "
        "neither an ensemble input nor an output of any step" in gap["reason"]
    )
    assert not client.is_model_ready("cyclic") and not client.is_model_ready("gap")
    with pytest.raises(InferenceServerException) as info:
        _infer(httpclient, client, "gap", {"X": np.ones(4, np.float32)})
    assert "gap" in info.value.message()


# ---- explicit model control: the ensemble brings its composing models ------------------


@pytest.fixture
def explicit_server(
    example_repo: Path, tmp_path: Path, make_server: type[KilnProcess]
) -> KilnProcess:
    repo = tmp_path / "repo"
    for model in (*PIPELINE, "cnn_pipeline", "mlp"):
        shutil.copytree(example_repo / model, repo / model)
    return make_server(repo, args=["--model-control-mode", "explicit"]).start()


def test_explicit_load_of_the_ensemble_loads_its_composing_models(
    explicit_server: KilnProcess, example_repo: Path
) -> None:
    client = grpcclient.InferenceServerClient(explicit_server.grpc_url)
    assert not client.is_model_ready("cnn")
    client.load_model("cnn_pipeline")
    index = {m.name: m.state for m in client.get_model_repository_index().models}
    assert all(index[m] == "READY" for m in ("cnn_pipeline", *PIPELINE)), index
    assert index["mlp"] != "READY"  # only what the ensemble composes
    images = _images(2, seed=3)
    result = _infer(grpcclient, client, "cnn_pipeline", {"IMAGE": images})
    np.testing.assert_array_equal(
        result.as_numpy("CLASS"), _in_process(example_repo, images)["CLASS"]
    )

    # Unloading a composing model: the ensemble's requests fail UNAVAILABLE, naming it.
    http = httpclient.InferenceServerClient(explicit_server.http_url)
    http.unload_model("cnn")
    with pytest.raises(InferenceServerException) as info:
        _infer(httpclient, http, "cnn_pipeline", {"IMAGE": images})
    assert info.value.status() == "503"
    assert "step 1 model 'cnn' failed" in info.value.message()
    http.load_model("cnn")  # back again: the ensemble serves with no reload of its own
    result = _infer(httpclient, http, "cnn_pipeline", {"IMAGE": images})
    np.testing.assert_array_equal(
        result.as_numpy("CLASS"), _in_process(example_repo, images)["CLASS"]
    )


def test_unload_dependents_unloads_the_composing_models_the_ensemble_loaded(
    explicit_server: KilnProcess,
) -> None:
    grpc = grpcclient.InferenceServerClient(explicit_server.grpc_url)
    http = httpclient.InferenceServerClient(explicit_server.http_url)
    assert "model_repository(unload_dependents)" in http.get_server_metadata()["extensions"]
    http.load_model("cnn")  # by its own name: it stays
    http.load_model("cnn_pipeline")  # brings image_preprocess and postprocess

    def ready() -> set[str]:
        return {m["name"] for m in http.get_model_repository_index() if m["state"] == "READY"}

    assert ready() == {"cnn_pipeline", *PIPELINE}
    grpc.unload_model("cnn_pipeline", unload_dependents=True)
    assert ready() == {"cnn"}
    # over HTTP too; without the parameter the composing models stay
    http.load_model("cnn_pipeline")
    http.unload_model("cnn_pipeline")
    assert ready() == set(PIPELINE)
    http.load_model("cnn_pipeline")
    http.unload_model("cnn_pipeline", unload_dependents=True)
    assert ready() == {"cnn"}


def test_unload_dependents_must_be_a_boolean(explicit_server: KilnProcess) -> None:
    http = httpclient.InferenceServerClient(explicit_server.http_url)
    http.load_model("cnn_pipeline")
    url = f"http://{explicit_server.http_url}/v2/repository/models/cnn_pipeline/unload"
    resp = requests.post(url, json={"parameters": {"unload_dependents": "yes"}}, timeout=30)
    assert resp.status_code == 400
    assert resp.json()["error"] == (
        "unload of model 'cnn_pipeline': parameter 'unload_dependents' must be a boolean, got 'yes'"
    )
    assert http.is_model_ready("cnn_pipeline")  # nothing was unloaded
    # found by the fuzzer (tests/integration/test_security_openapi.py): not an object
    for action in ("unload", "load"):
        url = f"http://{explicit_server.http_url}/v2/repository/models/cnn_pipeline/{action}"
        resp = requests.post(url, json={"parameters": [None, None]}, timeout=30)
        assert resp.status_code == 400
        assert resp.json()["error"] == (
            f"{action} of model 'cnn_pipeline': 'parameters' must be a JSON object, got list"
        )
    assert http.is_model_ready("cnn_pipeline")
