"""Serving baseline: raw onnxruntime in-process vs kiln over HTTP/JSON, in one run.

For each model (``simple``, ``mlp``) and each concurrency (1, 16):

- **raw ORT**: ``InferenceSession.run`` on batch-1 inputs from C threads in this process —
  the physical limit of a server that does not batch;
- **kiln HTTP/JSON**: a ``kiln serve`` subprocess on the example repository, driven by a
  lean asyncio load generator (aiohttp keep-alive per worker, body serialised once,
  response bytes read but not parsed in the timed path).

Reports throughput, p50/p99 latency, the ratio to raw ORT, and the CPU seconds spent by
the server and by the load generator. Usage::

    .venv/bin/python benchmarks/serving_baseline.py [--duration 5] [--json out.json]

``--device cuda`` (a GPU machine with onnxruntime-gpu) puts both on the GPU: the raw
session on the CUDA execution provider, kiln's models on ``KIND_GPU`` instances.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import resource
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import aiohttp
import numpy as np
import onnxruntime as ort
from rich.console import Console
from rich.table import Table

from kiln.examples import build_example_repository

MODELS = ("simple", "mlp")
CONCURRENCY = (1, 16)


@dataclass(slots=True)
class Result:
    model: str
    target: str
    concurrency: int
    requests: int
    seconds: float
    p50_ms: float
    p99_ms: float
    server_cpu_s: float = 0.0
    client_cpu_s: float = 0.0

    @property
    def throughput(self) -> float:
        return self.requests / self.seconds


def batch1_inputs(model: str) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    if model == "simple":
        return {
            "INPUT0": rng.integers(0, 100, (1, 16), dtype=np.int32),
            "INPUT1": rng.integers(0, 100, (1, 16), dtype=np.int32),
        }
    if model == "mlp":
        return {"INPUT": rng.standard_normal((1, 64), dtype=np.float32)}
    raise ValueError(model)


def json_body(inputs: dict[str, np.ndarray]) -> bytes:
    return json.dumps(
        {
            "inputs": [
                {
                    "name": name,
                    "shape": list(a.shape),
                    "datatype": "INT32" if a.dtype == np.int32 else "FP32",
                    "data": a.ravel().tolist(),
                }
                for name, a in inputs.items()
            ]
        }
    ).encode()


def percentiles(latencies: list[float]) -> tuple[float, float]:
    arr = np.asarray(latencies) * 1000.0
    return float(np.percentile(arr, 50)), float(np.percentile(arr, 99))


def run_raw(
    repo: Path,
    model: str,
    concurrency: int,
    duration: float,
    feed: dict[str, np.ndarray] | None = None,
    device: str = "cpu",
) -> Result:
    """``feed`` defaults to :func:`batch1_inputs` of ``model``."""
    providers = ["CUDAExecutionProvider"] if device == "cuda" else ["CPUExecutionProvider"]
    session = ort.InferenceSession(str(repo / model / "1" / "model.onnx"), providers=providers)
    if session.get_providers()[0] != providers[0]:
        raise RuntimeError(f"onnxruntime fell back to {session.get_providers()}")
    feed = batch1_inputs(model) if feed is None else feed
    for _ in range(50):  # warm-up
        session.run(None, feed)
    r = run_threads(lambda: session.run(None, feed), concurrency, duration)
    r.model = model
    return r


def run_threads(
    call: Callable[[], object], concurrency: int, duration: float, target: str = "raw ORT"
) -> Result:
    """``call`` in a closed loop from ``concurrency`` threads of this process for
    ``duration`` seconds (an engine that releases the GIL runs them in parallel); the
    process's CPU seconds over the run."""
    latencies: list[list[float]] = [[] for _ in range(concurrency)]
    stop = time.perf_counter() + duration

    def worker(out: list[float]) -> None:
        while True:
            t0 = time.perf_counter()
            if t0 >= stop:
                return
            call()
            out.append(time.perf_counter() - t0)

    cpu0 = time.process_time()
    start = time.perf_counter()
    threads = [threading.Thread(target=worker, args=(lat,)) for lat in latencies]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - start
    flat = [x for lat in latencies for x in lat]
    p50, p99 = percentiles(flat)
    cpu = time.process_time() - cpu0
    return Result("", target, concurrency, len(flat), elapsed, p50, p99, cpu, 0.0)


async def drive_http(url: str, body: bytes, concurrency: int, duration: float) -> list[float]:
    latencies: list[list[float]] = [[] for _ in range(concurrency)]
    headers = {"Content-Type": "application/json"}
    warmup_until = time.perf_counter() + min(1.0, duration / 5)

    async def worker(out: list[float]) -> None:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1)) as session:
            while time.perf_counter() < warmup_until:
                async with session.post(url, data=body, headers=headers) as resp:
                    await resp.read()
            stop = time.perf_counter() + duration
            while True:
                t0 = time.perf_counter()
                if t0 >= stop:
                    return
                async with session.post(url, data=body, headers=headers) as resp:
                    await resp.read()
                    if resp.status != 200:
                        raise RuntimeError(f"HTTP {resp.status}: {await resp.text()}")
                out.append(time.perf_counter() - t0)

    await asyncio.gather(*(worker(lat) for lat in latencies))
    return [x for lat in latencies for x in lat]


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    ticks = os.sysconf("SC_CLK_TCK")
    return (int(fields[11]) + int(fields[12])) / ticks  # utime + stime


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class KilnServer:
    def __init__(self, repo: Path) -> None:
        self.port = free_port()
        cmd = [
            sys.executable, "-m", "kiln", "serve", "--model-repository", str(repo),
            "--http-port", str(self.port), "--grpc-port", str(free_port()),
            "--metrics-port", str(free_port()), "--log-level", "warning",
        ]  # fmt: skip
        self.proc = subprocess.Popen(cmd)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                url = f"http://127.0.0.1:{self.port}/v2/health/ready"
                with urllib.request.urlopen(url, timeout=1) as r:
                    if r.status == 200:
                        return
            except OSError:
                time.sleep(0.1)
        raise RuntimeError("kiln did not become ready")

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)


def run_kiln(server: KilnServer, model: str, concurrency: int, duration: float) -> Result:
    url = f"http://127.0.0.1:{server.port}/v2/models/{model}/infer"
    body = json_body(batch1_inputs(model))
    s0 = cpu_seconds(server.proc.pid)
    c0 = resource.getrusage(resource.RUSAGE_SELF)
    start = time.perf_counter()
    latencies = asyncio.run(drive_http(url, body, concurrency, duration))
    elapsed = time.perf_counter() - start - min(1.0, duration / 5)
    c1 = resource.getrusage(resource.RUSAGE_SELF)
    client_cpu = (c1.ru_utime - c0.ru_utime) + (c1.ru_stime - c0.ru_stime)
    p50, p99 = percentiles(latencies)
    server_cpu = cpu_seconds(server.proc.pid) - s0
    return Result(
        model, "kiln HTTP/JSON", concurrency, len(latencies), elapsed, p50, p99, server_cpu,
        client_cpu,
    )  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--duration", type=float, default=5.0, help="seconds per measurement")
    parser.add_argument("--json", type=Path, help="write results to this file")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    args = parser.parse_args()
    console = Console(width=150)
    results: list[Result] = []
    with tempfile.TemporaryDirectory() as tmp:
        repo = Path(tmp) / "models"
        build_example_repository(repo, MODELS)
        if args.device == "cuda":
            for model in MODELS:
                config = repo / model / "config.pbtxt"
                text = config.read_text()
                if "KIND_CPU" in text:
                    config.write_text(text.replace("KIND_CPU", "KIND_GPU"))
                else:
                    config.write_text(text + "\ninstance_group [ { kind: KIND_GPU } ]\n")
        server = KilnServer(repo)
        try:
            for model in MODELS:
                for c in CONCURRENCY:
                    # Raw engine right before the server, same conditions (this VM drifts).
                    console.log(f"{model} c={c}: raw onnxruntime")
                    results.append(run_raw(repo, model, c, args.duration, device=args.device))
                    console.log(f"{model} c={c}: kiln HTTP/JSON")
                    results.append(run_kiln(server, model, c, args.duration))
        finally:
            server.close()

    where = f"{platform.node()}, {os.cpu_count()} CPUs, device {args.device}"
    table = Table(title=f"serving baseline ({where})")
    for col in ("model", "target", "conc", "req/s", "p50 ms", "p99 ms", "x raw thr",
                "x raw p50", "server CPU s", "loadgen CPU s"):  # fmt: skip
        table.add_column(col, justify="right")
    raw = {(r.model, r.concurrency): r for r in results if r.target == "raw ORT"}
    for r in results:
        base = raw[(r.model, r.concurrency)]
        table.add_row(
            r.model, r.target, str(r.concurrency), f"{r.throughput:,.0f}", f"{r.p50_ms:.3f}",
            f"{r.p99_ms:.3f}", f"{r.throughput / base.throughput:.2f}",
            f"{r.p50_ms / base.p50_ms:.1f}", f"{r.server_cpu_s:.1f}", f"{r.client_cpu_s:.1f}",
        )  # fmt: skip
    console.print(table)
    if args.json:
        args.json.write_text(
            json.dumps([asdict(r) | {"throughput": r.throughput} for r in results], indent=2)
        )


if __name__ == "__main__":
    main()
