"""What request tracing costs: the example ``simple`` model over HTTP/binary with tracing off,
at Triton's default rate (1 in 1000), and on every request (Triton's format to a file, and
OpenTelemetry spans to an OTLP/HTTP receiver in this process that drops them).

The configurations alternate round by round in one run, because this VM drifts; the
figures are medians. "server CPU µs/req" is the CPU of kiln's process over the window per
request: the figure least disturbed by other load. Usage::

    .venv/bin/python benchmarks/tracing_overhead.py [--rounds 3] [--duration 4] [--concurrency 8]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import numpy as np
from loadgen import drive_http, start_kiln
from rich.console import Console
from rich.table import Table
from serving_peers import binary_body

from kiln.examples import build_example_repository


class _Drop(BaseHTTPRequestHandler):
    """An OTLP/HTTP receiver that takes the spans and keeps none."""

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers["Content-Length"]))
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: Any) -> None:
        pass


def configurations(work: Path, otlp_port: int) -> dict[str, list[str]]:
    def flags(*settings: str) -> list[str]:
        return [arg for s in settings for arg in ("--trace-config", s)]

    trace_file = f"triton,file={work / 'trace.json'}"
    return {
        "off": [],
        "triton, rate 1000": flags(trace_file, "level=TIMESTAMPS", "rate=1000"),
        "triton, every request": flags(
            trace_file, "level=TIMESTAMPS", "rate=1", "triton,log-frequency=5000"
        ),
        "triton TENSORS, every request": flags(
            trace_file,
            "level=TIMESTAMPS",
            "level=TENSORS",
            "rate=1",
            "triton,log-frequency=5000",
        ),
        "opentelemetry, every request": flags(
            "mode=opentelemetry",
            "level=TIMESTAMPS",
            "rate=1",
            f"opentelemetry,url=127.0.0.1:{otlp_port}",
            "opentelemetry,bsp_schedule_delay=500",
            "opentelemetry,bsp_max_queue_size=65536",
        ),
    }


def measure(repo: Path, extra: list[str], concurrency: int, duration: float) -> tuple[float, float]:
    proc, port = start_kiln(repo, "simple", extra)
    try:
        a = np.arange(16, dtype=np.int32).reshape(1, 16)
        body, headers = binary_body({"INPUT0": a, "INPUT1": a})
        headers = {**headers, "Accept-Encoding": "identity"}
        url = f"http://127.0.0.1:{port}/v2/models/simple/infer"
        window = asyncio.run(drive_http(url, body, headers, concurrency, proc.pid, 1.0, duration))
        n = len(window.latencies)
        return n / window.seconds, window.server_cpu_s / n * 1e6
    finally:
        proc.terminate()
        proc.wait(30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--duration", type=float, default=4.0)
    parser.add_argument("--concurrency", type=int, default=8)
    args = parser.parse_args()
    receiver = ThreadingHTTPServer(("127.0.0.1", 0), _Drop)
    threading.Thread(target=receiver.serve_forever, daemon=True).start()
    console = Console()
    results: dict[str, list[tuple[float, float]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        repo = work / "models"
        build_example_repository(repo, ["simple"])
        configs = configurations(work, receiver.server_address[1])
        for rnd in range(1, args.rounds + 1):
            for name, extra in configs.items():
                console.log(f"round {rnd}: {name}")
                results.setdefault(name, []).append(
                    measure(repo, extra, args.concurrency, args.duration)
                )
    receiver.shutdown()
    table = Table(
        title=f"Tracing overhead: simple, HTTP/binary, c={args.concurrency}, "
        f"{args.rounds} rounds x {args.duration:g}s, medians"
    )
    for column in ("tracing", "req/s", "x off", "server CPU µs/req", "+ µs/req"):
        table.add_column(column, justify="left" if column == "tracing" else "right")
    base_thr = statistics.median(r[0] for r in results["off"])
    base_cpu = statistics.median(r[1] for r in results["off"])
    for name, rows in results.items():
        thr = statistics.median(r[0] for r in rows)
        cpu = statistics.median(r[1] for r in rows)
        table.add_row(name, f"{thr:,.0f}", f"{thr / base_thr:.2f}", f"{cpu:.0f}",
                      f"{cpu - base_cpu:+.0f}")  # fmt: skip
    console.print(table)


if __name__ == "__main__":
    main()
