"""Repository sources: s3://, gs:// and as:// URL forms, object-key safety, a missing
client library named with its extra, schemes kiln refuses."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from kiln.cli import main
from kiln.repository import azure, gcs
from kiln.repository.object_store import safe_relative
from kiln.repository.s3 import S3Location, parse_url
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


@pytest.mark.parametrize(
    ("url", "expected"),
    [("gs://bucket/path/to/repo/", ("bucket", "path/to/repo/")), ("gs://b", ("b", ""))],
)
def test_gcs_url_forms(url: str, expected: tuple[str, str]) -> None:
    assert gcs.parse_url(url) == expected


@pytest.mark.parametrize(
    ("url", "expected"),
    [("as://acct/container/path/to/repo", ("acct", "container", "path/to/repo/")),
     ("as://acct/c/", ("acct", "c", ""))],
)  # fmt: skip
def test_azure_url_forms(url: str, expected: tuple[str, str, str]) -> None:
    assert azure.parse_url(url) == expected


@pytest.mark.parametrize(
    ("url", "message"),
    [("gs://", "expected gs://bucket/path"), ("gs://host:1/b", "expected gs://bucket/path"),
     ("as://acct", "expected as://account_name/container_name/path"),
     ("as://acct/", "expected as://account_name/container_name/path"),
     ("ftp://h/x", "unknown scheme 'ftp://'")],
)  # fmt: skip
def test_malformed_urls_are_refused(url: str, message: str) -> None:
    with pytest.raises(RepositoryError, match=message):
        open_source(url)


@pytest.mark.parametrize(
    ("url", "module", "extra"),
    [("s3://b/m", "boto3", "s3"), ("gs://b/models", "google.cloud.storage", "gcs"),
     ("as://acct/c/m", "azure.storage.blob", "azure")],
)  # fmt: skip
def test_a_missing_client_library_names_the_extra(
    url: str, module: str, extra: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, module, None)  # import of it raises ImportError
    with pytest.raises(RepositoryError, match=rf"pip install 'kiln\[{extra}\]'"):
        open_source(url)
    result = CliRunner().invoke(main, ["serve", "--model-repository", url])
    assert result.exit_code == 1
    assert f"model repository '{url}'" in result.output and f"kiln[{extra}]" in result.output


def test_a_missing_folder_is_still_a_usage_error(tmp_path: Path) -> None:
    result = CliRunner().invoke(main, ["serve", "--model-repository", str(tmp_path / "nope")])
    assert result.exit_code == 2
    assert "is not a folder" in result.output
