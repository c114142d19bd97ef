"""Triton's classification extension on the example MLP (labels from labels.txt)."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from tests.conftest import KilnProcess


def test_top_k_with_labels_matches_onnxruntime(kiln_server: KilnProcess) -> None:
    x = np.random.default_rng(3).standard_normal((3, 64), dtype=np.float32)
    session = ort.InferenceSession(
        str(kiln_server.repository / "mlp" / "1" / "model.onnx"),
        providers=["CPUExecutionProvider"],
    )
    (probs,) = session.run(["PROBABILITIES"], {"INPUT": x})
    labels = (kiln_server.repository / "mlp" / "labels.txt").read_text().splitlines()

    client = httpclient.InferenceServerClient(kiln_server.http_url)
    inp = httpclient.InferInput("INPUT", [3, 64], "FP32")
    inp.set_data_from_numpy(x)
    for binary in (True, False):
        out = httpclient.InferRequestedOutput("PROBABILITIES", binary_data=binary, class_count=3)
        result = client.infer("mlp", [inp], outputs=[out])
        classes = result.as_numpy("PROBABILITIES")
        assert classes.shape == (3, 3)
        for row, expected in zip(classes, probs, strict=True):
            top = np.argsort(-expected, kind="stable")[:3]
            for cell, index in zip(row, top, strict=True):
                text = cell.decode() if isinstance(cell, bytes) else str(cell)
                value, idx, label = text.split(":")
                assert int(idx) == index
                assert label == labels[index]
                assert float(value) == pytest.approx(float(expected[index]), abs=1e-6)


def test_classification_without_labels_and_bad_count(kiln_server: KilnProcess) -> None:
    client = httpclient.InferenceServerClient(kiln_server.http_url)
    inp = httpclient.InferInput("INPUT", [1, 64], "FP32")
    inp.set_data_from_numpy(np.ones((1, 64), dtype=np.float32))
    out = httpclient.InferRequestedOutput("LOGITS", class_count=20)  # more than 10 classes
    cells = client.infer("mlp", [inp], outputs=[out]).as_numpy("LOGITS")
    assert cells.shape == (1, 10)
    assert all(len(c.decode().split(":")) == 2 for c in cells[0])  # LOGITS has no labels

    bad = httpclient.InferRequestedOutput("LOGITS", binary_data=False)
    bad._parameters["classification"] = 0
    with pytest.raises(InferenceServerException, match="'classification' must be an integer"):
        client.infer("mlp", [inp], outputs=[bad])
    assert client.is_model_ready("mlp")
