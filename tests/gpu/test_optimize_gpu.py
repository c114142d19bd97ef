"""``kiln optimize --device cuda`` end to end on the digits MLP (needs an NVIDIA GPU).

Every GPU candidate must be built and judged (none skipped), engines profiled with GPU memory,
and a TensorRT candidate written as a ``tensorrt_plan`` entry that kiln serve loads and answers
like the FP32 model.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import tritonclient.http as httpclient

from tests.conftest import DigitsFiles, KilnProcess

pytestmark = pytest.mark.gpu

ORT_GPU_NAMES = {"fp16", "ort-cuda"}  # onnxruntime-gpu alone
TRT_NAMES = {
    "ort-tensorrt-fp32", "ort-tensorrt-fp16", "tensorrt-fp32", "tensorrt-fp16",
    "tensorrt-int8-qdq",
}  # fmt: skip


def _judged(digits_files: DigitsFiles, tmp_path: Path, names: set[str]) -> dict[str, dict]:
    from kiln.optimize import optimize

    outcome = optimize(
        digits_files.mlp_onnx, digits_files.calibration, digits_files.validation,
        tmp_path / "repo", labels=str(digits_files.labels), name="digits", device="cuda",
        batch_sizes=(1, 8, 32), profile_seconds=0.1, progress=False, tune_seconds=0.1,
        candidates=("fp32-all", "int8-static-minmax-per-tensor", *sorted(names)),
        workdir=tmp_path / "work",
    )  # fmt: skip
    rows = {r["name"]: r for r in outcome.report["candidates"]}
    assert set(rows) >= names
    for name in names:
        row = rows[name]
        assert row["status"] in ("accepted", "chosen", "rejected"), (name, row["reason"])
        assert row["accuracy"]["task_accuracy"] is not None
        if row["status"] != "rejected":
            assert row["profile"]["gpu_mb"] is not None, name
    assert outcome.report["serving"]["grid"]
    return rows


def test_onnxruntime_gpu_candidates_are_built_and_judged(
    digits_files: DigitsFiles, tmp_path: Path
) -> None:
    rows = _judged(digits_files, tmp_path, ORT_GPU_NAMES)
    # FP16 stays close to the FP32 reference on this classifier.
    for name in sorted(ORT_GPU_NAMES):
        assert rows[name]["accuracy"]["drop"] <= 0.01, (name, rows[name]["accuracy"])


def test_tensorrt_candidates_are_built_and_judged(
    digits_files: DigitsFiles, tmp_path: Path
) -> None:
    rows = _judged(digits_files, tmp_path, TRT_NAMES)
    for name in ("tensorrt-fp32", "tensorrt-fp16"):
        assert rows[name]["accuracy"]["drop"] <= 0.01, (name, rows[name]["accuracy"])
    assert "int8-static-minmax-per-tensor" in rows["tensorrt-int8-qdq"]["description"]
    # The engine builds share one timing cache, written next to the engines.
    assert (tmp_path / "work" / "tensorrt.timing-cache").stat().st_size > 0
    assert (tmp_path / "work" / "tensorrt-int8-qdq" / "1" / "model.plan").stat().st_size > 0


def test_tensorrt_candidate_is_served_as_a_plan(
    digits_files: DigitsFiles, tmp_path: Path, make_server: type[KilnProcess]
) -> None:
    from kiln.optimize import optimize

    repo = tmp_path / "repo"
    outcome = optimize(
        digits_files.mlp_onnx, digits_files.calibration, digits_files.validation, repo,
        labels=str(digits_files.labels), name="digits_trt", device="cuda", batch_sizes=(1, 16),
        profile_seconds=0.1, tune_seconds=0.1, progress=False, candidates=("tensorrt-fp16",),
    )  # fmt: skip
    assert outcome.chosen == "tensorrt-fp16", outcome.report["why"]
    folder = repo / "digits_trt"
    config = (folder / "config.pbtxt").read_text()
    assert 'platform: "tensorrt_plan"' in config and "KIND_GPU" in config
    assert (folder / "1" / "model.plan").stat().st_size > 0
    report = json.loads((folder / "report.json").read_text())
    chosen = report["serving"]["chosen"]
    assert f"count: {chosen['config']['instances']}" in config

    server = make_server(repo).start()
    client = httpclient.InferenceServerClient(server.http_url)
    x = np.load(digits_files.validation)[:16]
    inp = httpclient.InferInput("INPUT", list(x.shape), "FP32")
    inp.set_data_from_numpy(x)
    served = client.infer("digits_trt", [inp]).as_numpy("output_0")
    import onnxruntime as ort

    ref = ort.InferenceSession(str(digits_files.mlp_onnx)).run(None, {"INPUT": x})[0]
    np.testing.assert_allclose(served, ref, rtol=2e-2, atol=2e-2)  # FP16 compute
    assert (served.argmax(1) == ref.argmax(1)).mean() >= 0.95
