"""A model's own Python environment: Triton's ``EXECUTION_ENV_PATH`` parameter.

```
parameters: { key: "EXECUTION_ENV_PATH"
              value: { string_value: "$$TRITON_MODEL_DIRECTORY/env.tar.gz" } }
```

The value is an environment folder (a conda or virtual environment, with ``bin/python``) or
a packed one (``.tar.gz`` / ``.tgz`` / ``.tar``, e.g. from ``conda-pack``). A packed one is
unpacked once into kiln's cache (``$XDG_CACHE_HOME/kiln/python-envs``, keyed by the file's
path, size and modification time), so later loads and worker restarts start at once.
``$$TRITON_MODEL_DIRECTORY`` stands for the model's folder, and a path written with it must
stay inside that folder. The model's worker then runs that environment's interpreter, with
its packages first, its ``bin`` on ``PATH`` and ``CONDA_PREFIX`` set, as an activation
script would; kiln's own worker code comes from the server's installation. As in Triton,
the environment's Python must be the server's version, and it must have numpy: both are
checked at load, and a load that fails says which.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from kiln.backends.base import parameter
from kiln.config.model_config_pb2 import ModelConfig
from kiln.core.errors import KilnError, Status

PARAMETER = "EXECUTION_ENV_PATH"
MODEL_DIR = "$$TRITON_MODEL_DIRECTORY"
_PACKED = (".tar.gz", ".tgz", ".tar")
_UNPACKED_MARK = ".kiln-unpacked"
_CHECK_TIMEOUT_S = 120.0
# Interpreters that passed the check, by path and modification time: a model's other
# instances, its worker restarts and later loads do not start one again to ask.
_CHECKED: set[tuple[str, int]] = set()


@dataclass(frozen=True, slots=True)
class ExecutionEnv:
    root: Path
    python: Path

    def environ(self, base: dict[str, str]) -> dict[str, str]:
        """The worker's environment variables: as an activation script leaves them."""
        env = dict(base)
        env["PATH"] = os.pathsep.join(p for p in (str(self.root / "bin"), env.get("PATH")) if p)
        env["CONDA_PREFIX"] = str(self.root)
        env.pop("PYTHONHOME", None)
        return env


def resolve(config: ModelConfig, model_dir: Path) -> ExecutionEnv | None:
    """The environment the model's config asks for, unpacked and checked; None if none."""
    raw = parameter(config, PARAMETER)
    if not raw:
        return None

    def fail(reason: str) -> KilnError:
        return KilnError(
            f"model '{config.name}': parameter {PARAMETER} '{raw}': {reason}", Status.INVALID_ARG
        )

    path = Path(raw.replace(MODEL_DIR, str(model_dir)))
    if MODEL_DIR in raw and not path.resolve().is_relative_to(model_dir.resolve()):
        raise fail(f"a path written with {MODEL_DIR} must stay inside the model's folder")
    if not path.exists():
        raise fail(f"{path} does not exist")
    if path.is_file():
        if not path.name.endswith(_PACKED):
            raise fail("a file must be a packed environment (.tar.gz, .tgz or .tar)")
        try:
            root = _unpack(path)
        except (OSError, tarfile.TarError) as exc:
            raise fail(f"cannot unpack {path.name}: {exc}") from None
    else:
        root = path
    python = _interpreter(root)
    if python is None:
        # a packed folder rather than its contents: the one folder inside it
        inner = [p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")]
        if len(inner) == 1 and (python := _interpreter(inner[0])) is not None:
            root = inner[0]
    if python is None:
        raise fail(f"no bin/python in the environment {root}")
    _check(python, fail)
    return ExecutionEnv(root, python)


def _interpreter(root: Path) -> Path | None:
    candidates = (root / "bin" / "python3", root / "bin" / "python")
    return next((p for p in candidates if p.exists()), None)


def _check(python: Path, fail: Callable[[str], KilnError]) -> None:
    """The interpreter runs, is the server's Python version and can import numpy (asked
    once per interpreter file)."""
    key = (str(python), python.stat().st_mtime_ns)
    if key in _CHECKED:
        return
    code = "import sys; print('%d.%d' % sys.version_info[:2]); import numpy"
    try:
        done = subprocess.run(
            [str(python), "-c", code], capture_output=True, text=True, timeout=_CHECK_TIMEOUT_S
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise fail(f"cannot run {python}: {exc}") from None
    version = done.stdout.strip().splitlines()[0] if done.stdout.strip() else "?"
    ours = f"{sys.version_info[0]}.{sys.version_info[1]}"
    if version != ours:
        raise fail(f"its Python is {version}, the server's is {ours}: they must be the same")
    if done.returncode != 0:
        lines = done.stderr.strip().splitlines()
        last = lines[-1] if lines else f"exit status {done.returncode}"
        raise fail(f"its Python cannot import numpy, which the worker needs ({last})")
    _CHECKED.add(key)


def _unpack(packed: Path) -> Path:
    """The folder ``packed`` unpacks to in kiln's cache, unpacking it the first time."""
    stat = packed.stat()
    key = hashlib.sha256(f"{packed.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode())
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kiln"
    target = cache / "python-envs" / key.hexdigest()[:20]
    if (target / _UNPACKED_MARK).exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".unpacking-", dir=target.parent))
    try:
        with tarfile.open(packed) as archive:
            # 'tar' keeps every file inside the folder and allows the absolute symlinks
            # environments hold (a virtual environment's bin/python).
            archive.extractall(staging, filter="tar")
        (staging / _UNPACKED_MARK).touch()
        if target.exists() and not (target / _UNPACKED_MARK).exists():
            shutil.rmtree(target)  # left half-unpacked by an earlier load
        try:
            staging.rename(target)
        except OSError:
            if not (target / _UNPACKED_MARK).exists():  # not another load's, finished
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target
