"""kiln optimize on CPU for the digits MLP and CNN: speedup of the chosen candidate over FP32.

Trains both models on scikit-learn's bundled digits (as the tests do), runs the whole candidate
set, and prints the chosen candidate's speedup at batch 1 and 32 and its accuracy delta.
Target (issue 7): >= 1.5x with <= 1 % accuracy drop where INT8 applies.

    .venv/bin/python benchmarks/optimize_digits.py [--profile-seconds 1.0]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kiln import optimize
from kiln.optimize.export import export
from tests import digits


def run(name: str, model: object, shape: tuple[int, ...], x_cal: np.ndarray, x_val: np.ndarray,
        y_val: np.ndarray, work: Path, seconds: float) -> dict[str, object]:  # fmt: skip
    onnx_path = work / f"{name}.onnx"
    export(model, {"INPUT": shape}, onnx_path, dynamo=False)
    np.save(work / f"{name}_cal.npy", x_cal)
    np.save(work / f"{name}_val.npy", x_val)
    np.save(work / "labels.npy", y_val)
    outcome = optimize(
        onnx_path, work / f"{name}_cal.npy", work / f"{name}_val.npy", work / "repo",
        labels=str(work / "labels.npy"), name=name, batch_sizes=(1, 32),
        profile_seconds=seconds, progress=False,
    )  # fmt: skip
    report = outcome.report
    base = report["baseline"]
    row = {"model": name, "chosen": outcome.chosen}
    if outcome.chosen is not None:
        chosen = next(r for r in report["candidates"] if r["name"] == outcome.chosen)
        for i, size in enumerate((1, 32)):
            before = base["profile"]["batches"][i]["p50_ms"]
            after = chosen["profile"]["batches"][i]["p50_ms"]
            row[f"b{size}"] = f"{before:.3f} -> {after:.3f} ms ({before / after:.2f}x)"
        row["accuracy"] = (
            f"{base['task_accuracy']:.4f} -> {chosen['accuracy']['task_accuracy']:.4f}"
        )
    best_int8 = [
        (r["name"], r["profile"]["batches"][1]["p50_ms"], r["accuracy"]["drop"])
        for r in report["candidates"] if r["kind"].startswith("int8") and r["profile"]
    ]  # fmt: skip
    row["int8 accepted (name, b32 p50 ms, drop)"] = sorted(best_int8, key=lambda t: t[1])[:3]
    return row


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--profile-seconds", type=float, default=1.0)
    args = parser.parse_args()
    data = digits.load_digits()
    mlp = digits.train(digits.DigitsMLP(), data.train_x, data.train_y)
    cnn = digits.train(digits.DigitsCNN(), digits.images(data.train_x), data.train_y, steps=60)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        rows = [
            run("mlp", mlp, (1, 64), data.train_x[:256], data.test_x, data.test_y, work,
                args.profile_seconds),
            run("cnn", cnn, (1, 1, 8, 8), digits.images(data.train_x[:256]),
                digits.images(data.test_x), data.test_y, work, args.profile_seconds),
        ]  # fmt: skip
    for row in rows:
        for key, value in row.items():
            print(f"{key}: {value}")
        print()


if __name__ == "__main__":
    main()
