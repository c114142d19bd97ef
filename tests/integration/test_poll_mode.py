"""Model control mode poll: added, changed and removed models are picked up while serving."""

from __future__ import annotations

import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from tests.conftest import KilnProcess


def wait_until(predicate: Callable[[], bool], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.1)
    raise AssertionError("condition not reached while polling")


def _states(client: httpclient.InferenceServerClient) -> dict[str, tuple[str, str]]:
    return {
        (m["name"]): (m.get("version", ""), m.get("state", ""))
        for m in client.get_model_repository_index()
    }


def _simple_inputs() -> list[httpclient.InferInput]:
    a = np.arange(16, dtype=np.int32).reshape(1, 16)
    inputs = [
        httpclient.InferInput("INPUT0", [1, 16], "INT32"),
        httpclient.InferInput("INPUT1", [1, 16], "INT32"),
    ]
    inputs[0].set_data_from_numpy(a)
    inputs[1].set_data_from_numpy(a)
    return inputs


def test_poll_picks_up_added_changed_and_removed_models(
    example_repo: Path, tmp_path: Path, make_server: type[KilnProcess]
) -> None:
    repo = tmp_path / "repo"
    repo.mkdir()
    for name in ("simple", "mlp"):
        shutil.copytree(example_repo / name, repo / name)
    server = make_server(
        repo, args=["--model-control-mode", "poll", "--repository-poll-secs", "0.2"]
    ).start()
    client = httpclient.InferenceServerClient(server.http_url)
    assert client.is_model_ready("simple")
    assert not client.is_model_ready("cnn")

    # Explicit load/unload is refused while polling.
    with pytest.raises(InferenceServerException, match="polling is enabled"):
        client.load_model("simple")

    # Continuous traffic on `simple` while a new version replaces the old one.
    failures: list[str] = []
    served = [0]
    stop = threading.Event()

    def traffic() -> None:
        c = httpclient.InferenceServerClient(server.http_url)
        deadline = time.monotonic() + 60
        while not stop.is_set() and time.monotonic() < deadline:
            try:
                out = c.infer("simple", _simple_inputs()).as_numpy("OUTPUT0")
                assert out is not None and int(out[0, 1]) == 2
                served[0] += 1
            except Exception as exc:  # recorded, asserted below
                failures.append(repr(exc))

    worker = threading.Thread(target=traffic)
    worker.start()
    try:
        wait_until(lambda: served[0] > 5)
        # Added model.
        shutil.copytree(example_repo / "cnn", repo / "cnn")
        # Changed model: version 2 appears; the default policy serves only the latest.
        shutil.copytree(repo / "simple" / "1", repo / "simple" / "2")
        # Removed model.
        shutil.rmtree(repo / "mlp")
        wait_until(lambda: client.is_model_ready("cnn"))
        wait_until(lambda: client.is_model_ready("simple", "2"))
        wait_until(lambda: not client.is_model_ready("mlp"))
        before = served[0]
        wait_until(lambda: served[0] > before + 5)
    finally:
        stop.set()
        worker.join()

    assert failures == []
    assert not client.is_model_ready("simple", "1")
    assert client.get_model_metadata("simple")["versions"] == ["2"]
    result = client.infer("simple", _simple_inputs(), model_version="2")
    assert int(result.as_numpy("OUTPUT1")[0, 3]) == 0
    states = _states(client)
    assert states["cnn"] == ("1", "READY")
    assert states["mlp"][1] == "UNAVAILABLE"


def test_poll_reports_broken_config_and_recovers(
    example_repo: Path, tmp_path: Path, make_server: type[KilnProcess]
) -> None:
    repo = tmp_path / "repo"
    repo.mkdir()
    shutil.copytree(example_repo / "simple", repo / "simple")
    server = make_server(
        repo, args=["--model-control-mode", "poll", "--repository-poll-secs", "0.2"]
    ).start()
    client = httpclient.InferenceServerClient(server.http_url)
    config = repo / "simple" / "config.pbtxt"
    good = config.read_text()
    config.write_text(good.replace("max_batch_size", "max_batch_sizee"))

    def reason() -> str:
        rows = [m for m in client.get_model_repository_index() if m["name"] == "simple"]
        return str(rows[0].get("reason", ""))

    wait_until(lambda: "max_batch_sizee" in reason())
    assert "config.pbtxt:" in reason()
    # A failed reload keeps the old version serving.
    assert client.is_model_ready("simple")
    assert client.infer("simple", _simple_inputs()).as_numpy("OUTPUT0") is not None
    config.write_text(good)
    wait_until(lambda: reason() == "")
    assert client.is_model_ready("simple")
