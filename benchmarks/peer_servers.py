"""Start kiln, Triton and MLServer on the same example models, each as one process tree.

- **kiln**: ``python -m kiln serve`` on the example repository (this venv).
- **Triton**: the ``tritonserver`` binary shipped in the nvidia-pytriton wheel, run directly
  on a generated repository of Python-backend models (``peers/triton_model.py`` running
  onnxruntime on the same ``model.onnx``; same ``config.pbtxt`` with ``backend: "python"``,
  so no dynamic batching: Triton adds none to a python-backend model).
- **MLServer**: ``mlserver start`` on generated ``model-settings.json`` files pointing at the
  custom runtime ``peers/mlserver_runtime.py``; ``parallel_workers=0`` keeps inference in the
  server process, ``debug=false`` turns the access log off.

Peers live in their own venvs under ``.bench/`` (``benchmarks/setup_peers.sh``); a missing
venv is reported by :func:`missing_reason` instead of failing the run.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from serving_baseline import free_port

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / ".bench"
PEERS = Path(__file__).resolve().parent / "peers"


@dataclass(slots=True)
class ServerProcess:
    name: str
    proc: subprocess.Popen[bytes]
    http_port: int
    grpc_port: int
    log: Path
    protocols: tuple[str, ...] = ("HTTP/JSON", "HTTP/binary", "gRPC")
    notes: list[str] = field(default_factory=list)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def wait_ready(self, models: tuple[str, ...], timeout: float = 60) -> None:
        urls = [f"http://127.0.0.1:{self.http_port}/v2/models/{m}/ready" for m in models]
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited ({self.proc.returncode}): {self.tail()}")
            try:
                if all(_ok(url) for url in urls):
                    return
            except OSError:
                pass
            time.sleep(0.2)
        self.close()
        raise RuntimeError(f"{self.name} not ready after {timeout:.0f}s: {self.tail()}")

    def tail(self, chars: int = 1500) -> str:
        return self.log.read_text(errors="replace")[-chars:] if self.log.exists() else ""

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)  # the clean shutdown path of all three
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


def _ok(url: str) -> bool:
    with urllib.request.urlopen(url, timeout=1) as resp:
        return bool(resp.status == 200)


def _spawn(cmd: list[str], log: Path, env: dict[str, str] | None = None, cwd: Path | None = None):
    with log.open("wb") as out:
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=cwd)


def missing_reason(peer: str) -> str | None:
    venv = BENCH / peer
    if not (venv / "bin" / "python").exists():
        return f"{venv} missing: run `bash benchmarks/setup_peers.sh {peer}`"
    return None


def start_kiln(
    repo: Path, work: Path, named_threads: bool = False, args: tuple[str, ...] = ()
) -> ServerProcess:
    """``named_threads``: run through ``named_threads.py`` so /proc shows thread names;
    ``args``: more ``kiln serve`` flags."""
    http, grpc_port = free_port(), free_port()
    launcher = [str(Path(__file__).with_name("named_threads.py"))] if named_threads else ["-m"]
    cmd = [
        sys.executable, *launcher, "kiln", "serve", "--model-repository", str(repo),
        "--http-port", str(http), "--grpc-port", str(grpc_port),
        "--metrics-port", str(free_port()), "--log-level", "warning", *args,
    ]  # fmt: skip
    log = work / "kiln.log"
    return ServerProcess("kiln", _spawn(cmd, log), http, grpc_port, log)


def _venv_paths(venv: Path) -> tuple[str, str]:
    """(site-packages, libpython directory) of a venv's interpreter."""
    code = (
        "import sysconfig as s; print(s.get_paths()['purelib']); print(s.get_config_var('LIBDIR'))"
    )
    out = subprocess.run(
        [str(venv / "bin" / "python"), "-c", code], check=True, capture_output=True, text=True
    ).stdout.split()
    return out[0], out[1]


def start_triton(
    repo: Path,
    models: tuple[str, ...],
    work: Path,
    model_file: str = "triton_model.py",
    edit_config: Callable[[str], str] = lambda text: text,
    model_files: dict[str, str] | None = None,
) -> ServerProcess:
    """``model_file`` (under ``peers/``) becomes each ``model.py``, but for the models
    ``model_files`` names another for; ``edit_config`` may add e.g. ``dynamic_batching`` to
    the generated ``config.pbtxt``."""
    venv = BENCH / "pytriton"
    site, libdir = _venv_paths(venv)
    shipped = Path(site) / "pytriton" / "tritonserver"
    # Triton repository: kiln's config with the python backend instead of onnxruntime.
    triton_repo = work / "triton_models"
    for model in models:
        shutil.copytree(repo / model, triton_repo / model)
        config = triton_repo / model / "config.pbtxt"
        text = config.read_text().replace('platform: "onnxruntime_onnx"', 'backend: "python"')
        config.write_text(edit_config(text))
        source = (model_files or {}).get(model, model_file)
        shutil.copy(PEERS / source, triton_repo / model / "1" / "model.py")
    # The wheel keeps one python-backend stub per Python version; Triton looks for the stub
    # next to libtriton_python.so, so assemble a backend directory with the matching one.
    backends = work / "triton_backends" / "python"
    shutil.copytree(shipped / "backends" / "python", backends)
    stub = shipped / "python_backend_stubs" / f"{sys.version_info.major}.{sys.version_info.minor}"
    # A link, not a copy: the stub finds its bundled libs (libcudart...) relative to itself.
    (backends / "triton_python_backend_stub").symlink_to(stub / "triton_python_backend_stub")
    env = dict(os.environ)
    # The stub links the system libpython. It finds its sys.prefix by looking up `python` on
    # PATH: the venv's bin first gives it the venv's numpy<2 and onnxruntime (PYTHONPATH is
    # not enough: the base interpreter's numpy 2 would be imported first and outputs come
    # back empty).
    libs = [libdir, str(Path(site) / "nvidia_pytriton.libs"), env.get("LD_LIBRARY_PATH")]
    env["LD_LIBRARY_PATH"] = os.pathsep.join(filter(None, libs))
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env['PATH']}"
    http, grpc_port = free_port(), free_port()
    cmd = [
        str(shipped / "bin" / "tritonserver"), "--model-repository", str(triton_repo),
        "--backend-directory", str(backends.parent), "--http-port", str(http),
        "--grpc-port", str(grpc_port), "--allow-metrics", "false", "--log-info", "false",
    ]  # fmt: skip
    log = work / "triton.log"
    return ServerProcess("Triton", _spawn(cmd, log, env), http, grpc_port, log)


def start_mlserver(
    repo: Path, models: tuple[str, ...], work: Path, extra: dict[str, object] | None = None
) -> ServerProcess:
    """``extra``: more model-settings fields, e.g. adaptive batching's ``max_batch_size``."""
    root = work / "mlserver_models"
    root.mkdir()
    shutil.copy(PEERS / "mlserver_runtime.py", root)
    http, grpc_port = free_port(), free_port()
    settings = {
        "host": "127.0.0.1", "http_port": http, "grpc_port": grpc_port,
        "metrics_port": free_port(), "parallel_workers": 0, "debug": False,
    }  # fmt: skip
    (root / "settings.json").write_text(json.dumps(settings))
    extra = dict(extra or {})
    more_parameters: dict[str, object] = dict(extra.pop("parameters", {}))  # type: ignore[call-overload]
    for model in models:
        (root / model).mkdir()
        parameters: dict[str, object] = {"uri": str(repo / model / "1" / "model.onnx")}
        parameters.update(more_parameters)
        model_settings = {
            "name": model,
            "implementation": "mlserver_runtime.OnnxRuntime",
            "parameters": parameters,
            **extra,
        }
        (root / model / "model-settings.json").write_text(json.dumps(model_settings))
    env = dict(os.environ, PYTHONPATH=str(root))
    cmd = [str(BENCH / "mlserver" / "bin" / "mlserver"), "start", str(root)]
    log = work / "mlserver.log"
    proc = _spawn(cmd, log, env, cwd=root)
    # MLServer does not implement Triton's binary tensor extension.
    return ServerProcess("MLServer", proc, http, grpc_port, log, ("HTTP/JSON", "gRPC"))
