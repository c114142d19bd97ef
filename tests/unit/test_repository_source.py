"""Repository sources: s3:// URL forms, object-key safety, schemes kiln refuses."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from kiln.cli import main
from kiln.repository.s3 import S3Location, parse_url, safe_relative
from kiln.repository.source import LocalSource, RepositoryError, open_source


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("s3://bucket/path/to/repo", S3Location(None, "bucket", "path/to/repo/")),
        ("s3://bucket", S3Location(None, "bucket", "")),
        ("s3://bucket/", S3Location(None, "bucket", "")),
        ("s3://host:9000/bucket/models/", S3Location("http://host:9000", "bucket", "models/")),
        ("s3://http://10.0.0.1:9000/b/m", S3Location("http://10.0.0.1:9000", "b", "m/")),
        ("s3://https://minio.local:443/b/a/b", S3Location("https://minio.local:443", "b", "a/b/")),
    ],
)
def test_triton_url_forms(url: str, expected: S3Location) -> None:
    assert parse_url(url) == expected


@pytest.mark.parametrize("url", ["s3://", "s3://host:9000", "s3://https://", "s3://https://h:1/"])
def test_url_without_a_bucket_is_refused(url: str) -> None:
    with pytest.raises(RepositoryError, match=f"model repository '{url}': expected s3://"):
        parse_url(url)


@pytest.mark.parametrize(
    "rel", ["../x", "1/../../x", "/etc/passwd", "1//model.onnx", "./config.pbtxt", "1/\x00"]
)
def test_unsafe_keys_are_refused(rel: str) -> None:
    with pytest.raises(RepositoryError, match="not a plain relative path"):
        safe_relative(f"models/simple/{rel}", rel)


def test_plain_keys_pass() -> None:
    assert safe_relative("m/simple/1/model.onnx", "1/model.onnx") == "1/model.onnx"
    assert safe_relative("m/simple/1/..onnx", "1/..onnx") == "1/..onnx"


def test_a_folder_is_a_local_source(tmp_path: Path) -> None:
    (tmp_path / "simple" / "1").mkdir(parents=True)
    (tmp_path / ".hidden").mkdir()
    source = open_source(str(tmp_path))
    assert isinstance(source, LocalSource)
    assert source.model_names() == ["simple"]
    assert source.locate("simple") == tmp_path.resolve() / "simple"
    assert source.locate("absent") is None
    assert list(source.fingerprints()) == ["simple"]


@pytest.mark.parametrize(("url", "extra"), [("gs://b/models", "gcs"), ("as://acct/c/m", "azure")])
def test_gcs_and_azure_are_refused_naming_the_extra(url: str, extra: str) -> None:
    with pytest.raises(RepositoryError, match=rf"kiln\[{extra}\]"):
        open_source(url)
    result = CliRunner().invoke(main, ["serve", "--model-repository", url])
    assert result.exit_code == 1
    assert f"model repository '{url}'" in result.output
    assert f"kiln[{extra}]" in result.output


def test_a_missing_folder_is_still_a_usage_error(tmp_path: Path) -> None:
    result = CliRunner().invoke(main, ["serve", "--model-repository", str(tmp_path / "nope")])
    assert result.exit_code == 2
    assert "is not a folder" in result.output
