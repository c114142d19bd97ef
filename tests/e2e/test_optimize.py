"""``kiln optimize`` end to end on real digits classifiers: CLI, repository entry, served output."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
import tritonclient.http as httpclient

from tests.conftest import DigitsFiles, KilnProcess

QUICK = ["--profile-seconds", "0.03", "--batch-sizes", "1,8", "--no-progress", "--tune-seconds",
         "0.05"]  # fmt: skip
FEW = "fp32-basic,fp32-all,int8-dynamic,int8-static-minmax-*"


def run_optimize(*args: str | Path, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).parents[2]))
    return subprocess.run(
        [sys.executable, "-m", "kiln", "optimize", *map(str, args)],
        capture_output=True, text=True, env=env, cwd=cwd, timeout=240,
    )  # fmt: skip


def test_mlp_end_to_end_served(
    digits_files: DigitsFiles, tmp_path: Path, make_server: type[KilnProcess]
) -> None:
    repo = tmp_path / "repo"
    done = run_optimize(
        digits_files.mlp_onnx, "--calibration-data", digits_files.calibration,
        "--validation-data", digits_files.validation, "--labels", digits_files.labels,
        "--output-repository", repo, "--name", "digits", "--candidates", FEW, *QUICK,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    folder = repo / "digits"
    report = json.loads((folder / "report.json").read_text())
    chosen = report["chosen"]
    assert chosen and f"chosen: {chosen}" in done.stdout
    rows = {r["name"]: r for r in report["candidates"]}
    assert rows[chosen]["status"] == "chosen"
    assert {"int8-dynamic", "int8-static-minmax-per-tensor", "fp32-all"} <= set(rows)
    assert rows["fp16"]["status"] == "skipped" and "GPU" in rows["fp16"]["reason"]
    assert rows[chosen]["accuracy"]["drop"] <= 0.01
    # The baseline is the trained model's own accuracy, as PyTorch measured it.
    assert report["baseline"]["task_accuracy"] == pytest.approx(
        digits_files.reference_accuracy, abs=1e-3
    )
    # Markdown and HTML carry the same figures as report.json.
    md = (folder / "report.md").read_text()
    assert f"**Chosen: `{chosen}`**" in md
    p50 = rows[chosen]["profile"]["batches"][0]["p50_ms"]
    assert f"{p50:.3f}" in md
    html = (folder / "report.html").read_text()
    assert html.count("data:image/png;base64,") == 2 and f"{p50:.3f}" in html

    # The repository entry loads in kiln serve as is and answers like the chosen model file.
    server = make_server(repo).start()
    client = httpclient.InferenceServerClient(server.http_url)
    x = np.load(digits_files.validation)[:8]  # max_batch_size is the largest --batch-sizes
    inp = httpclient.InferInput("INPUT", list(x.shape), "FP32")
    inp.set_data_from_numpy(x)
    served = client.infer("digits", [inp]).as_numpy("output_0")
    local = ort.InferenceSession(str(folder / "1" / "model.onnx")).run(None, {"INPUT": x})[0]
    np.testing.assert_allclose(served, local, rtol=1e-5, atol=1e-5)
    labels = np.load(digits_files.labels)[:8]
    assert float(np.mean(served.argmax(1) == labels)) >= 0.75


def test_serving_config_is_tuned_through_the_scheduler(
    digits_files: DigitsFiles, tmp_path: Path, make_server: type[KilnProcess]
) -> None:
    repo = tmp_path / "repo"
    done = run_optimize(
        digits_files.mlp_onnx, "--calibration-data", digits_files.calibration,
        "--validation-data", digits_files.validation, "--output-repository", repo,
        "--name", "tuned", "--candidates", "fp32-all", "--device", "cuda", *QUICK,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    report = json.loads((repo / "tuned" / "report.json").read_text())
    serving = report["serving"]
    assert serving["tuned"] and f"serving config: {serving['chosen']['label']}" in done.stdout
    grid = serving["grid"]
    # Instance count 1..2 x (no batching, delay 0/100/500/1000 us), each really driven.
    assert len(grid) == 10
    assert {(p["config"]["instances"], p["config"]["max_queue_delay_us"]) for p in grid} == {
        (n, d) for n in (1, 2) for d in (None, 0, 100, 500, 1000)
    }
    assert all(p["requests"] > 0 and p["errors"] == 0 for p in grid)
    best = serving["chosen"]
    assert best["throughput"] == max(p["throughput"] for p in grid)  # no budget given
    config = (repo / "tuned" / "config.pbtxt").read_text()
    assert f"count: {best['config']['instances']}, kind: KIND_CPU" in config
    if best["config"]["max_queue_delay_us"] is None:
        assert "dynamic_batching" not in config
    else:
        assert f"max_queue_delay_microseconds: {best['config']['max_queue_delay_us']}" in config
        assert "preferred_batch_size: [ 8 ]" in config
    md = (repo / "tuned" / "report.md").read_text()
    assert "## Serving config" in md and f"{best['label']} (chosen)" in md
    if not Path("/dev/nvidia0").exists():
        # --device cuda on a machine without a GPU: each GPU candidate says what it lacks.
        rows = {r["name"]: r for r in report["candidates"]}
        for name in ("fp16", "ort-cuda", "tensorrt-fp32", "tensorrt-int8-qdq"):
            assert rows[name]["status"] == "skipped" and rows[name]["reason"]

    server = make_server(repo).start()
    client = httpclient.InferenceServerClient(server.http_url)
    assert client.is_model_ready("tuned")
    cfg = client.get_model_config("tuned")
    assert len(cfg["instance_group"]) == 1
    assert int(cfg["instance_group"][0]["count"]) == best["config"]["instances"]


def test_no_tune_serving_keeps_the_plain_config(digits_files: DigitsFiles, tmp_path: Path) -> None:
    from kiln.optimize import optimize

    outcome = optimize(
        digits_files.mlp_onnx, digits_files.calibration, digits_files.validation,
        tmp_path / "repo", name="plain", progress=False, candidates=("fp32-all",),
        profile_seconds=0.02, batch_sizes=(1, 4), tune_serving=False,
    )  # fmt: skip
    assert outcome.report["serving"] == {"tuned": False, "why": "--no-tune-serving", "grid": []}
    config = (tmp_path / "repo" / "plain" / "config.pbtxt").read_text()
    assert "dynamic_batching" not in config and "count: 1, kind: KIND_CPU" in config


def test_cnn_static_int8_within_budget(digits_files: DigitsFiles, tmp_path: Path) -> None:
    from kiln.optimize import optimize

    outcome = optimize(
        digits_files.cnn_onnx, digits_files.image_calibration, digits_files.image_validation,
        tmp_path / "repo", labels=str(digits_files.labels), name="cnn", progress=False,
        candidates=("fp32-all", "int8-static-*", "int8-u8s8-minmax-*"), profile_seconds=0.03,
        batch_sizes=(1, 4), tune_serving=False,
    )  # fmt: skip
    assert outcome.ok
    rows = outcome.report["candidates"]
    statics = [r for r in rows if r["kind"] == "int8-static"]
    assert len(statics) == 6
    u8s8 = [r for r in rows if r["kind"] == "int8-u8s8"]
    assert {r["name"] for r in u8s8} == {
        "int8-u8s8-minmax-per-tensor",
        "int8-u8s8-minmax-per-channel",
    }
    for row in statics + u8s8:
        assert row["accuracy"]["task_accuracy"] is not None
        assert (row["status"] in ("accepted", "chosen")) == (row["accuracy"]["drop"] <= 0.01)
    assert (tmp_path / "repo" / "cnn" / "config.pbtxt").read_text().count("dims: [ 1, 8, 8 ]")


def test_guard_rejects_badly_calibrated_int8(digits_files: DigitsFiles, tmp_path: Path) -> None:
    # Calibrating on inputs 100x too small clips every real activation: the INT8 model is wrong
    # and the guard must say by how much, while the FP32 candidates stay acceptable.
    tiny = tmp_path / "tiny.npy"
    np.save(tiny, np.load(digits_files.calibration) * 0.01)
    from kiln.optimize import optimize

    outcome = optimize(
        digits_files.mlp_onnx, tiny, digits_files.validation, tmp_path / "repo",
        labels=str(digits_files.labels), progress=False, profile_seconds=0.02, batch_sizes=(1,),
        candidates=("fp32-all", "int8-static-minmax-per-tensor"), tune_serving=False,
    )  # fmt: skip
    rows = {r["name"]: r for r in outcome.report["candidates"]}
    bad = rows["int8-static-minmax-per-tensor"]
    assert bad["status"] == "rejected"
    assert bad["accuracy"]["drop"] > 0.01
    assert "over --max-accuracy-drop 0.01" in bad["reason"]
    assert f"{bad['accuracy']['drop']:.4f}" in bad["reason"]
    assert bad["profile"] is None
    assert outcome.chosen == "fp32-all"


def test_unreachable_latency_budget_exits_nonzero(digits_files: DigitsFiles, tmp_path: Path
                                                  ) -> None:  # fmt: skip
    repo = tmp_path / "repo"
    done = run_optimize(
        digits_files.mlp_onnx, "--calibration-data", digits_files.calibration,
        "--validation-data", digits_files.validation, "--output-repository", repo,
        "--latency-budget-ms", "0.000001", "--candidates", "fp32-basic,int8-dynamic", *QUICK,
    )  # fmt: skip
    assert done.returncode == 2
    report = json.loads((repo / "mlp" / "report.json").read_text())
    assert report["chosen"] is None and report["closest"] in ("fp32-basic", "int8-dynamic")
    assert f"closest: {report['closest']}" in done.stderr
    assert "latency budget" in report["why"]
    assert not (repo / "mlp" / "config.pbtxt").exists()
    assert "Nothing met the constraints" in (repo / "mlp" / "report.md").read_text()


def test_torchscript_input_is_exported(digits_files: DigitsFiles, tmp_path: Path) -> None:
    done = run_optimize(
        digits_files.mlp_torchscript, "--input-shape", "INPUT:1,64",
        "--calibration-data", digits_files.calibration, "--validation-data",
        digits_files.validation, "--output-repository", tmp_path / "repo",
        "--candidates", "fp32-all", *QUICK,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    report = json.loads((tmp_path / "repo" / "mlp" / "report.json").read_text())
    assert report["exported_onnx"] == "torchscript"
    assert report["chosen"] == "fp32-all"


def test_factory_input_uses_dynamo(digits_files: DigitsFiles, tmp_path: Path) -> None:
    os.environ["KILN_DIGITS_MLP_WEIGHTS"] = str(digits_files.mlp_weights)
    try:
        done = run_optimize(
            "tests.digits:trained_mlp", "--input-shape", "INPUT:1,64", "--calibration-data",
            digits_files.calibration, "--validation-data", digits_files.validation,
            "--labels", digits_files.labels, "--output-repository", tmp_path / "repo",
            "--name", "factory_mlp", "--candidates", "fp32-all,int8-dynamic", *QUICK,
            cwd=Path(__file__).parents[2],
        )  # fmt: skip
    finally:
        del os.environ["KILN_DIGITS_MLP_WEIGHTS"]
    assert done.returncode == 0, done.stderr
    report = json.loads((tmp_path / "repo" / "factory_mlp" / "report.json").read_text())
    assert report["exported_onnx"] == "dynamo"
    assert report["baseline"]["task_accuracy"] == pytest.approx(
        digits_files.reference_accuracy, abs=1e-3
    )
