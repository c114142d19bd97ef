"""The ``kiln`` command as a user runs it, in a subprocess."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import tritonclient.http as httpclient

from kiln import __version__
from kiln.config.check import check_repository
from kiln.examples import EXAMPLE_MODELS
from tests.conftest import KilnProcess


def kiln(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kiln", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def test_version() -> None:
    result = kiln("--version")
    assert result.returncode == 0
    assert result.stdout.strip() == f"kiln, version {__version__}"


def test_repo_example_builds_loadable_models(
    tmp_path: Path, make_server: type[KilnProcess]
) -> None:
    repo = tmp_path / "models"
    result = kiln("repo", "example", str(repo))
    assert result.returncode == 0, result.stderr
    assert sorted(p.name for p in repo.iterdir()) == sorted(EXAMPLE_MODELS)
    for name in EXAMPLE_MODELS:
        assert f"built {repo / name}" in result.stdout
        # an ensemble's version folder stays empty: its steps are the other models
        files = {p.name for p in (repo / name / "1").iterdir()}
        assert files in ({"model.onnx"}, {"model.py"}, {"model.pt"}) or name.endswith("_pipeline")
    assert check_repository(repo) == []

    again = kiln("repo", "example", str(repo), "--model", "simple")
    assert again.returncode == 1 and "already exist" in again.stderr
    assert kiln("repo", "example", str(repo), "--model", "simple", "--overwrite").returncode == 0
    unknown = kiln("repo", "example", str(tmp_path / "x"), "--model", "resnet")
    assert unknown.returncode == 1 and "unknown example model" in unknown.stderr

    server = make_server(repo).start()
    client = httpclient.InferenceServerClient(server.http_url)
    index = client.get_model_repository_index()
    assert {(r["name"], r["state"]) for r in index} == {(n, "READY") for n in EXAMPLE_MODELS}


def test_repo_check_ok_on_the_example_repository(example_repo: Path) -> None:
    result = kiln("repo", "check", str(example_repo))
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"{example_repo}: OK"


def test_repo_check_reports_every_problem_with_file_and_line(
    example_repo: Path, tmp_path: Path
) -> None:
    repo = tmp_path / "repo"
    shutil.copytree(example_repo, repo)
    simple = repo / "simple" / "config.pbtxt"
    simple.write_text(simple.read_text().replace("TYPE_INT32", "TYPE_INT33", 1))
    cnn = repo / "cnn" / "config.pbtxt"
    cnn.write_text(cnn.read_text().replace("max_batch_size: 32", "max_batch_size: 32\nbatch: 1"))
    result = kiln("repo", "check", str(repo))
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert lines[-1] == "2 problem(s) found"
    assert lines[0].startswith(f"{cnn}:4:") and 'unknown field "batch"' in lines[0]
    assert lines[1].startswith(f"{simple}:7:") and "TYPE_INT33" in lines[1]
    assert 'did you mean "TYPE_INT32"' in lines[1]


def test_repo_check_missing_folder(tmp_path: Path) -> None:
    result = kiln("repo", "check", str(tmp_path / "nope"))
    assert result.returncode == 2 and "does not exist" in result.stderr


def test_serve_with_missing_repository_fails_clearly(tmp_path: Path) -> None:
    missing = tmp_path / "nope"
    result = kiln("serve", "--model-repository", str(missing), "--http-port", "0")
    assert result.returncode == 2
    assert f"'{missing}' is not a folder" in result.stderr
    assert "--model-repository" in result.stderr


def test_serve_with_bad_control_mode() -> None:
    result = kiln("serve", "--model-repository", ".", "--model-control-mode", "sometimes")
    assert result.returncode == 2 and "sometimes" in result.stderr
