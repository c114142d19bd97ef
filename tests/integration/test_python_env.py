"""A Python model in its own environment (Triton's ``EXECUTION_ENV_PATH``), behind a real
``kiln serve``: a virtual environment holding a module the server's environment lacks,
given as a folder and as a packed ``.tar.gz`` under ``$$TRITON_MODEL_DIRECTORY``; and each
way such an environment can be unusable, refused at load with the reason."""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
import textwrap
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from tests.conftest import KilnProcess

MODEL = """
import sys
import numpy as np
import env_marker  # only the model's own environment has it
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        where = np.array([f"{env_marker.WHERE}|{sys.prefix}".encode()], dtype=object)
        return [pb_utils.InferenceResponse([pb_utils.Tensor("WHERE", where)]) for _ in requests]
"""

AUTO_COMPLETE = """
    @staticmethod
    def auto_complete_config(config):
        config.set_max_batch_size(0)
        config.add_input({"name": "X", "data_type": "TYPE_FP32", "dims": [1]})
        config.add_output({"name": "WHERE", "data_type": "TYPE_STRING", "dims": [1]})
        return config
"""

CONFIG = """
backend: "python"
max_batch_size: 0
input [ { name: "X" data_type: TYPE_FP32 dims: [ 1 ] } ]
output [ { name: "WHERE" data_type: TYPE_STRING dims: [ 1 ] } ]
"""


def make_env(path: Path, numpy_too: bool = True) -> Path:
    """A virtual environment with ``env_marker`` and, linked from the server's, numpy and
    nothing else: the worker must start with no more than that."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(path)], check=True)
    (site,) = path.glob("lib/python3*/site-packages")
    (site / "env_marker.py").write_text('WHERE = "the model\'s own environment"\n')
    if numpy_too:
        server_site = Path(np.__file__).parents[1]
        for name in ("numpy", "numpy.libs"):
            if (server_site / name).exists():
                (site / name).symlink_to(server_site / name)
    return path


def add_model(repo: Path, name: str, env_path: str | None) -> Path:
    (repo / name / "1").mkdir(parents=True)
    (repo / name / "1" / "model.py").write_text(textwrap.dedent(MODEL))
    config = f'name: "{name}"\n' + CONFIG
    if env_path is not None:
        config += (
            f'parameters: {{ key: "EXECUTION_ENV_PATH" value: {{ string_value: "{env_path}" }} }}\n'
        )
    (repo / name / "config.pbtxt").write_text(config)
    return repo / name


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KilnProcess]:
    root = tmp_path_factory.mktemp("pyenv")
    repo = root / "models"
    env = make_env(root / "env")
    add_model(repo, "in_folder", str(env))
    packed = add_model(repo, "in_tarball", "$$TRITON_MODEL_DIRECTORY/env.tar.gz")
    with tarfile.open(packed / "env.tar.gz", "w:gz") as archive:
        archive.add(env, arcname="env")  # a folder inside: kiln finds bin/python in it
    add_model(repo, "no_env", None)
    # no inputs or outputs written: its auto_complete_config, in the environment, says them
    completed = add_model(repo, "auto_completed", str(env))
    (completed / "1" / "model.py").write_text(textwrap.dedent(MODEL) + AUTO_COMPLETE)
    (completed / "config.pbtxt").write_text(
        'name: "auto_completed"\nbackend: "python"\n'
        f'parameters: {{ key: "EXECUTION_ENV_PATH" value: {{ string_value: "{env}" }} }}\n'
    )
    add_model(repo, "missing", str(root / "nowhere"))
    add_model(repo, "escapes", "$$TRITON_MODEL_DIRECTORY/../../env")
    add_model(repo, "no_numpy", str(make_env(root / "bare", numpy_too=False)))
    old = root / "old"
    (old / "bin").mkdir(parents=True)
    (old / "bin" / "python").write_text("#!/bin/sh\necho 3.9\n")  # a stand-in for 3.9
    (old / "bin" / "python").chmod(0o755)
    add_model(repo, "old_python", str(old))
    saved = os.environ.get("XDG_CACHE_HOME")
    os.environ["XDG_CACHE_HOME"] = str(root / "cache")  # the server unpacks here
    try:
        proc = KilnProcess(repo, ["--model-control-mode", "explicit"]).start()
    finally:
        if saved is None:
            del os.environ["XDG_CACHE_HOME"]
        else:
            os.environ["XDG_CACHE_HOME"] = saved
    yield proc
    proc.stop()


def _where(client: httpclient.InferenceServerClient, model: str) -> str:
    x = httpclient.InferInput("X", [1], "FP32")
    x.set_data_from_numpy(np.zeros(1, np.float32))
    return client.infer(model, [x]).as_numpy("WHERE")[0].decode()


@pytest.mark.parametrize("model", ["in_folder", "in_tarball"])
def test_the_model_runs_in_its_own_environment(server: KilnProcess, model: str) -> None:
    client = httpclient.InferenceServerClient(server.http_url)
    client.load_model(model)
    marker, prefix = _where(client, model).split("|")
    assert marker == "the model's own environment"
    assert prefix != sys.prefix  # not the server's interpreter environment
    if model == "in_tarball":
        assert Path(prefix).is_relative_to(server.repository.parent / "cache" / "kiln")


def test_without_the_parameter_the_server_s_environment_lacks_the_module(
    server: KilnProcess,
) -> None:
    client = httpclient.InferenceServerClient(server.http_url)
    with pytest.raises(InferenceServerException, match="No module named 'env_marker'"):
        client.load_model("no_env")


@pytest.mark.parametrize(
    ("model", "reason"),
    [
        ("missing", "nowhere does not exist"),
        ("escapes", "a path written with $$TRITON_MODEL_DIRECTORY must stay inside the model"),
        ("no_numpy", "its Python cannot import numpy, which the worker needs"),
        ("old_python", "its Python is 3.9, the server's is"),
    ],
)
def test_an_unusable_environment_fails_the_load_with_the_reason(
    server: KilnProcess, model: str, reason: str
) -> None:
    client = httpclient.InferenceServerClient(server.http_url)
    with pytest.raises(InferenceServerException) as info:
        client.load_model(model)
    message = info.value.message()
    assert f"model '{model}': parameter EXECUTION_ENV_PATH" in message
    assert reason in message
    assert client.is_server_live()


def test_auto_complete_config_runs_in_the_model_s_environment(server: KilnProcess) -> None:
    client = httpclient.InferenceServerClient(server.http_url)
    client.load_model("auto_completed")  # model.py imports env_marker at the top
    config = client.get_model_config("auto_completed")
    assert [i["name"] for i in config["input"]] == ["X"]
    assert _where(client, "auto_completed").startswith("the model's own environment|")
