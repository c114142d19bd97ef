"""An ensemble with a Python-backend step, end to end with tritonclient against ``kiln serve``.

``python_pipeline`` is ``cnn_pipeline`` with ``python_preprocess`` (a Python model in its own
worker process, behind a dynamic batcher) as step 1 instead of the ONNX ``image_preprocess``:
both must answer the same, and the statistics must show the Python model did the work.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from kiln.examples import reference_outputs
from tests.conftest import KilnProcess

OUTPUTS = ("CLASS", "SCORE", "PROBABILITIES")


def _images(batch: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (batch, 28, 28, 1), dtype=np.uint8)


def _infer(module: Any, client: Any, model: str, images: np.ndarray) -> dict[str, np.ndarray]:
    item = module.InferInput("IMAGE", list(images.shape), "UINT8")
    item.set_data_from_numpy(images)
    result = client.infer(model, [item])
    return {name: result.as_numpy(name) for name in OUTPUTS}


def _success(client: httpclient.InferenceServerClient, model: str) -> int:
    (row,) = client.get_inference_statistics(model)["model_stats"]
    return int(row["inference_stats"]["success"]["count"])


def _executions(client: httpclient.InferenceServerClient, model: str) -> int:
    (row,) = client.get_inference_statistics(model)["model_stats"]
    return int(row["execution_count"])


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_python_pipeline_equals_cnn_pipeline(kiln_server: KilnProcess, protocol: str) -> None:
    module: Any = httpclient if protocol == "http" else grpcclient
    url = kiln_server.http_url if protocol == "http" else kiln_server.grpc_url
    client = module.InferenceServerClient(url)
    for batch, seed in ((1, 11), (4, 12)):
        images = _images(batch, seed)
        python = _infer(module, client, "python_pipeline", images)
        onnx = _infer(module, client, "cnn_pipeline", images)
        reference = reference_outputs("python_pipeline", {"IMAGE": images})
        for name in OUTPUTS:
            assert python[name].dtype == onnx[name].dtype, name
            assert python[name].shape == onnx[name].shape == reference[name].shape, name
            # Both preprocessors divide by 255 in float32, so even the floats agree exactly.
            np.testing.assert_array_equal(python[name], onnx[name], err_msg=name)
        np.testing.assert_array_equal(python["CLASS"], reference["CLASS"])
        np.testing.assert_allclose(python["SCORE"], reference["SCORE"], rtol=1e-5)
    client.close()


def test_statistics_show_the_python_step_ran(kiln_server: KilnProcess) -> None:
    client = httpclient.InferenceServerClient(kiln_server.http_url)
    models = ("python_pipeline", "python_preprocess", "cnn", "postprocess", "image_preprocess")
    before = {m: _success(client, m) for m in models}
    for batch in (1, 2, 3):
        _infer(httpclient, client, "python_pipeline", _images(batch, batch))
    gained = {m: _success(client, m) - before[m] for m in models}
    # One request per step per ensemble request; the ONNX preprocessor is not involved.
    assert gained == {
        "python_pipeline": 3,
        "python_preprocess": 3,
        "cnn": 3,
        "postprocess": 3,
        "image_preprocess": 0,
    }
    assert _executions(client, "python_preprocess") >= 1
    (row,) = client.get_inference_statistics("python_pipeline")["model_stats"]
    assert row["inference_stats"]["fail"]["count"] == 0
    client.close()


def test_concurrent_ensemble_requests_through_the_python_worker(kiln_server: KilnProcess) -> None:
    # Parallel ensemble requests meet in python_preprocess's dynamic batcher, so the worker
    # gets lists of requests: each ensemble request must still get its own images' answer.
    batches = [_images(1 + i % 3, 100 + i) for i in range(12)]

    def one(images: np.ndarray) -> dict[str, np.ndarray]:
        client = grpcclient.InferenceServerClient(kiln_server.grpc_url)
        try:
            return _infer(grpcclient, client, "python_pipeline", images)
        finally:
            client.close()

    with ThreadPoolExecutor(max_workers=6) as pool:
        results = list(pool.map(one, batches))
    for images, got in zip(batches, results, strict=True):
        want = reference_outputs("python_pipeline", {"IMAGE": images})
        np.testing.assert_array_equal(got["CLASS"], want["CLASS"])
        np.testing.assert_allclose(got["PROBABILITIES"], want["PROBABILITIES"], rtol=1e-5)


def test_metadata_names_the_python_step(kiln_server: KilnProcess) -> None:
    client = httpclient.InferenceServerClient(kiln_server.http_url)
    assert client.is_model_ready("python_pipeline")
    config = client.get_model_config("python_pipeline")
    steps = [s["model_name"] for s in config["ensemble_scheduling"]["step"]]
    assert steps == ["python_preprocess", "cnn", "postprocess"]
    assert client.get_model_config("python_preprocess")["backend"] == "python"
    client.close()
