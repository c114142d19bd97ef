"""Model repositories in Google Cloud Storage (gs://) and Azure Blob Storage (as://), each
against a real emulator in its own process on loopback: ``gcp-storage-emulator`` (PyPI,
the GCS JSON API) and Microsoft's Azurite (npm, installed by ``make interop-deps``), with a
real ``kiln serve`` and the real ``tritonclient``. What both share with s3:// (the cache,
key safety) is tested once, in test_s3_repository.py."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.http as httpclient

from tests.conftest import KilnProcess, free_port

pytest.importorskip("google.cloud.storage")
pytest.importorskip("azure.storage.blob")

AZURITE = Path(__file__).parent.parent / "interop" / "azurite" / "node_modules" / ".bin"
BUCKET = "kiln-models"
# Azurite's well-known development account (published in Microsoft's docs)
AZ_ACCOUNT = "devstoreaccount1"
AZ_KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="


def _wait(check: Callable[[], Any], proc: subprocess.Popen[bytes], what: str) -> None:
    deadline = time.monotonic() + 60
    while True:
        try:
            check()
            return
        except Exception:
            if time.monotonic() > deadline or proc.poll() is not None:
                raise AssertionError(f"{what} did not start") from None
            time.sleep(0.2)


class Store:
    """An emulator process, a client to fill it, and what kiln needs to reach it."""

    scheme = ""
    env: dict[str, str]
    proc: subprocess.Popen[bytes]

    def url(self, path: str = "models") -> str:
        raise NotImplementedError

    def put(self, key: str, data: bytes) -> None:
        raise NotImplementedError

    def delete(self, key: str) -> None:
        raise NotImplementedError

    def upload(self, folder: Path, prefix: str) -> None:
        for path in sorted(folder.rglob("*")):
            if path.is_file():
                self.put(f"{prefix}/{path.relative_to(folder).as_posix()}", path.read_bytes())

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)


class GCSEmulator(Store):
    scheme = "gs"

    def __init__(self, log: Path) -> None:
        from google.auth.credentials import AnonymousCredentials
        from google.cloud import storage

        port = free_port()
        out = open(log, "wb")  # noqa: SIM115 - closed with the process
        exe = Path(sys.executable).parent / "gcp-storage-emulator"
        self.proc = subprocess.Popen(
            [str(exe), "start", "--host", "127.0.0.1", "--port", str(port), "--in-memory"],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
        out.close()
        self.env = {"STORAGE_EMULATOR_HOST": f"http://127.0.0.1:{port}"}
        os.environ.update(self.env)  # the client reads it at construction
        self.client = storage.Client(project="kiln", credentials=AnonymousCredentials())
        _wait(lambda: list(self.client.list_buckets()), self.proc, "gcp-storage-emulator")
        self.bucket = self.client.create_bucket(BUCKET)

    def url(self, path: str = "models") -> str:
        return f"gs://{BUCKET}/{path}"

    def put(self, key: str, data: bytes) -> None:
        self.bucket.blob(key).upload_from_string(data)

    def delete(self, key: str) -> None:
        self.bucket.blob(key).delete()


class Azurite(Store):
    scheme = "as"

    def __init__(self, log: Path, workdir: Path) -> None:
        from azure.storage.blob import BlobServiceClient

        exe = AZURITE / "azurite-blob"
        if not exe.exists():
            pytest.skip("Azurite is not installed: make interop-deps")
        port = free_port()
        out = open(log, "wb")  # noqa: SIM115 - closed with the process
        self.proc = subprocess.Popen(
            [str(exe), "--blobHost", "127.0.0.1", "--blobPort", str(port), "--location",
             str(workdir), "--silent", "--skipApiVersionCheck"],
            stdout=out, stderr=subprocess.STDOUT,
        )  # fmt: skip
        out.close()
        self.connection = (
            f"DefaultEndpointsProtocol=http;AccountName={AZ_ACCOUNT};AccountKey={AZ_KEY};"
            f"BlobEndpoint=http://127.0.0.1:{port}/{AZ_ACCOUNT};"
        )
        self.env = {"AZURE_STORAGE_CONNECTION_STRING": self.connection}
        service = BlobServiceClient.from_connection_string(self.connection)
        _wait(lambda: list(service.list_containers()), self.proc, "Azurite")
        self.container = service.create_container(BUCKET)

    def url(self, path: str = "models") -> str:
        return f"as://{AZ_ACCOUNT}/{BUCKET}/{path}"

    def put(self, key: str, data: bytes) -> None:
        self.container.upload_blob(key, data, overwrite=True)

    def delete(self, key: str) -> None:
        self.container.delete_blob(key)


@pytest.fixture(params=["gs", "as"])
def store(
    request: pytest.FixtureRequest,
    tmp_path: Path,
    example_repo: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> Iterator[Store]:
    """A bucket (container) holding the example model ``simple`` under ``models/``."""
    for var in ("STORAGE_EMULATOR_HOST", "AZURE_STORAGE_CONNECTION_STRING", "AZURE_STORAGE_KEY",
                "GOOGLE_APPLICATION_CREDENTIALS"):  # fmt: skip
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("KILN_MODEL_CACHE_DIR", str(tmp_path / "cache"))
    log = tmp_path / f"{request.param}-emulator.log"
    server: Store = (
        GCSEmulator(log) if request.param == "gs" else Azurite(log, tmp_path / "azurite")
    )
    for var, value in server.env.items():
        monkeypatch.setenv(var, value)
    server.upload(example_repo / "simple", "models/simple")
    yield server
    server.stop()


def start(make_server: type[KilnProcess], tmp_path: Path, repo_url: str, *args: str) -> Any:
    home = tmp_path / "kiln"
    home.mkdir(exist_ok=True)
    return make_server(home / "repo", args=list(args), repository_url=repo_url).start()


def infer_simple(server: KilnProcess, version: str = "") -> list[int]:
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
    return [int(v) for v in out[0]]


def wait_until(predicate: Callable[[], bool], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.1)
    raise AssertionError("condition not reached")


def test_serves_from_the_bucket_and_a_restart_downloads_nothing(
    store: Store, tmp_path: Path, make_server: type[KilnProcess]
) -> None:
    server = start(make_server, tmp_path, store.url())
    assert infer_simple(server) == [i + 1 for i in range(16)]
    assert "2 file(s) fetched, 0 from the local cache" in server.log()
    assert server.stop() == 0
    again = start(make_server, tmp_path, store.url())
    assert infer_simple(again) == [i + 1 for i in range(16)]
    assert "0 file(s) fetched, 2 from the local cache" in again.log()
    cache = tmp_path / "cache"
    assert next(p.name for p in cache.iterdir()).startswith(f"{store.scheme}-{BUCKET}-")


def test_poll_picks_up_an_uploaded_version_and_a_removed_one(
    store: Store, example_repo: Path, tmp_path: Path, make_server: type[KilnProcess]
) -> None:
    server = start(make_server, tmp_path, store.url(), "--model-control-mode", "poll",
                   "--repository-poll-secs", "0.2")  # fmt: skip
    client = httpclient.InferenceServerClient(server.http_url)
    assert client.is_model_ready("simple", "1")
    store.put("models/simple/2/model.onnx", (example_repo / "simple/1/model.onnx").read_bytes())
    wait_until(lambda: client.is_model_ready("simple", "2"))
    assert infer_simple(server, "2") == [i + 1 for i in range(16)]
    store.delete("models/simple/2/model.onnx")
    wait_until(lambda: client.is_model_ready("simple", "1"))
    assert not client.is_model_ready("simple", "2")


def test_an_unreachable_store_or_missing_bucket_stops_kiln_at_start(
    store: Store, tmp_path: Path
) -> None:
    def serve(repo_url: str, env: dict[str, str]) -> tuple[int, str]:
        cmd = [sys.executable, "-m", "kiln", "serve", "--model-repository", repo_url,
               "--http-port", str(free_port()), "--grpc-port", str(free_port()),
               "--metrics-port", str(free_port())]  # fmt: skip
        done = subprocess.run(cmd, env={**os.environ, **env}, capture_output=True, text=True,
                              timeout=180, cwd=tmp_path)  # fmt: skip
        return done.returncode, done.stdout + done.stderr

    missing = store.url().replace(BUCKET, "no-such-bucket")
    code, out = serve(missing, {})
    assert code != 0 and f"model repository '{missing}'" in out
    assert "does not exist" in out
    if store.scheme == "as":  # the account key is checked: a wrong one is refused
        wrong = store.env["AZURE_STORAGE_CONNECTION_STRING"].replace(AZ_KEY, "d3Jvbmc=" * 11)
        code, out = serve(store.url(), {"AZURE_STORAGE_CONNECTION_STRING": wrong})
        assert code != 0 and "credentials were refused" in out, out
    nowhere = {
        "gs": {"STORAGE_EMULATOR_HOST": f"http://127.0.0.1:{free_port()}"},
        "as": {"AZURE_STORAGE_CONNECTION_STRING": store.env.get(
            "AZURE_STORAGE_CONNECTION_STRING", "").rsplit("BlobEndpoint=", 1)[0]
            + f"BlobEndpoint=http://127.0.0.1:{free_port()}/{AZ_ACCOUNT};"},
    }[store.scheme]  # fmt: skip
    code, out = serve(store.url(), nowhere)
    assert code != 0 and f"model repository '{store.url()}'" in out
    assert "cannot reach" in out, out
