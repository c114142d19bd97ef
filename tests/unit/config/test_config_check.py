"""``check_repository``: every problem of a whole repository, each with file and line."""

from __future__ import annotations

import shutil
from pathlib import Path

from onnx import TensorProto

from kiln.config.check import check_repository, default_model_filename, version_folders
from kiln.config.loader import parse_config_text
from tests.onnx_models import identity_model


def _copy(example_repo: Path, tmp_path: Path) -> Path:
    repo = tmp_path / "repo"
    shutil.copytree(example_repo, repo)
    return repo


def test_example_repository_is_clean(example_repo: Path) -> None:
    assert check_repository(example_repo) == []


def test_every_problem_is_reported_with_file_and_line(example_repo: Path, tmp_path: Path) -> None:
    repo = _copy(example_repo, tmp_path)
    simple_cfg = repo / "simple" / "config.pbtxt"
    simple_cfg.write_text(simple_cfg.read_text().replace("max_batch_size", "max_batch_sise"))
    mlp_cfg = repo / "mlp" / "config.pbtxt"
    mlp_cfg.write_text(mlp_cfg.read_text().replace('name: "mlp"', 'name: "wrong"'))
    (repo / "cnn" / "1" / "model.onnx").unlink()
    (repo / "empty").mkdir()

    problems = check_repository(repo)
    by_path = {p.path: p for p in problems}
    assert set(by_path) == {
        str(simple_cfg),
        str(mlp_cfg),
        str(repo / "cnn" / "1" / "model.onnx"),
        str(repo / "empty"),
    }
    simple = by_path[str(simple_cfg)]
    assert simple.line == 3 and "max_batch_sise" in str(simple)
    assert str(simple).startswith(f"{simple_cfg}:3:")
    assert by_path[str(mlp_cfg)].line == 1 and by_path[str(mlp_cfg)].field == "name"
    assert "missing model file model.onnx" in str(by_path[str(repo / "cnn" / "1" / "model.onnx")])
    assert "no config.pbtxt" in str(by_path[str(repo / "empty")])
    assert problems == sorted(problems, key=lambda p: p.sort_key())


def test_one_config_with_several_problems(tmp_path: Path) -> None:
    model = tmp_path / "m"
    (model / "1").mkdir(parents=True)
    (model / "1" / "model.onnx").write_bytes(b"")
    (model / "config.pbtxt").write_text(
        'name: "m"\nmax_batch_size: -1\ninput [ { name: "a" data_type: TYPE_FP32 } ]\n'
        "version_policy { specific { versions: [ 1, 4 ] } }\n"
    )
    problems = check_repository(tmp_path)
    assert [(p.field, p.line) for p in problems] == [
        ("max_batch_size", 2),
        ("input[0].dims", 3),
        ("version_policy", 4),
    ]
    assert "version 4" in problems[2].message


def test_no_config_is_fine_for_onnx_and_no_version_folder_is_not(tmp_path: Path) -> None:
    identity_model(tmp_path / "auto" / "1" / "model.onnx", [("x", TensorProto.FLOAT, [2])])
    (tmp_path / "noversion").mkdir()
    (tmp_path / "noversion" / "config.pbtxt").write_text('platform: "onnxruntime_onnx"\n')
    (tmp_path / ".hidden").mkdir()  # ignored, like Triton
    problems = check_repository(tmp_path)
    assert [(p.path, p.message) for p in problems] == [
        (str(tmp_path / "noversion"), "no numeric version folder (e.g. 1/)")
    ]


def test_missing_repository() -> None:
    (problem,) = check_repository(Path("/nonexistent/kiln/repo"))
    assert "not a folder" in str(problem)


def test_version_folders_follow_triton(tmp_path: Path) -> None:
    for name in ("1", "10", "2", "01", "abc", "0"):
        (tmp_path / name).mkdir()
    (tmp_path / "3").write_text("a file")
    assert [p.name for p in version_folders(tmp_path)] == ["0", "1", "2", "10"]


def test_default_model_filename() -> None:
    assert default_model_filename(parse_config_text('platform: "onnxruntime_onnx"')) == (
        "model.onnx"
    )
    assert default_model_filename(parse_config_text('backend: "python"')) == "model.py"
    assert default_model_filename(parse_config_text('default_model_filename: "x.onnx"')) == (
        "x.onnx"
    )
    assert default_model_filename(parse_config_text('platform: "ensemble"')) is None
