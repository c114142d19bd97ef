"""Closed-loop load for the repository's benchmarks, on ``kiln bench``'s transports.

Every worker owns one keep-alive connection (HTTP, ``kiln.bench.transport.HttpConnection``)
or one channel (gRPC) and sends the same pre-serialised body in a loop; responses are not
parsed in the timed path. All workers share one warm-up period and one measurement window;
server and generator CPU are sampled exactly at the window edges so that CPU per request is
not inflated by warm-up. ``kiln bench`` is the product; this keeps the benchmarks' fixed
single-window method (and the server process-tree CPU they report).
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from kiln.bench.measure import Slot
from kiln.bench.stats import own_cpu, process_tree_cpu
from kiln.bench.transport import MODEL_INFER, GrpcSlot, HttpConnection, HttpSlot, http_request

__all__ = [
    "MODEL_INFER",
    "Window",
    "drive_grpc",
    "drive_http",
    "own_cpu",
    "process_tree_cpu",
    "start_kiln",
]


@dataclass(slots=True)
class Window:
    """What one measurement window produced."""

    latencies: list[float]
    seconds: float
    server_cpu_s: float
    client_cpu_s: float


async def _closed_loop(slots: list[Slot], server_pid: int, warmup: float,
                       duration: float) -> Window:  # fmt: skip
    start = time.perf_counter()
    window_start, stop = start + warmup, start + warmup + duration
    latencies: list[list[float]] = [[] for _ in slots]

    async def worker(slot: Slot, out: list[float]) -> None:
        while True:
            t0 = time.perf_counter()
            if t0 >= stop:
                return
            await slot.infer()  # a failure is a RequestError: the benchmark stops on it
            if t0 >= window_start:
                out.append(time.perf_counter() - t0)

    async def sampler() -> tuple[float, float]:
        await asyncio.sleep(window_start - time.perf_counter())
        s0, c0 = process_tree_cpu(server_pid), own_cpu()
        await asyncio.sleep(stop - time.perf_counter())
        return process_tree_cpu(server_pid) - s0, own_cpu() - c0

    try:
        cpu = asyncio.ensure_future(sampler())
        await asyncio.gather(*(worker(s, lat) for s, lat in zip(slots, latencies, strict=True)))
        server_cpu, client_cpu = await cpu
    finally:
        await asyncio.gather(*(s.close() for s in slots))
    return Window([x for lat in latencies for x in lat], duration, server_cpu, client_cpu)


async def drive_http(
    url: str, body: bytes, headers: dict[str, str], concurrency: int, server_pid: int,
    warmup: float, duration: float,
) -> Window:  # fmt: skip
    parts = urllib.parse.urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    # identity: a peer that compresses would otherwise make us pay for inflating.
    request = http_request(
        "POST", host, parts.path, body, {"Accept-Encoding": "identity", **headers}
    )
    slots: list[Slot] = [
        HttpSlot(HttpConnection(host, port, timeout_s=60.0), [request]) for _ in range(concurrency)
    ]
    return await _closed_loop(slots, server_pid, warmup, duration)


async def drive_grpc(
    target: str, request: bytes | list[bytes], concurrency: int, server_pid: int,
    warmup: float, duration: float,
) -> Window:  # fmt: skip
    """``request``: what every worker sends, or a list with one request per worker."""
    each = request if isinstance(request, list) else [request] * concurrency
    slots: list[Slot] = [GrpcSlot(target, [each[i]], 60.0) for i in range(concurrency)]
    return await _closed_loop(slots, server_pid, warmup, duration)


def start_kiln(repo: Path, model: str, extra: list[str]) -> tuple[subprocess.Popen[bytes], int]:
    """``kiln serve`` on free ports with ``extra`` flags, once ``model`` is ready; returns
    the process and its HTTP port."""
    from serving_baseline import free_port  # it imports nothing of this module's

    port = free_port()
    cmd = [
        sys.executable, "-m", "kiln", "serve", "--model-repository", str(repo),
        "--http-port", str(port), "--grpc-port", str(free_port()),
        "--metrics-port", str(free_port()), "--log-level", "warning", *extra,
    ]  # fmt: skip
    proc = subprocess.Popen(cmd)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            url = f"http://127.0.0.1:{port}/v2/models/{model}/ready"
            with urllib.request.urlopen(url, timeout=1) as r:
                if r.status == 200:
                    return proc, port
        except OSError:
            time.sleep(0.2)
    proc.kill()
    raise RuntimeError("kiln did not become ready")
