"""Model repositories in S3: a real S3-compatible server (moto, in its own process on
loopback), a real ``kiln serve`` and the real ``tritonclient``."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from tests.conftest import KilnProcess, free_port

boto3 = pytest.importorskip("boto3")
pytest.importorskip("moto.server")

BUCKET = "kiln-models"
KEYS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing"}


class MotoServer:
    """``python -m moto.server`` on 127.0.0.1 and a free port."""

    def __init__(self, log: Path) -> None:
        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        out = open(log, "wb")  # noqa: SIM115 - closed with the process
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
        out.close()
        self.client = boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            region_name="us-east-1",
            aws_access_key_id="testing",
            aws_secret_access_key="testing",
        )
        deadline = time.monotonic() + 30
        while True:
            try:
                self.client.list_buckets()
                break
            except Exception:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    raise
                time.sleep(0.1)

    def upload(self, folder: Path, prefix: str) -> None:
        for path in sorted(folder.rglob("*")):
            if path.is_file():
                key = f"{prefix}/{path.relative_to(folder).as_posix()}"
                self.client.put_object(Bucket=BUCKET, Key=key, Body=path.read_bytes())

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)


@pytest.fixture
def moto(tmp_path: Path) -> Iterator[MotoServer]:
    server = MotoServer(tmp_path / "moto.log")
    yield server
    server.stop()


@pytest.fixture
def bucket(moto: MotoServer, example_repo: Path) -> MotoServer:
    """A bucket holding the example model ``simple`` under ``models/``."""
    moto.client.create_bucket(Bucket=BUCKET)
    moto.upload(example_repo / "simple", "models/simple")
    return moto


@pytest.fixture
def s3_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """Credentials in the environment (as a deployment sets them) and a cache folder."""
    for var in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "TRITON_AWS_MOUNT_DIRECTORY"):
        monkeypatch.delenv(var, raising=False)
    for var, value in KEYS.items():
        monkeypatch.setenv(var, value)
    cache = tmp_path / "cache"
    monkeypatch.setenv("KILN_MODEL_CACHE_DIR", str(cache))
    return cache


def url(moto: MotoServer, path: str = "models") -> str:
    return f"s3://127.0.0.1:{moto.port}/{BUCKET}/{path}"


def start(make_server: type[KilnProcess], tmp_path: Path, repo_url: str, *args: str) -> Any:
    home = tmp_path / "kiln"
    home.mkdir(exist_ok=True)
    return make_server(home / "repo", args=list(args), repository_url=repo_url).start()


def infer_simple(server: KilnProcess, version: str = "") -> np.ndarray:
    client = httpclient.InferenceServerClient(server.http_url)
    a = np.arange(16, dtype=np.int32).reshape(1, 16)
    inputs = [
        httpclient.InferInput("INPUT0", [1, 16], "INT32"),
        httpclient.InferInput("INPUT1", [1, 16], "INT32"),
    ]
    inputs[0].set_data_from_numpy(a)
    inputs[1].set_data_from_numpy(np.ones_like(a))
    out = client.infer("simple", inputs, model_version=version).as_numpy("OUTPUT0")
    assert out is not None
    return out


def metric(server: KilnProcess, name: str) -> float:
    with urllib.request.urlopen(server.metrics_url, timeout=5) as resp:
        text = resp.read().decode()
    match = re.search(rf"^{name}\{{[^}}]*\}} (\S+)$", text, re.M)
    assert match, f"{name} not in /metrics"
    return float(match.group(1))


def wait_until(predicate: Callable[[], bool], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.1)
    raise AssertionError("condition not reached")


def cached_files(cache: Path) -> dict[str, tuple[int, int]]:
    """(inode, mtime_ns) of each cached model file: a new download replaces the file."""
    return {
        str(p.relative_to(cache)): (p.stat().st_ino, p.stat().st_mtime_ns)
        for p in cache.rglob("*")
        if p.is_file() and ".kiln-manifests" not in p.parts
    }


def test_serves_from_bucket_and_restart_downloads_nothing(
    bucket: MotoServer, s3_env: Path, tmp_path: Path, make_server: type[KilnProcess]
) -> None:
    server = start(make_server, tmp_path, url(bucket))
    out = infer_simple(server)
    assert out.tolist()[0] == [i + 1 for i in range(16)]
    assert metric(server, "kiln_repository_downloads_total") == 2  # config + model.onnx
    assert metric(server, "kiln_repository_errors_total") == 0
    first = cached_files(s3_env)
    assert sorted(Path(k).name for k in first) == ["config.pbtxt", "model.onnx"]
    assert server.stop() == 0

    again = start(make_server, tmp_path, url(bucket))
    assert infer_simple(again).tolist() == out.tolist()
    assert metric(again, "kiln_repository_downloads_total") == 0
    assert cached_files(s3_env) == first  # same files, not written again
    assert "0 file(s) fetched, 2 from the local cache" in again.log()


def test_explicit_load_and_unload(
    bucket: MotoServer,
    s3_env: Path,
    example_repo: Path,
    tmp_path: Path,
    make_server: type[KilnProcess],
) -> None:
    server = start(make_server, tmp_path, url(bucket), "--model-control-mode", "explicit")
    client = httpclient.InferenceServerClient(server.http_url)
    assert not client.is_model_ready("simple")
    client.load_model("simple")
    assert client.is_model_ready("simple")
    infer_simple(server)
    client.unload_model("simple")
    wait_until(lambda: not client.is_model_ready("simple"))
    with pytest.raises(InferenceServerException, match="no model folder 'absent'"):
        client.load_model("absent")
    # A model uploaded after start is found by its load.
    bucket.upload(example_repo / "mlp", "models/mlp")
    client.load_model("mlp")
    assert client.is_model_ready("mlp")


def test_poll_picks_up_an_uploaded_version_and_a_removed_one(
    bucket: MotoServer,
    s3_env: Path,
    example_repo: Path,
    tmp_path: Path,
    make_server: type[KilnProcess],
) -> None:
    server = start(
        make_server,
        tmp_path,
        url(bucket),
        "--model-control-mode",
        "poll",
        "--repository-poll-secs",
        "0.2",
    )
    client = httpclient.InferenceServerClient(server.http_url)
    assert client.is_model_ready("simple", "1")
    model = (example_repo / "simple" / "1" / "model.onnx").read_bytes()
    bucket.client.put_object(Bucket=BUCKET, Key="models/simple/2/model.onnx", Body=model)
    # version_policy latest 1 (the default): version 2 replaces version 1
    wait_until(lambda: client.is_model_ready("simple", "2"))
    assert not client.is_model_ready("simple", "1")
    infer_simple(server, "2")
    assert next(s3_env.glob("*/simple/2/model.onnx")).read_bytes() == model

    bucket.client.delete_object(Bucket=BUCKET, Key="models/simple/2/model.onnx")
    wait_until(lambda: client.is_model_ready("simple", "1"))
    assert not client.is_model_ready("simple", "2")
    assert not list(s3_env.glob("*/simple/2"))  # the removed version left the cache too
    infer_simple(server, "1")


def test_poll_keeps_serving_when_the_bucket_goes_away(
    bucket: MotoServer, s3_env: Path, tmp_path: Path, make_server: type[KilnProcess]
) -> None:
    server = start(
        make_server,
        tmp_path,
        url(bucket),
        "--model-control-mode",
        "poll",
        "--repository-poll-secs",
        "0.2",
    )
    bucket.stop()
    wait_until(lambda: metric(server, "kiln_repository_errors_total") >= 2)
    assert server.proc is not None and server.proc.poll() is None
    infer_simple(server)
    assert httpclient.InferenceServerClient(server.http_url).is_model_ready("simple")
    assert f"model repository '{url(bucket)}': cannot reach" in server.log()
    assert "the models keep serving as loaded" in server.log()


def test_a_key_with_dot_dot_is_refused_and_writes_nothing_outside(
    bucket: MotoServer, s3_env: Path, tmp_path: Path, make_server: type[KilnProcess]
) -> None:
    hostile = "models/simple/1/../../../../../escaped.txt"
    bucket.client.put_object(Bucket=BUCKET, Key=hostile, Body=b"evil")
    server = start(make_server, tmp_path, url(bucket), "--model-control-mode", "explicit")
    client = httpclient.InferenceServerClient(server.http_url)
    with pytest.raises(InferenceServerException, match=re.escape(f"object key '{hostile}'")):
        client.load_model("simple")
    assert not client.is_model_ready("simple")
    assert not list(tmp_path.rglob("escaped.txt"))
    assert server.proc is not None and server.proc.poll() is None
    assert metric(server, "kiln_repository_errors_total") >= 1


def _serve_exits(repo_url: str, env: dict[str, str], tmp_path: Path) -> tuple[int, str]:
    cmd = [
        sys.executable, "-m", "kiln", "serve", "--model-repository", repo_url,
        "--http-port", str(free_port()), "--grpc-port", str(free_port()),
        "--metrics-port", str(free_port()),
    ]  # fmt: skip
    done = subprocess.run(
        cmd, env={**os.environ, **env}, capture_output=True, text=True, timeout=120, cwd=tmp_path
    )
    return done.returncode, done.stdout + done.stderr


def test_wrong_credentials_stop_kiln_at_start(
    bucket: MotoServer, s3_env: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # moto checks credentials once told to: an IAM user's key works, another does not.
    iam = boto3.client(
        "iam",
        endpoint_url=bucket.endpoint,
        region_name="us-east-1",
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
    )
    iam.create_user(UserName="kiln")
    iam.put_user_policy(
        UserName="kiln",
        PolicyName="s3",
        PolicyDocument='{"Version":"2012-10-17","Statement":[{"Effect":"Allow",'
        '"Action":"s3:*","Resource":"*"}]}',
    )
    key = iam.create_access_key(UserName="kiln")["AccessKey"]
    req = urllib.request.Request(
        f"{bucket.endpoint}/moto-api/reset-auth",
        b"0",
        headers={"Content-Type": "text/plain"},
        method="POST",
    )
    urllib.request.urlopen(req, timeout=10).close()

    from kiln.repository.s3 import S3Source

    monkeypatch.setenv("AWS_ACCESS_KEY_ID", key["AccessKeyId"])
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", key["SecretAccessKey"])
    source = S3Source(url(bucket), tmp_path / "c")
    source.refresh()
    assert source.model_names() == ["simple"]  # the right key reads the bucket

    wrong = {"AWS_ACCESS_KEY_ID": "AKIAWRONGWRONGWRONG0", "AWS_SECRET_ACCESS_KEY": "wrong"}
    code, out = _serve_exits(url(bucket), wrong, tmp_path)
    assert code != 0
    assert f"model repository '{url(bucket)}'" in out
    assert "credentials were refused (InvalidAccessKeyId)" in out


def test_unreachable_endpoint_or_missing_bucket_stop_kiln_at_start(
    bucket: MotoServer, s3_env: Path, tmp_path: Path
) -> None:
    nowhere = f"s3://127.0.0.1:{free_port()}/{BUCKET}/models"
    code, out = _serve_exits(nowhere, {}, tmp_path)
    assert code != 0
    assert f"model repository '{nowhere}': cannot reach http://127.0.0.1:" in out

    missing = f"s3://127.0.0.1:{bucket.port}/no-such-bucket/models"
    code, out = _serve_exits(missing, {}, tmp_path)
    assert code != 0
    assert f"model repository '{missing}': bucket 'no-such-bucket' does not exist" in out


def test_only_changed_objects_are_fetched_again(bucket: MotoServer, s3_env: Path) -> None:
    from kiln.repository.s3 import S3Source

    source = S3Source(url(bucket), s3_env)
    folder = source.locate("simple")
    assert folder is not None and source.downloads == 2
    model = folder / "1" / "model.onnx"
    before = (model.stat().st_ino, model.stat().st_mtime_ns)
    assert source.locate("simple") == folder and source.downloads == 2  # nothing changed

    config = (folder / "config.pbtxt").read_text() + "\n# edited\n"
    bucket.client.put_object(Bucket=BUCKET, Key="models/simple/config.pbtxt", Body=config)
    source.locate("simple")
    assert source.downloads == 3  # the config only (new ETag and size)
    assert (folder / "config.pbtxt").read_text() == config
    assert (model.stat().st_ino, model.stat().st_mtime_ns) == before
    # the manifest is kept outside the model folder: backends never see it
    assert sorted(p.name for p in folder.iterdir()) == ["1", "config.pbtxt"]


def test_an_absolute_key_component_is_refused(bucket: MotoServer, s3_env: Path) -> None:
    from kiln.repository.s3 import S3Source
    from kiln.repository.source import RepositoryError

    bucket.client.put_object(Bucket=BUCKET, Key="models/simple//tmp/abs.txt", Body=b"evil")
    source = S3Source(url(bucket), s3_env)
    with pytest.raises(
        RepositoryError, match=re.escape("'models/simple//tmp/abs.txt' is not a plain")
    ):
        source.locate("simple")
    assert not list(s3_env.rglob("abs.txt")) and not Path("/tmp/abs.txt").exists()
    assert source.errors == 1
