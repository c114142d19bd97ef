"""``kiln optimize`` refuses bad models and data with a precise message and exit code 1."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from kiln.optimize import OptimizeError
from kiln.optimize.export import check_export, export
from tests.conftest import DigitsFiles
from tests.e2e.test_optimize import run_optimize


def _args(model: Path | str, calib: Path, valid: Path, repo: Path) -> list[str | Path]:
    return [model, "--calibration-data", calib, "--validation-data", valid,
            "--output-repository", repo, "--no-progress", "--candidates", "fp32-all"]  # fmt: skip


def test_not_onnx(digits_files: DigitsFiles, tmp_path: Path) -> None:
    fake = tmp_path / "model.onnx"
    fake.write_text("this is not a protobuf")
    done = run_optimize(*_args(fake, digits_files.calibration, digits_files.validation, tmp_path))
    assert done.returncode == 1
    assert f"error: '{fake}' is not a loadable ONNX model" in done.stderr


@pytest.mark.parametrize(
    ("array", "message"),
    [
        (np.zeros((10, 32), np.float32), "dim 1 is 32, not 64"),
        (np.zeros((10, 8, 8), np.float32), "expects rank 2 [N, 64]"),
        (np.zeros((10, 64), np.complex64), "is complex64, which does not convert"),
        (np.zeros((0, 64), np.float32), "calibration data"),
    ],
)
def test_data_that_does_not_fit(
    digits_files: DigitsFiles, tmp_path: Path, array: np.ndarray, message: str
) -> None:
    bad = tmp_path / "bad.npy"
    np.save(bad, array)
    done = run_optimize(*_args(digits_files.mlp_onnx, bad, digits_files.validation, tmp_path))
    assert done.returncode == 1
    assert message in done.stderr
    assert "input 'INPUT'" in done.stderr or "is empty (0 samples)" in done.stderr


def test_empty_calibration_folder(digits_files: DigitsFiles, tmp_path: Path) -> None:
    empty = tmp_path / "calib"
    empty.mkdir()
    done = run_optimize(*_args(digits_files.mlp_onnx, empty, digits_files.validation, tmp_path))
    assert done.returncode == 1
    assert f"calibration data '{empty}' holds no .npy or .npz file" in done.stderr


def test_npz_missing_input_name(digits_files: DigitsFiles, tmp_path: Path) -> None:
    bad = tmp_path / "bad.npz"
    np.savez(bad, a=np.zeros((4, 64), np.float32), b=np.zeros((4, 64), np.float32))
    done = run_optimize(*_args(digits_files.mlp_onnx, bad, digits_files.validation, tmp_path))
    assert done.returncode == 1
    assert "has no array for model input(s) ['INPUT']" in done.stderr


class _Eig(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.linalg.eigvals(x.reshape(-1, 8, 8)).real


def test_export_failure_names_the_op(tmp_path: Path) -> None:
    with pytest.raises(OptimizeError) as info:
        export(_Eig(), {"INPUT": (1, 64)}, tmp_path / "eig.onnx")
    text = str(info.value)
    assert "ONNX export failed" in text and "TorchScript exporter" in text
    assert "linalg_eigvals" in text or "eigvals" in text


class _BakedBatch(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # int() turns the batch size into a Python number: tracing records it as a constant.
        return self.fc(x).reshape(int(x.shape[0]), 10)


def test_batch_dim_baked_in_is_caught(tmp_path: Path) -> None:
    model = _BakedBatch().eval()
    out = tmp_path / "baked.onnx"
    assert export(model, {"INPUT": (1, 64)}, out, dynamo=False) == "torchscript"
    with pytest.raises(OptimizeError, match="batch dimension baked in as a constant"):
        check_export(model, out, {"INPUT": (1, 64)}, [1, 8])


class _OnlyBatchOne(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.reshape(1, 64)


def test_model_that_only_takes_batch_one(tmp_path: Path) -> None:
    model = _OnlyBatchOne().eval()
    out = tmp_path / "one.onnx"
    export(model, {"INPUT": (1, 64)}, out, dynamo=False)
    with pytest.raises(OptimizeError, match="PyTorch model itself fails at batch size 2"):
        check_export(model, out, {"INPUT": (1, 64)}, [1, 8])


def test_pytorch_model_needs_input_shape(digits_files: DigitsFiles, tmp_path: Path) -> None:
    done = run_optimize(
        *_args(
            digits_files.mlp_torchscript,
            digits_files.calibration,
            digits_files.validation,
            tmp_path,
        )
    )
    assert done.returncode == 1
    assert "needs --input-shape NAME:1,D1,..." in done.stderr


def test_bad_batch_sizes_and_shape_spec(digits_files: DigitsFiles, tmp_path: Path) -> None:
    args = _args(digits_files.mlp_onnx, digits_files.calibration, digits_files.validation, tmp_path)
    done = run_optimize(*args, "--batch-sizes", "1,x")
    assert done.returncode == 2 and "is not a comma-separated list" in done.stderr
    done = run_optimize(*args, "--input-shape", "INPUT")
    assert done.returncode == 1 and "--input-shape 'INPUT' is not NAME:D0,D1" in done.stderr
