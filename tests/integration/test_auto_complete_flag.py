"""``kiln serve --disable-auto-complete-config``: configs served as written, as on Triton."""

from __future__ import annotations

import shutil
from collections.abc import Iterator

import numpy as np
import pytest
import tritonclient.http as httpclient

from kiln.examples import build_example_repository
from tests.conftest import KilnProcess


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KilnProcess]:
    repo = tmp_path_factory.mktemp("strict") / "models"
    build_example_repository(repo, ["simple"])
    shutil.copytree(repo / "simple", repo / "no_config")
    (repo / "no_config" / "config.pbtxt").unlink()
    process = KilnProcess(repo, ["--disable-auto-complete-config", "--no-strict-readiness"])
    yield process.start()
    process.stop()


def test_a_batching_model_keeps_its_config_as_written(server: KilnProcess) -> None:
    client = httpclient.InferenceServerClient(server.http_url)
    config = client.get_model_config("simple")
    assert config["max_batch_size"] == 8
    assert "dynamic_batching" not in config  # auto-complete would have added it
    a = np.arange(16, dtype=np.int32).reshape(1, 16)
    inputs = [httpclient.InferInput(n, [1, 16], "INT32") for n in ("INPUT0", "INPUT1")]
    for tensor in inputs:
        tensor.set_data_from_numpy(a)
    result = client.infer("simple", inputs)
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), a + a)


def test_a_model_without_config_file_is_unavailable_with_the_reason(server: KilnProcess) -> None:
    client = httpclient.InferenceServerClient(server.http_url)
    rows = {row["name"]: row for row in client.get_model_repository_index()}
    row = rows["no_config"]
    assert row["state"] == "UNAVAILABLE"
    assert "config.pbtxt" in row["reason"] and "--disable-auto-complete-config" in row["reason"]
    assert client.is_model_ready("simple") and not client.is_model_ready("no_config")
