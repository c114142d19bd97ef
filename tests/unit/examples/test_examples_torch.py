"""The example repository with and without torch installed."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from kiln.cli import main
from kiln.examples import build_example_repository
from kiln.examples import repository as examples


def test_torch_mlp_is_torchscript(tmp_path: Path) -> None:
    built = build_example_repository(tmp_path, ["torch_mlp"])
    assert built == [tmp_path / "torch_mlp"]
    assert (tmp_path / "torch_mlp" / "1" / "model.pt").stat().st_size > 0
    assert (tmp_path / "torch_mlp" / "labels.txt").exists()


def test_without_torch_the_model_is_skipped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    real = importlib.util.find_spec

    def no_torch(name: str, *args: Any) -> Any:
        return None if name == "torch" else real(name, *args)

    # Simulates a machine where kiln-serve was installed without the torch extra.
    monkeypatch.setattr(examples.importlib.util, "find_spec", no_torch)
    built = build_example_repository(tmp_path, ["mlp", "torch_mlp"])
    assert built == [tmp_path / "mlp"]
    assert not (tmp_path / "torch_mlp").exists()
    assert "example model 'torch_mlp' skipped: needs torch" in caplog.text
    result = CliRunner().invoke(
        main, ["repo", "example", str(tmp_path / "cli"), "--model", "torch_mlp"]
    )
    assert result.exit_code == 0
    assert "skipped torch_mlp (needs torch: pip install kiln-serve[torch])" in result.output
