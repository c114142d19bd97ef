"""Shared fixtures: the example repository and real ``kiln serve`` processes on free ports."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from kiln.examples import build_example_repository

# kiln's Triton kernels run under Triton's CPU interpreter where there is no NVIDIA GPU. Set
# before any test module imports a kernel: @triton.jit picks interpreter or compiler when the
# kernel is defined, and tests/gpu (collected first) imports them at collection.
if not Path("/dev/nvidiactl").exists():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class KilnProcess:
    """``python -m kiln serve`` in a subprocess, on free loopback ports."""

    repository: Path
    args: list[str] = field(default_factory=list)
    # 0: a free port, picked again if another process takes it before kiln binds it
    http_port: int = 0
    grpc_port: int = 0
    metrics_port: int = 0
    log_path: Path | None = None
    proc: subprocess.Popen[bytes] | None = None
    #: False: no --model-repository (``kiln serve --model``); ``repository`` still holds
    #: the log and the state folder
    with_repository: bool = True
    # --model-repository's value when it is not ``repository`` (a bucket: s3://...);
    # logs and state still go beside ``repository``
    repository_url: str = ""
    #: extra environment variables of the server process
    env: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._free_ports = not (self.http_port or self.grpc_port or self.metrics_port)
        self.http_port = self.http_port or free_port()
        self.grpc_port = self.grpc_port or free_port()
        self.metrics_port = self.metrics_port or free_port()

    @property
    def http_url(self) -> str:
        return f"127.0.0.1:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.metrics_port}/metrics"

    def start(self, wait_ready: bool = True, timeout: float = 60.0) -> KilnProcess:
        """Launch and (``wait_ready``) wait until ready. ``free_port`` only finds a port
        that was free a moment ago: when another process took one of ours first, kiln
        exits saying so, and it starts again on new ports (a test's own ports are kept)."""
        for attempt in range(3):
            self._launch()
            if not wait_ready:
                return self
            try:
                self.wait_ready(timeout)
                return self
            except RuntimeError:
                if attempt == 2 or not self._free_ports or not _lost_a_port(self.log()):
                    raise
            self.http_port, self.grpc_port = free_port(), free_port()
            self.metrics_port, self.log_path = free_port(), None
        raise AssertionError("unreachable")

    def _launch(self) -> None:
        cmd = [
            sys.executable, "-m", "kiln", "serve",
            *(
                ["--model-repository", self.repository_url or str(self.repository)]
                if self.with_repository
                else []
            ),
            "--http-port", str(self.http_port),
            "--grpc-port", str(self.grpc_port),
            "--metrics-port", str(self.metrics_port),
            *self.args,
        ]  # fmt: skip
        self.log_path = self.log_path or self.repository.parent / f"kiln-{self.http_port}.log"
        log = open(self.log_path, "wb")  # noqa: SIM115 - closed with the process
        # History's default database lives under the XDG state dir: keep it in tmp.
        state = self.repository.parent / "state"
        env = dict(os.environ, PYTHONUNBUFFERED="1", XDG_STATE_HOME=str(state), **self.env)
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        log.close()

    def wait_ready(self, timeout: float = 60.0, path: str = "/v2/health/ready") -> None:
        """Poll ``path`` until it answers 200 (fail early if the process exits)."""
        deadline = time.monotonic() + timeout
        url = f"http://{self.http_url}{path}"
        while time.monotonic() < deadline:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise RuntimeError(f"kiln serve exited with {self.proc.returncode}:\n{self.log()}")
            try:
                with urllib.request.urlopen(url, timeout=1) as resp:
                    if resp.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.1)
        raise TimeoutError(f"kiln serve not ready after {timeout}s:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path else ""

    def metric(self, name: str, model: str, label: str = "") -> float:
        """The sum of metric ``name``'s samples for ``model`` whose labels hold ``label``
        (e.g. ``'finished_reason="abort"'``); a metric the model does not expose fails."""
        text = urllib.request.urlopen(self.metrics_url).read().decode()
        lines = [
            line
            for line in text.splitlines()
            if line.startswith(name + "{") and f'model_name="{model}"' in line
        ]
        assert lines, f"{name} not exposed for {model}"
        return sum(float(line.rsplit(" ", 1)[1]) for line in lines if label in line)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int:
        if self.proc is None:
            return 0
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def _lost_a_port(log: str) -> bool:
    """Whether kiln exited because one of its ports was taken (launch.py's messages)."""
    return (
        "a listener failed to start" in log
        or "cannot listen on" in log
        or "address already in use" in log.lower()
    )


@pytest.fixture(scope="session")
def example_repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The example repository, built once. Tests must not modify it (copy it instead)."""
    root = tmp_path_factory.mktemp("example") / "model_repository"
    build_example_repository(root)
    return root


@pytest.fixture(scope="session")
def kiln_server(example_repo: Path) -> Iterator[KilnProcess]:
    """One shared server over the example repository (model control mode none)."""
    server = KilnProcess(example_repo).start()
    yield server
    server.stop()


@pytest.fixture
def make_server(tmp_path: Path) -> Iterator[type[KilnProcess]]:
    """Start private servers (``make_server(repo, args=[...]).start()``); all stopped after."""
    started: list[KilnProcess] = []

    class _Tracked(KilnProcess):
        def start(self, wait_ready: bool = True, timeout: float = 60.0) -> KilnProcess:
            started.append(self)
            return super().start(wait_ready, timeout)

    yield _Tracked
    for server in started:
        server.stop(timeout=10)


@dataclass
class DigitsFiles:
    """Trained digits models (ONNX, TorchScript, weights) and their data files, built once."""

    root: Path
    mlp_onnx: Path
    mlp_torchscript: Path
    mlp_weights: Path
    cnn_onnx: Path
    calibration: Path
    validation: Path
    labels: Path
    image_calibration: Path
    image_validation: Path
    reference_accuracy: float


@pytest.fixture(scope="session")
def digits_files(tmp_path_factory: pytest.TempPathFactory) -> DigitsFiles:
    """A real MLP and CNN trained on scikit-learn's digits at test time, exported to ONNX."""
    import numpy as np
    import torch

    from kiln.optimize.export import export
    from tests import digits

    root = tmp_path_factory.mktemp("digits")
    data = digits.load_digits()
    mlp = digits.train(digits.DigitsMLP(), data.train_x, data.train_y)
    cnn = digits.train(digits.DigitsCNN(), digits.images(data.train_x), data.train_y, steps=60)
    files = DigitsFiles(
        root=root,
        mlp_onnx=root / "mlp.onnx",
        mlp_torchscript=root / "mlp.pt",
        mlp_weights=root / "mlp_weights.pth",
        cnn_onnx=root / "cnn.onnx",
        calibration=root / "calibration.npy",
        validation=root / "validation.npy",
        labels=root / "labels.npy",
        image_calibration=root / "image_calibration.npy",
        image_validation=root / "image_validation.npy",
        reference_accuracy=digits.accuracy(mlp, data.test_x, data.test_y),
    )
    # The TorchScript exporter is several times faster than dynamo; dynamo has its own test.
    export(mlp, {"INPUT": (1, 64)}, files.mlp_onnx, dynamo=False)
    export(cnn, {"IMAGE": (1, 1, 8, 8)}, files.cnn_onnx, dynamo=False)
    torch.jit.trace(mlp, torch.zeros(1, 64)).save(str(files.mlp_torchscript))
    torch.save(mlp.state_dict(), files.mlp_weights)
    np.save(files.calibration, data.train_x[:256])
    np.save(files.validation, data.test_x)
    np.save(files.labels, data.test_y)
    np.save(files.image_calibration, digits.images(data.train_x[:256]))
    np.save(files.image_validation, digits.images(data.test_x))
    return files
