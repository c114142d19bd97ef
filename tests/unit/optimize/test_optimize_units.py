"""Units of kiln.optimize: data loading, the accuracy guard, selection, the report's tables."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from kiln.optimize.accuracy import compare, verdict
from kiln.optimize.data import InputSpec, load_data, tile_to
from kiln.optimize.export import model_kind, parse_input_shape
from kiln.optimize.report import before_after, markdown
from kiln.optimize.select import select
from kiln.optimize.types import (
    Accuracy,
    BatchProfile,
    Candidate,
    OptimizeError,
    Profile,
    Result,
)

SPECS = [InputSpec("A", np.float32, (None, 3)), InputSpec("B", np.int64, (None,))]


def test_folder_of_npz_is_concatenated_and_cast(tmp_path: Path) -> None:
    for i in range(2):
        np.savez(tmp_path / f"part{i}.npz", A=np.full((2, 3), i, np.float64), B=np.arange(2))
    batch = load_data(tmp_path, SPECS, "validation")
    assert batch["A"].dtype == np.float32 and batch["A"].shape == (4, 3)
    np.testing.assert_array_equal(batch["A"][:, 0], [0, 0, 1, 1])
    assert batch["B"].dtype == np.int64


def test_mismatched_sample_counts(tmp_path: Path) -> None:
    np.savez(tmp_path / "d.npz", A=np.zeros((2, 3)), B=np.zeros(3, np.int64))
    with pytest.raises(OptimizeError, match="different sample counts"):
        load_data(tmp_path / "d.npz", SPECS, "validation")


def test_tile_repeats_rows() -> None:
    tiled = tile_to({"A": np.arange(3)}, 7)
    np.testing.assert_array_equal(tiled["A"], [0, 1, 2, 0, 1, 2, 0])


def test_compare_with_labels_and_without() -> None:
    ref = [np.array([[2.0, 1.0], [0.0, 3.0], [1.0, 0.0]], np.float32)]
    cand = [np.array([[2.0, 1.0], [4.0, 3.0], [1.0, 0.0]], np.float32)]
    labels = np.array([0, 1, 1])
    with_labels = compare(ref, cand, labels)
    assert with_labels.task_accuracy == pytest.approx(1 / 3)
    assert with_labels.drop == pytest.approx(2 / 3 - 1 / 3)
    assert with_labels.max_abs_error == 4.0
    no_labels = compare(ref, cand, None)
    assert no_labels.top1_agreement == pytest.approx(2 / 3)
    assert no_labels.drop == pytest.approx(1 / 3)
    assert "over --max-accuracy-drop 0.01" in (verdict(no_labels, 0.01) or "")
    assert verdict(compare(ref, ref, None), 0.0) is None


def test_regression_output_uses_cosine() -> None:
    ref = [np.array([[1.0], [2.0]], np.float32)]
    acc = compare(ref, [ref[0] * 1.5], None)
    assert acc.drop_metric.startswith("1 - cosine") and acc.drop == pytest.approx(0.0, abs=1e-9)
    assert acc.max_rel_error == pytest.approx(0.5)


def test_nan_outputs_are_rejected() -> None:
    ref = [np.ones((2, 2), np.float32)]
    acc = compare(ref, [np.full((2, 2), np.nan, np.float32)], None)
    assert verdict(acc, 1.0) == "outputs contain NaN or Inf"


def _result(name: str, p50: list[float], drop: float = 0.0, status: str = "accepted") -> Result:
    batches = [
        BatchProfile(b, v, v * 1.2, b / v * 1000, 10) for b, v in zip((1, 8), p50, strict=True)
    ]
    acc = Accuracy(0.0, 0.0, 1.0, 1.0, None, drop, "1 - top-1 agreement with FP32")
    return Result(Candidate(name, "fp32", name, path=Path(name)), acc, Profile(batches, 1.0, 1.0),
                  status=status)  # fmt: skip


def test_select_latency_and_throughput() -> None:
    a, b = _result("a", [1.0, 4.0]), _result("b", [2.0, 3.0])
    assert select([a, b], "latency", None).chosen is a
    assert select([a, b], "throughput", None).chosen is b
    # A 1.1 ms budget on batch-1 p99 rules out both (1.2 and 2.4 ms); a is the closer.
    none = select([_result("a", [1.0, 4.0]), _result("b", [2.0, 3.0])], "latency", 1.1)
    assert none.chosen is None and none.closest is not None
    assert none.closest.candidate.name == "a" and "latency budget" in none.why


def test_select_nothing_accurate_names_closest() -> None:
    a = _result("a", [1.0, 2.0], drop=0.2, status="rejected")
    b = _result("b", [1.0, 2.0], drop=0.05, status="rejected")
    picked = select([a, b], "latency", None)
    assert picked.chosen is None and picked.closest is b


def test_markdown_matches_before_after() -> None:
    chosen = _result("int8", [0.5, 1.0])
    base = _result("base", [1.0, 4.0])
    report = {
        "name": "m", "model": "m.onnx", "batch_sizes": [1, 8], "chosen": "int8", "closest": None,
        "why": "lowest", "constraints": {"max_accuracy_drop": 0.01, "latency_budget_ms": None,
                                         "objective": "latency"},
        "baseline": {"task_accuracy": None, "profile": chosen.to_json()["profile"] | {
            "batches": base.to_json()["profile"]["batches"]}},
        "candidates": [chosen.to_json()],
    }  # fmt: skip
    rows = before_after(report)
    assert rows[0] == ("p50 latency, batch 1 (ms)", "1.000", "0.500", "2.00x faster")
    assert rows[2][3] == "4.00x faster"
    md = markdown(report)
    assert "| p50 latency, batch 1 (ms) | 1.000 | 0.500 | 2.00x faster |" in md


def test_model_kinds_and_shapes(tmp_path: Path) -> None:
    assert model_kind("m.onnx") == "onnx"
    assert model_kind("model.pt") == "torchscript"
    assert model_kind("pkg.models:build") == "factory"
    assert parse_input_shape("x:1,3,8,8") == ("x", (1, 3, 8, 8))
    with pytest.raises(OptimizeError):
        parse_input_shape("x:1,0")
