"""kiln's gRPC transports compared: its own HTTP/2 protocol (``--grpc-implementation
kiln``) and grpc.aio (``grpcio``), same server, same model, same closed-loop load.

For each round and implementation in turn: start ``kiln serve`` on the example repository
(only the measured model loaded), drive ``ModelInfer`` at concurrency C over gRPC with the
benchmarks' load generator (one grpc.aio channel per worker), and report the server
process tree's CPU per request (utime + stime from /proc at the window's edges), the
throughput and p50/p99. Implementations alternate so that drift on a shared machine
shows up as round-to-round spread rather than as a difference. ``http`` in
``--implementations`` adds HTTP/binary on the same server (kiln's fast inference path) as a
reference. Usage::

    .venv/bin/python benchmarks/grpc_transport.py [--model mlp] [--concurrency 16]
        [--duration 5] [--rounds 3] [--implementations grpcio,kiln,http]
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from loadgen import Window, drive_grpc, drive_http
from serving_baseline import batch1_inputs, free_port, percentiles
from serving_peers import binary_body, grpc_request

from kiln.examples import build_example_repository


def start(
    repo: Path, model: str, implementation: str, log: Path
) -> tuple[subprocess.Popen[bytes], int, int]:
    http, grpc_port = free_port(), free_port()
    cmd = [
        sys.executable, "-m", "kiln", "serve", "--model-repository", str(repo),
        "--model-control-mode", "explicit", "--load-model", model,
        "--http-port", str(http), "--grpc-port", str(grpc_port),
        "--metrics-port", str(free_port()), "--log-level", "warning", "--no-history",
        "--grpc-implementation", implementation,
    ]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=log.open("wb"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 60
    url = f"http://127.0.0.1:{http}/v2/models/{model}/ready"
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"kiln exited: {log.read_text()[-2000:]}")
        try:
            with urllib.request.urlopen(url, timeout=1) as resp:
                if resp.status == 200:
                    return proc, http, grpc_port
        except OSError:
            pass
        time.sleep(0.1)
    proc.kill()
    raise TimeoutError("kiln not ready")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="mlp")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--duration", type=float, default=5.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--implementations", default="grpcio,kiln")
    args = parser.parse_args()
    inputs = batch1_inputs(args.model)
    request = grpc_request(args.model, inputs)
    body, headers = binary_body(inputs)
    with tempfile.TemporaryDirectory() as tmp:
        repo = Path(tmp) / "models"
        build_example_repository(repo)
        print(f"model {args.model}, concurrency {args.concurrency}, {args.duration}s windows")
        print(f"{'impl':8} {'req/s':>8} {'p50 ms':>7} {'p99 ms':>7} {'server µs/req':>14} "
              f"{'client µs/req':>14}")  # fmt: skip
        for _ in range(args.rounds):
            for impl in args.implementations.split(","):
                server_impl = "kiln" if impl == "http" else impl
                proc, http, port = start(repo, args.model, server_impl, Path(tmp) / f"{impl}.log")
                try:
                    if impl == "http":
                        url = f"http://127.0.0.1:{http}/v2/models/{args.model}/infer"
                        load = drive_http(
                            url, body, headers, args.concurrency, proc.pid, 1.0, args.duration
                        )
                    else:
                        load = drive_grpc(
                            f"127.0.0.1:{port}", request, args.concurrency, proc.pid, 1.0,
                            args.duration,
                        )  # fmt: skip
                    w: Window = asyncio.run(load)
                finally:
                    proc.terminate()
                    proc.wait(30)
                n = len(w.latencies)
                p50, p99 = percentiles(w.latencies)
                print(f"{impl:8} {n / w.seconds:8.0f} {p50:7.2f} {p99:7.2f} "
                      f"{w.server_cpu_s / n * 1e6:14.1f} {w.client_cpu_s / n * 1e6:14.1f}",
                      flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
