"""``kiln monitor agent`` as a real subprocess over a fake NVML (``KILN_FAKE_NVML``)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from tests.conftest import free_port
from tests.fake_nvml import FakeGpu, fake_gpu, write_spec

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class AgentProcess:
    workdir: Path
    gpus: list[FakeGpu]
    hostname: str = "node-a"
    port: int = 0
    proc: subprocess.Popen[bytes] | None = None

    @property
    def spec(self) -> Path:
        return self.workdir / f"nvml-{self.hostname}.json"

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def update(self, xids: tuple[tuple[str, int], ...] = ()) -> None:
        write_spec(self.spec, self.gpus, xids)

    def start(self) -> AgentProcess:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.update()
        self.port = self.port or free_port()
        env = dict(
            os.environ,
            KILN_FAKE_NVML="tests.fake_nvml:from_env",
            KILN_FAKE_NVML_SPEC=str(self.spec),
            NODE_NAME=self.hostname,  # the Hostname label, as in a DaemonSet pod
            PYTHONPATH=os.pathsep.join([str(ROOT / "src"), str(ROOT)]),
        )
        cmd = [sys.executable, "-m", "kiln", "monitor", "agent", "--host", "127.0.0.1",
               "--port", str(self.port), "--interval", "0.2"]  # fmt: skip
        log = open(self.workdir / f"agent-{self.hostname}.log", "wb")  # noqa: SIM115
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
        log.close()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"agent exited {self.proc.returncode}:\n{self.log()}")
            try:
                self.scrape()
                return self
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                time.sleep(0.1)
        raise TimeoutError(f"agent not serving after 30s:\n{self.log()}")

    def scrape(self) -> str:
        with urllib.request.urlopen(f"http://{self.address}/metrics", timeout=5) as resp:
            return str(resp.read().decode())

    def log(self) -> str:
        return (self.workdir / f"agent-{self.hostname}.log").read_text(errors="replace")

    def stop(self) -> int:
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return int(self.proc.returncode)


def two_agents(work: Path, node_b_temp: int) -> Iterator[list[AgentProcess]]:
    """Two running agents: node-a with two GPUs (50 and 55 °C), node-b with one at
    ``node_b_temp``; stopped when the generator closes (a pytest fixture's body)."""
    a = AgentProcess(work, [fake_gpu("GPU-a0", 0, temp=50), fake_gpu("GPU-a1", 1, temp=55)],
                     hostname="node-a")  # fmt: skip
    b = AgentProcess(work, [fake_gpu("GPU-b0", 0, temp=node_b_temp)], hostname="node-b")
    procs = [a.start(), b.start()]
    yield procs
    for p in procs:
        p.stop()
