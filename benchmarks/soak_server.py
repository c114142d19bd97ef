"""The soak's server side: ``kiln serve`` as a subprocess, its process tree, RSS, workers.

Memory is read from ``/proc`` (no psutil here): the RSS of the server and every descendant
(the Python-backend workers), summed, and the server's own RSS, since workers come and go
as they are killed and restarted.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

WORKER_MODULE = "kiln.backends.python.worker"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass(slots=True)
class SoakServer:
    repository: Path
    workdir: Path
    http_port: int = 0
    grpc_port: int = 0
    extra_args: tuple[str, ...] = ()  # more `kiln serve` flags (e.g. --no-history)
    proc: subprocess.Popen[bytes] | None = None

    @property
    def http_url(self) -> str:
        return f"127.0.0.1:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    @property
    def log_path(self) -> Path:
        return self.workdir / "kiln.log"

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def start(self, timeout: float = 120.0) -> None:
        self.http_port, self.grpc_port = free_port(), free_port()
        cmd = [
            sys.executable, "-m", "kiln", "serve",
            "--model-repository", str(self.repository),
            "--model-control-mode", "explicit", "--load-model", "*",
            "--http-port", str(self.http_port), "--grpc-port", str(self.grpc_port),
            "--metrics-port", str(free_port()),
            "--history-path", str(self.workdir / "history.db"),
            *self.extra_args,
        ]  # fmt: skip
        with open(self.log_path, "wb") as log:
            env = dict(os.environ, PYTHONUNBUFFERED="1")
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + timeout
        url = f"http://{self.http_url}/v2/health/ready"
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"kiln serve exited: {self.log_path.read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(url, timeout=1) as resp:
                    if resp.status == 200:
                        return
            except OSError:
                time.sleep(0.2)
        self.stop()
        raise TimeoutError(f"kiln serve not ready after {timeout:g}s; log in {self.log_path}")

    def stop(self, timeout: float = 60.0) -> int | None:
        """SIGTERM, then the exit status (None if it had to be killed)."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                return self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                return None
        return self.proc.returncode

    def descendants(self) -> list[int]:
        children: dict[int, list[int]] = {}
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue  # exited while we looked
            # The command name (field 2) may hold spaces: ppid is the 2nd field after ')'.
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            children.setdefault(ppid, []).append(int(entry))
        found: list[int] = []
        todo = [self.pid]
        while todo:
            pid = todo.pop()
            for child in children.get(pid, []):
                found.append(child)
                todo.append(child)
        return found

    def python_workers(self) -> dict[int, str]:
        """PID -> model name of each Python-backend worker of this server."""
        workers: dict[int, str] = {}
        for pid in self.descendants():
            try:
                argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            args = [a.decode(errors="replace") for a in argv]
            if WORKER_MODULE in args and "--model" in args:
                model_py = Path(args[args.index("--model") + 1])
                workers[pid] = model_py.parent.parent.name  # <repo>/<model>/<version>/model.py
        return workers

    def rss_mib(self) -> tuple[float, float]:
        """(server + descendants, server alone) resident memory in MiB."""
        own = _rss_kib(self.pid)
        tree = own + sum(_rss_kib(pid) for pid in self.descendants())
        return tree / 1024, own / 1024


def _rss_kib(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0
