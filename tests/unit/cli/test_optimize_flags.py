"""``kiln optimize``'s flags, as click parses them, become one ``OptimizeOptions``."""

from __future__ import annotations

from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from kiln.cli import main
from kiln.cli.optimize import _options, optimize

REQUIRED = ["m.onnx", "--calibration-data", "c.npy", "--validation-data", "v.npy"]


def options(tmp_path: Path, *args: str):  # type: ignore[no-untyped-def]
    argv = [*REQUIRED, "--output-repository", str(tmp_path), *args]
    # Under the kiln group, as the command line does (click caches the help option).
    parent = click.Context(main, info_name="kiln", **main.context_settings)
    with optimize.make_context("optimize", parent=parent, args=argv) as ctx:
        return _options(**ctx.params)


def test_flags_are_typed_options(tmp_path: Path) -> None:
    parsed = options(
        tmp_path, "--batch-sizes", "1,4", "--candidates", "fp32-*, int8-dynamic",
        "--objective", "throughput", "--no-tune-serving", "--no-progress", "--threads", "2",
    )  # fmt: skip
    assert parsed.model == "m.onnx" and parsed.output_repository == tmp_path
    assert parsed.batch_sizes == (1, 4)
    assert parsed.candidates == ("fp32-*", "int8-dynamic")
    assert parsed.objective == "throughput" and parsed.threads == 2
    assert parsed.tune_serving is False and parsed.progress is False
    assert parsed.max_accuracy_drop == 0.01 and parsed.keep_io_types is True


def test_input_shapes_are_parsed(tmp_path: Path) -> None:
    parsed = options(tmp_path, "--input-shape", "x:1,3,8,8")
    assert parsed.input_shapes == {"x": (1, 3, 8, 8)}


def test_bad_batch_sizes_exit_2(tmp_path: Path) -> None:
    with pytest.raises(click.BadParameter, match="positive integers"):
        options(tmp_path, "--batch-sizes", "0")
    argv = ["optimize", *REQUIRED, "--output-repository", str(tmp_path), "--batch-sizes", "a"]
    result = CliRunner().invoke(main, argv)
    assert result.exit_code == 2 and "'a' is not a comma-separated list" in result.output
