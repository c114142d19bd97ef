"""Model loads with ``file:`` parameters (issue #25, item 4): a failed load leaves nothing
behind in the temp folder and names no private path, and bad parameters (base64, NUL,
empty or overlong file names) are a 400 with a precise message before anything is written.
"""

from __future__ import annotations

import base64
import json
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from kiln.examples.models import build_simple
from kiln.repository import load_files
from kiln.server.server import ControlMode, Server, ServerOptions
from tests.conftest import KilnProcess

MODEL = "filemodel"
ONNX_CONFIG = json.dumps({"name": MODEL, "backend": "onnxruntime"})
BIG = b"\x08\x07" * (2 << 20)  # 4 MiB that is no ONNX model


@pytest.fixture(scope="module")
def temp_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The server's TMPDIR: where a load's private folder is made."""
    return tmp_path_factory.mktemp("server-tmp")


@pytest.fixture(scope="module")
def explicit(example_repo: Path, temp_root: Path) -> Iterator[KilnProcess]:
    with pytest.MonkeyPatch.context() as env:
        env.setenv("TMPDIR", str(temp_root))
        server = KilnProcess(
            example_repo, args=["--model-control-mode=explicit", "--load-model=simple"]
        ).start()
    yield server
    server.stop()


def _load(server: KilnProcess, parameters: dict[str, str]) -> requests.Response:
    url = f"http://{server.http_url}/v2/repository/models/{MODEL}/load"
    return requests.post(url, json={"parameters": parameters}, timeout=60)


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _assert_private_path_hidden(text: str, temp_root: Path) -> None:
    assert str(temp_root) not in text
    assert f"kiln-{MODEL}-" not in text


def _index_reason(server: KilnProcess) -> str:
    index = httpclient.InferenceServerClient(server.http_url).get_model_repository_index()
    return " ".join(str(m.get("reason", "")) for m in index if m["name"] == MODEL)


FAILING_LOADS = {
    "not-onnx": {"config": ONNX_CONFIG, "file:1/model.onnx": _b64(BIG)},
    "no-version-folder": {"config": ONNX_CONFIG, "file:model.onnx": _b64(BIG)},
    "bad-config": {
        "config": json.dumps({"name": MODEL, "backend": "onnxruntime", "max_batch_size": -3}),
        "file:1/model.onnx": _b64(BIG),
    },
    "config-not-json": {"config": "{", "file:1/model.onnx": _b64(BIG)},
}


@pytest.mark.parametrize("case", list(FAILING_LOADS))
def test_failed_file_loads_leave_no_folder_and_name_no_private_path(
    explicit: KilnProcess, temp_root: Path, case: str
) -> None:
    before = sorted(p.name for p in temp_root.iterdir())
    for _ in range(3):
        r = _load(explicit, FAILING_LOADS[case])
        assert r.status_code == 400, r.text
        _assert_private_path_hidden(r.text, temp_root)
    assert sorted(p.name for p in temp_root.iterdir()) == before
    _assert_private_path_hidden(_index_reason(explicit), temp_root)
    assert httpclient.InferenceServerClient(explicit.http_url).is_model_ready("simple")


def test_failed_grpc_file_load_leaves_no_folder(explicit: KilnProcess, temp_root: Path) -> None:
    before = sorted(p.name for p in temp_root.iterdir())
    client = grpcclient.InferenceServerClient(explicit.grpc_url)
    with pytest.raises(InferenceServerException) as err:
        client.load_model(MODEL, config=ONNX_CONFIG, files={"file:1/model.onnx": BIG})
    _assert_private_path_hidden(str(err.value.message()), temp_root)
    assert sorted(p.name for p in temp_root.iterdir()) == before


def test_bad_base64_is_a_400_naming_the_parameter(explicit: KilnProcess, temp_root: Path) -> None:
    before = sorted(p.name for p in temp_root.iterdir())
    for value in ("not base64!", "QUJDRA", "QU\nJD"):  # junk, no padding, a newline
        r = _load(explicit, {"config": ONNX_CONFIG, "file:1/model.onnx": value})
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert "'file:1/model.onnx'" in error and "base64" in error, error
    assert sorted(p.name for p in temp_root.iterdir()) == before


@pytest.mark.parametrize(
    ("key", "text"),
    [
        ("file:1/mod\x00el.onnx", "NUL"),
        ("file:", "names no file"),
        ("file:1/", "names no file"),
        ("file:1/" + "m" * 300 + ".onnx", "failed to poll from model repository"),
        ("file:" + "/".join(["d" * 200] * 30) + "/model.onnx", "failed to poll from model"),
        ("file:1//model.onnx", "has an empty or '.' path component"),
        ("file:1/./model.onnx", "has an empty or '.' path component"),
        ("file:1/" + "d/" * 40 + "model.onnx", "42 folders deep, more than the limit of 32"),
        ("file:1/good.txt/model.onnx", "names a file that other 'file:' parameters use as a"),
    ],
    ids=["nul", "empty", "folder-only", "long-name", "long-path", "empty-part", "dot-part",
         "too-deep", "file-as-folder"],
)  # fmt: skip
def test_bad_file_names_are_a_400_before_anything_is_written(
    explicit: KilnProcess, temp_root: Path, key: str, text: str
) -> None:
    before = sorted(p.name for p in temp_root.iterdir())
    r = _load(explicit, {"config": ONNX_CONFIG, "file:1/good.txt": _b64(b"x"), key: _b64(b"x")})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert text in error and MODEL in error, error
    assert "OSError" not in error and "Errno" not in error
    _assert_private_path_hidden(error, temp_root)
    assert sorted(p.name for p in temp_root.iterdir()) == before


def test_more_than_1024_files_are_a_400_before_anything_is_written(
    explicit: KilnProcess, temp_root: Path
) -> None:
    """Each ``file:`` parameter is a file written to disk: a 64 MiB body held a million
    empty ones, written one by one on the event loop."""
    before = sorted(p.name for p in temp_root.iterdir())
    files = {f"file:1/f{i}": "" for i in range(1025)}
    r = _load(explicit, {"config": ONNX_CONFIG, **files})
    assert r.status_code == 400, r.text
    assert r.json()["error"] == (
        f"failed to load '{MODEL}': 1025 'file:' parameters, more than the limit of 1024"
    )
    assert sorted(p.name for p in temp_root.iterdir()) == before


def test_overlong_file_name_over_grpc_is_invalid_argument(explicit: KilnProcess) -> None:
    client = grpcclient.InferenceServerClient(explicit.grpc_url)
    with pytest.raises(InferenceServerException) as err:
        client.load_model(MODEL, config=ONNX_CONFIG, files={"file:1/" + "m" * 300 + ".onnx": b"x"})
    assert err.value.status() == "StatusCode.INVALID_ARGUMENT"
    assert f"failed to load '{MODEL}', failed to poll from model repository" in str(
        err.value.message()
    )


@pytest.mark.parametrize("opener", ["[", '{"input":'])
def test_a_deeply_nested_config_override_is_a_400(explicit: KilnProcess, opener: str) -> None:
    """Python's JSON parser gives up on deep nesting with RecursionError: that was a 500."""
    closer = "]" if opener == "[" else "}"
    config = opener * 100_000 + "1" + closer * 100_000
    url = f"http://{explicit.http_url}/v2/repository/models/mlp/load"
    response = requests.post(url, json={"parameters": {"config": config}}, timeout=60)
    assert response.status_code == 400, response.text
    assert response.json()["error"] == (
        "failed to load 'mlp': <config override>: invalid JSON: nested too deeply"
    )


def test_a_bad_config_override_is_named_as_such(explicit: KilnProcess, example_repo: Path) -> None:
    """The override is what is wrong, not the repository's config.pbtxt (whose server
    path the message used to tell)."""
    url = f"http://{explicit.http_url}/v2/repository/models/mlp/load"
    config = json.dumps({"max_batch_size": -5})
    response = requests.post(url, json={"parameters": {"config": config}}, timeout=60)
    assert response.status_code == 400, response.text
    message = response.json()["error"]
    assert message == "failed to load 'mlp': <config override>: max_batch_size must be >= 0, got -5"
    assert str(example_repo) not in message


async def test_file_contents_are_decoded_and_written_off_the_event_loop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A 64 MiB load body is ~48 MiB of files: its base64 took 0.4 s and its writes more,
    all on the event loop. Both run on a worker thread now (the names were checked on the
    loop before, in microseconds). Which thread did the work is checked, not how long."""
    threads: list[int] = []
    real = load_files._decode_and_write

    def recording(name: str, files: dict[str, str | bytes]) -> Path:
        threads.append(threading.get_ident())
        return real(name, files)

    monkeypatch.setattr(load_files, "_decode_and_write", recording)
    server = Server(ServerOptions([tmp_path], ControlMode.EXPLICIT))
    await server.start()
    try:
        onnx_model = build_simple().SerializeToString()
        config = json.dumps({"name": MODEL, "backend": "onnxruntime"})
        await server.load_model(MODEL, {"config": config, "file:1/model.onnx": _b64(onnx_model)})
        assert server.model_ready(MODEL, "")
    finally:
        await server.stop()
    assert len(threads) == 1 and threads[0] != threading.get_ident()
