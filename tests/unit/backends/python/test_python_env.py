"""Resolving ``EXECUTION_ENV_PATH`` (kiln/backends/python/env.py): folders, archives and
the unpack cache, and each refusal. The interpreters here are stand-ins (a shell script
that answers the load-time check); tests/integration/test_python_env.py serves a model
from a real virtual environment."""

from __future__ import annotations

import os
import sys
import tarfile
from pathlib import Path

import pytest
from google.protobuf import text_format

from kiln.backends.python.env import resolve
from kiln.config.model_config_pb2 import ModelConfig
from kiln.core.errors import KilnError

VERSION = f"{sys.version_info[0]}.{sys.version_info[1]}"


def fake_env(path: Path, version: str = VERSION, status: int = 0) -> Path:
    """A folder whose bin/python prints ``version`` and exits with ``status``."""
    (path / "bin").mkdir(parents=True)
    complaint = "echo 'ModuleNotFoundError: no numpy here' >&2"
    script = f"#!/bin/sh\necho {version}\n{complaint}\nexit {status}\n"
    (path / "bin" / "python").write_text(script)
    (path / "bin" / "python").chmod(0o755)
    return path


def config(value: str) -> ModelConfig:
    entry = f'key: "EXECUTION_ENV_PATH" value {{ string_value: "{value}" }}'
    text = f'name: "m" parameters {{ {entry} }}'
    return text_format.Parse(text, ModelConfig())


@pytest.fixture(autouse=True)
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return tmp_path / "cache" / "kiln" / "python-envs"


def test_no_parameter_means_the_server_s_environment(tmp_path: Path) -> None:
    assert resolve(text_format.Parse('name: "m"', ModelConfig()), tmp_path) is None


def test_a_folder_is_used_where_it_is(tmp_path: Path) -> None:
    env = fake_env(tmp_path / "env")
    found = resolve(config(str(env)), tmp_path)
    assert found is not None and found.root == env and found.python == env / "bin" / "python"
    variables = found.environ({"PATH": "/usr/bin", "PYTHONHOME": "/elsewhere"})
    assert variables["PATH"] == f"{env / 'bin'}{os.pathsep}/usr/bin"
    assert variables["CONDA_PREFIX"] == str(env) and "PYTHONHOME" not in variables


def test_an_archive_is_unpacked_once_and_again_when_replaced(tmp_path: Path, cache: Path) -> None:
    model = tmp_path / "model"
    model.mkdir()
    env = fake_env(tmp_path / "env")
    packed = model / "env.tar.gz"
    with tarfile.open(packed, "w:gz") as archive:
        for item in env.iterdir():  # the contents at the top, as conda-pack writes them
            archive.add(item, arcname=item.name)
    first = resolve(config("$$TRITON_MODEL_DIRECTORY/env.tar.gz"), model)
    assert first is not None and first.root.parent == cache
    (first.root / "bin" / "left-by-first").touch()
    again = resolve(config("$$TRITON_MODEL_DIRECTORY/env.tar.gz"), model)
    assert again is not None and (again.root / "bin" / "left-by-first").exists()  # reused
    os.utime(packed, ns=(1, 1))  # replaced: another modification time
    third = resolve(config("$$TRITON_MODEL_DIRECTORY/env.tar.gz"), model)
    assert third is not None and third.root != first.root
    assert not (third.root / "bin" / "left-by-first").exists()


@pytest.mark.parametrize(
    ("make", "value", "reason"),
    [
        (lambda root: None, "{root}/nowhere", "does not exist"),
        (lambda root: (root / "env.zip").write_bytes(b"PK"), "{root}/env.zip",
         "a file must be a packed environment (.tar.gz, .tgz or .tar)"),
        (lambda root: (root / "broken.tar.gz").write_bytes(b"not gzip"), "{root}/broken.tar.gz",
         "cannot unpack broken.tar.gz"),
        (lambda root: (root / "empty").mkdir(), "{root}/empty", "no bin/python in the environment"),
        (lambda root: fake_env(root / "old", version="3.9"), "{root}/old",
         f"its Python is 3.9, the server's is {VERSION}: they must be the same"),
        (lambda root: fake_env(root / "bare", status=1), "{root}/bare",
         "cannot import numpy, which the worker needs (ModuleNotFoundError: no numpy here)"),
        (lambda root: None, "$$TRITON_MODEL_DIRECTORY/../outside",
         "a path written with $$TRITON_MODEL_DIRECTORY must stay inside the model's folder"),
    ],
)  # fmt: skip
def test_an_unusable_environment_is_refused_with_the_reason(
    tmp_path: Path, make: object, value: str, reason: str
) -> None:
    assert callable(make)
    make(tmp_path)
    raw = value.format(root=tmp_path)
    with pytest.raises(KilnError) as info:
        resolve(config(raw), tmp_path / "model")
    assert info.value.message.startswith(f"model 'm': parameter EXECUTION_ENV_PATH '{raw}': ")
    assert reason in info.value.message


def test_an_interpreter_is_checked_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A model's other instances and later loads do not start the interpreter again; a
    changed interpreter file is checked again."""
    import subprocess

    from kiln.backends.python import env as env_module

    runs: list[list[str]] = []
    real_run = subprocess.run

    def counting_run(cmd: list[str], **kw: object) -> object:
        runs.append(cmd)
        return real_run(cmd, **kw)  # type: ignore[call-overload]

    monkeypatch.setattr(env_module.subprocess, "run", counting_run)
    folder = fake_env(tmp_path / "once")
    for _ in range(3):
        assert resolve(config(str(folder)), tmp_path) is not None
    assert len(runs) == 1
    os.utime(folder / "bin" / "python", ns=(1, 1))  # replaced
    assert resolve(config(str(folder)), tmp_path) is not None
    assert len(runs) == 2
