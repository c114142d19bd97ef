"""Lean closed-loop load generators (HTTP via aiohttp, gRPC via grpc.aio) with CPU accounting.

Every worker owns one keep-alive connection (HTTP) or one channel (gRPC) and sends the same
pre-serialised body in a loop; responses are read but not parsed in the timed path, so the
generator spends as little of the 2 shared cores as possible. All workers share one warm-up
period and one measurement window; server and generator CPU are sampled exactly at the window
edges so that CPU per request is not inflated by warm-up.
"""

from __future__ import annotations

import asyncio
import os
import resource
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import grpc

MODEL_INFER = "/inference.GRPCInferenceService/ModelInfer"


@dataclass(slots=True)
class Window:
    """What one measurement window produced."""

    latencies: list[float]
    seconds: float
    server_cpu_s: float
    client_cpu_s: float


def process_tree_cpu(root: int) -> float:
    """utime+stime of ``root`` and all its descendants (Triton's python stubs are children)."""
    parents: dict[int, int] = {}
    times: dict[int, float] = {}
    ticks = os.sysconf("SC_CLK_TCK")
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:  # the process exited while we looked
            continue
        parents[int(entry.name)] = int(fields[1])
        times[int(entry.name)] = (int(fields[11]) + int(fields[12])) / ticks
    total, todo = 0.0, [root]
    while todo:
        pid = todo.pop()
        total += times.get(pid, 0.0)
        todo.extend(child for child, parent in parents.items() if parent == pid)
    return total


def own_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


Call = Callable[[], Awaitable[None]]


async def _closed_loop(
    calls: list[Call], server_pid: int, warmup: float, duration: float
) -> Window:
    start = time.perf_counter()
    window_start, stop = start + warmup, start + warmup + duration
    latencies: list[list[float]] = [[] for _ in calls]

    async def worker(call: Call, out: list[float]) -> None:
        while True:
            t0 = time.perf_counter()
            if t0 >= stop:
                return
            await call()
            if t0 >= window_start:
                out.append(time.perf_counter() - t0)

    async def sampler() -> tuple[float, float]:
        await asyncio.sleep(window_start - time.perf_counter())
        s0, c0 = process_tree_cpu(server_pid), own_cpu()
        await asyncio.sleep(stop - time.perf_counter())
        return process_tree_cpu(server_pid) - s0, own_cpu() - c0

    results = await asyncio.gather(
        sampler(), *(worker(call, lat) for call, lat in zip(calls, latencies, strict=True))
    )
    server_cpu, client_cpu = results[0]
    flat = [x for lat in latencies for x in lat]
    return Window(flat, duration, server_cpu, client_cpu)


async def drive_http(
    url: str, body: bytes, headers: dict[str, str], concurrency: int, server_pid: int,
    warmup: float, duration: float,
) -> Window:  # fmt: skip
    sessions = [
        aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1), auto_decompress=False)
        for _ in range(concurrency)
    ]

    def make_call(session: aiohttp.ClientSession) -> Call:
        async def call() -> None:
            async with session.post(url, data=body, headers=headers) as resp:
                payload = await resp.read()
                if resp.status != 200:
                    raise RuntimeError(f"HTTP {resp.status} from {url}: {payload[:300]!r}")

        return call

    try:
        calls = [make_call(s) for s in sessions]
        return await _closed_loop(calls, server_pid, warmup, duration)
    finally:
        await asyncio.gather(*(s.close() for s in sessions))


async def drive_grpc(
    target: str, request: bytes, concurrency: int, server_pid: int, warmup: float,
    duration: float,
) -> Window:  # fmt: skip
    # No (de)serialiser: the request is sent as pre-serialised bytes and the response bytes
    # are not decoded, exactly like the HTTP driver's unparsed body.
    channels = [grpc.aio.insecure_channel(target) for _ in range(concurrency)]

    def make_call(channel: grpc.aio.Channel) -> Call:
        infer = channel.unary_unary(MODEL_INFER)

        async def call() -> None:
            await infer(request)

        return call

    try:
        calls = [make_call(c) for c in channels]
        return await _closed_loop(calls, server_pid, warmup, duration)
    finally:
        await asyncio.gather(*(c.close() for c in channels))
