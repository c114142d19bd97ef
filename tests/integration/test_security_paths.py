"""Loads cannot leave the model repository: traversal in names, absolute or ``..`` paths in
config overrides and ``file:`` parameters, and symlinks pointing outside are all refused
with a precise 400, and the server keeps serving."""

from __future__ import annotations

import base64
import json
import shutil
from collections.abc import Iterator

import pytest
import requests
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from kiln.examples import build_example_repository
from tests.conftest import KilnProcess


@pytest.fixture(scope="module")
def explicit(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KilnProcess]:
    root = tmp_path_factory.mktemp("paths")
    repo = root / "models"
    build_example_repository(repo, ["simple"])
    outside = root / "outside"
    build_example_repository(outside, ["simple"])
    # a model folder, a version folder and a model file that all point outside
    (repo / "linked_model").symlink_to(outside / "simple", target_is_directory=True)
    shutil.copytree(repo / "simple", repo / "linked_version", symlinks=True)
    shutil.rmtree(repo / "linked_version" / "1")
    (repo / "linked_version" / "1").symlink_to(outside / "simple" / "1")
    shutil.copytree(repo / "simple", repo / "linked_file", symlinks=True)
    (repo / "linked_file" / "1" / "model.onnx").unlink()
    (repo / "linked_file" / "1" / "model.onnx").symlink_to(outside / "simple" / "1" / "model.onnx")
    # a symlink that stays inside the repository is fine
    shutil.copytree(repo / "simple", repo / "alias", symlinks=True)
    shutil.rmtree(repo / "alias" / "1")
    (repo / "alias" / "1").symlink_to(repo / "simple" / "1")
    for name in ("linked_model", "linked_version", "linked_file", "alias"):
        config = repo / name / "config.pbtxt"
        text = config.read_text().replace('name: "simple"', f'name: "{name}"')
        config.unlink()
        config.write_text(text)
    server = KilnProcess(
        repo, ["--model-control-mode", "explicit", "--load-model", "simple", "--no-history"]
    ).start()
    yield server
    server.stop()


@pytest.mark.parametrize("name", ["linked_model", "linked_version", "linked_file"])
def test_symlinks_outside_the_repository_are_refused(explicit: KilnProcess, name: str) -> None:
    client = httpclient.InferenceServerClient(explicit.http_url)
    with pytest.raises(InferenceServerException) as info:
        client.load_model(name)
    assert info.value.status() == "400"
    assert "resolves outside the model repository" in info.value.message()
    assert name in info.value.message()
    assert client.is_model_ready("simple")


def test_symlink_inside_the_repository_loads(explicit: KilnProcess) -> None:
    client = httpclient.InferenceServerClient(explicit.http_url)
    client.load_model("alias")
    assert client.is_model_ready("alias")
    client.unload_model("alias")


@pytest.mark.parametrize("name", ["..", "../simple", "..%2F..%2Fetc", ".hidden", "a b"])
def test_traversal_in_model_names(explicit: KilnProcess, name: str) -> None:
    url = f"http://{explicit.http_url}/v2/repository/models/{name}/load"
    r = requests.post(url, json={}, timeout=10)
    assert r.status_code in (400, 404), r.text
    if r.status_code == 400:
        assert "invalid model name" in r.json()["error"]
    grpc = grpcclient.InferenceServerClient(explicit.grpc_url)
    with pytest.raises(InferenceServerException) as info:
        grpc.load_model(name.replace("%2F", "/"))
    assert info.value.status() == "StatusCode.INVALID_ARGUMENT"
    assert "invalid model name" in info.value.message()


@pytest.mark.parametrize(
    "field,value,named",
    [
        ("default_model_filename", "../../../../etc/passwd", "default_model_filename"),
        ("default_model_filename", "/etc/passwd", "default_model_filename"),
        ("cc_model_filenames", {"8.0": "../x.plan"}, "cc_model_filenames['8.0']"),
        ("output", [{"name": "OUTPUT0", "data_type": "TYPE_INT32", "dims": [16],
                     "label_filename": "../../labels.txt"}], "label_filename"),
    ],
)  # fmt: skip
def test_config_override_cannot_name_outside_files(
    explicit: KilnProcess, field: str, value: object, named: str
) -> None:
    client = httpclient.InferenceServerClient(explicit.http_url)
    config = json.dumps({"name": "simple", field: value})
    with pytest.raises(InferenceServerException) as info:
        client.load_model("simple", config=config)
    assert info.value.status() == "400"
    assert named in info.value.message() and "inside the model folder" in info.value.message()
    assert client.is_model_ready("simple")  # the failed reload keeps the old version serving


@pytest.mark.parametrize("rel", ["../evil.onnx", "/tmp/evil.onnx", "1/../../evil.onnx"])
def test_file_parameters_cannot_escape(explicit: KilnProcess, rel: str) -> None:
    body = {
        "parameters": {
            "config": json.dumps({"name": "filemodel", "backend": "onnxruntime"}),
            f"file:{rel}": base64.b64encode(b"not a model").decode(),
        }
    }
    url = f"http://{explicit.http_url}/v2/repository/models/filemodel/load"
    r = requests.post(url, json=body, timeout=10)
    assert r.status_code == 400
    assert "escapes the model folder" in r.json()["error"]
    assert httpclient.InferenceServerClient(explicit.http_url).is_model_ready("simple")
