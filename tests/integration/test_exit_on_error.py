"""Triton's ``--exit-on-error``: a model named at start that fails to load stops the server
(status 1, the model and the reason in the log); ``--exit-on-error=false`` keeps serving the
others. kiln's default with a repository is to keep serving (tests/integration/
test_http_model_control.py serves beside a broken model)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.conftest import KilnProcess

BROKEN_CONFIG = 'name: "broken"\nplatform: "onnxruntime_onnx"\nmax_batch_sise: 8\n'


@pytest.fixture
def repo_with_a_broken_model(example_repo: Path, tmp_path: Path) -> Path:
    repo = tmp_path / "repo"
    (repo / "simple").mkdir(parents=True)
    shutil.copytree(example_repo / "simple", repo / "simple", dirs_exist_ok=True)
    shutil.copytree(example_repo / "simple" / "1", repo / "broken" / "1")
    (repo / "broken" / "config.pbtxt").write_text(BROKEN_CONFIG)
    return repo


@pytest.mark.parametrize("flag", ["--exit-on-error", "--exit-on-error=true"])
def test_a_model_that_fails_at_start_ends_the_server(
    repo_with_a_broken_model: Path, flag: str
) -> None:
    proc = KilnProcess(repo_with_a_broken_model, args=[flag]).start(wait_ready=False)
    try:
        assert proc.proc is not None
        assert proc.proc.wait(timeout=120) == 1
        log = proc.log()
        assert "failed to load all models: 'broken'" in log
        assert "max_batch_sise" in log  # the reason: the config's unknown field
        assert "'simple'" not in log.split("failed to load all models")[1].splitlines()[0]
    finally:
        proc.stop()


def test_exit_on_error_false_serves_the_models_that_loaded(
    repo_with_a_broken_model: Path,
) -> None:
    proc = KilnProcess(repo_with_a_broken_model, args=["--exit-on-error=false"])
    proc.start(wait_ready=False)
    try:
        proc.wait_ready(timeout=120, path="/v2/models/simple/ready")
        assert proc.proc is not None and proc.proc.poll() is None
        assert "failed to load all models" not in proc.log()
    finally:
        assert proc.stop() == 0
