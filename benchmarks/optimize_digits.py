"""kiln optimize on CPU for the digits MLP and CNNs: speedup of the chosen candidate over FP32.

Trains the models on scikit-learn's bundled digits (as the tests do: the MLP, the test CNN, and
the same CNN at 4x the channels), runs the whole CPU candidate set, and prints the chosen
candidate's speedup at batch 1 and 32, its accuracy delta, and the fastest accepted INT8
candidate. Target (issue 7): >= 1.5x with <= 1 % accuracy drop where INT8 applies.

    .venv/bin/python benchmarks/optimize_digits.py [--profile-seconds 1.0] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kiln import optimize
from kiln.optimize.export import export
from tests import digits

SIZES = (1, 32)


def _speedups(base: dict[str, object], row: dict[str, object]) -> list[float]:
    before = base["profile"]["batches"]  # type: ignore[index]
    after = row["profile"]["batches"]  # type: ignore[index]
    return [b["p50_ms"] / a["p50_ms"] for b, a in zip(before, after, strict=True)]


def run(name: str, model: object, shape: tuple[int, ...], x_cal: np.ndarray, x_val: np.ndarray,
        y_val: np.ndarray, work: Path, seconds: float) -> dict[str, object]:  # fmt: skip
    onnx_path = work / f"{name}.onnx"
    export(model, {"INPUT": shape}, onnx_path, dynamo=False)
    np.save(work / f"{name}_cal.npy", x_cal)
    np.save(work / f"{name}_val.npy", x_val)
    np.save(work / "labels.npy", y_val)
    load = [os.getloadavg()[0]]
    outcome = optimize(
        onnx_path, work / f"{name}_cal.npy", work / f"{name}_val.npy", work / "repo",
        labels=str(work / "labels.npy"), name=name, batch_sizes=SIZES,
        profile_seconds=seconds, progress=False, tune_serving=False,
    )  # fmt: skip
    load.append(os.getloadavg()[0])
    report = outcome.report
    base = report["baseline"]
    row: dict[str, object] = {"model": name, "chosen": outcome.chosen, "load_1min": load}
    if outcome.chosen is not None:
        chosen = next(r for r in report["candidates"] if r["name"] == outcome.chosen)
        for size, speedup, before, after in zip(
            SIZES, _speedups(base, chosen), base["profile"]["batches"],
            chosen["profile"]["batches"], strict=True,
        ):  # fmt: skip
            row[f"b{size}"] = f"{before['p50_ms']:.3f} -> {after['p50_ms']:.3f} ms ({speedup:.2f}x)"
        row["accuracy"] = (
            f"{base['task_accuracy']:.4f} -> {chosen['accuracy']['task_accuracy']:.4f}"
        )
    int8 = [r for r in report["candidates"] if r["kind"].startswith("int8") and r["profile"]]
    int8.sort(key=lambda r: r["profile"]["batches"][1]["p50_ms"])
    row["fastest accepted INT8 (name, speedup b1, b32, drop)"] = [
        (r["name"], *(round(s, 2) for s in _speedups(base, r)), round(r["accuracy"]["drop"], 4))
        for r in int8[:3]
    ]
    row["report"] = report
    return row


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--profile-seconds", type=float, default=1.0)
    parser.add_argument("--json", type=Path, default=None, help="write every report here")
    args = parser.parse_args()
    data = digits.load_digits()
    mlp = digits.train(digits.DigitsMLP(), data.train_x, data.train_y)
    images, cal = digits.images(data.train_x), digits.images(data.train_x[:256])
    cnn = digits.train(digits.DigitsCNN(), images, data.train_y, steps=60)
    wide = digits.train(digits.DigitsWideCNN(), images, data.train_y, steps=60)
    val = digits.images(data.test_x)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        rows = [
            run("mlp", mlp, (1, 64), data.train_x[:256], data.test_x, data.test_y, work,
                args.profile_seconds),
            run("cnn", cnn, (1, 1, 8, 8), cal, val, data.test_y, work, args.profile_seconds),
            run("wide_cnn", wide, (1, 1, 8, 8), cal, val, data.test_y, work,
                args.profile_seconds),
        ]  # fmt: skip
    if args.json is not None:
        args.json.write_text(json.dumps([r["report"] for r in rows], indent=1))
    for row in rows:
        for key, value in row.items():
            if key != "report":
                print(f"{key}: {value}")
        print()


if __name__ == "__main__":
    main()
