"""Tune the chosen candidate's serving config by measuring it through kiln's own scheduler.

Each point of a small grid (instance count x dynamic batching off / max queue delay, with the
profiled batch sizes as preferred sizes) is written as a temporary repository entry, loaded by
an in-process :class:`kiln.server.server.Server`, and driven by a closed loop of concurrent
asyncio callers of ``Server.infer``, one sample per request as clients send them, for a fixed
time. The best throughput whose request p99 is within ``--latency-budget-ms`` wins.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kiln.optimize.data import Batch, slice_batch
from kiln.optimize.deploy import write_entry
from kiln.optimize.types import Candidate, ServingConfig

DELAYS_US = (None, 0, 100, 500, 1000)  # None: no dynamic batching
INSTANCES = (1, 2)
_WARMUP_REQUESTS = 8


@dataclass(slots=True)
class ServingPoint:
    config: ServingConfig
    throughput: float  # requests (= samples) per second
    p50_ms: float
    p99_ms: float
    requests: int
    errors: int
    error: str = ""


@dataclass(slots=True)
class Tuning:
    grid: list[ServingPoint]
    best: ServingPoint | None
    why: str


def grid(batch_sizes: list[int]) -> list[ServingConfig]:
    preferred = tuple(s for s in sorted(set(batch_sizes)) if s > 1)
    return [
        ServingConfig(n, delay, preferred if delay is not None else ())
        for n in INSTANCES
        for delay in DELAYS_US
    ]


def pick(points: list[ServingPoint], budget_ms: float | None) -> tuple[ServingPoint | None, str]:
    """Highest throughput within the p99 budget; else the lowest p99, said so."""
    ok = [p for p in points if p.errors == 0 and p.requests > 0]
    if not ok:
        return None, "every serving config failed: " + (points[0].error if points else "none")
    within = [p for p in ok if budget_ms is None or p.p99_ms <= budget_ms]
    if within:
        # Fewer instances on a tie: they cost memory and threads for nothing.
        best = max(within, key=lambda p: (p.throughput, -p.config.instances))
        bound = f" with p99 {best.p99_ms:.3f} ms <= {budget_ms} ms" if budget_ms else ""
        return best, f"highest throughput {best.throughput:.0f}/s{bound}"
    best = min(ok, key=lambda p: p.p99_ms)
    return best, (
        f"no serving config kept request p99 within {budget_ms} ms; lowest p99 {best.p99_ms:.3f} ms"
    )


async def _measure(
    repo: Path, name: str, data: Batch, concurrency: int, seconds: float
) -> tuple[list[float], int, str]:
    from kiln.core.types import DataType, InferenceRequest, InferInput
    from kiln.server.server import Server, ServerOptions

    n = len(next(iter(data.values())))
    requests = []
    for i in range(min(n, 64)):
        one = slice_batch(data, i, i + 1)
        inputs = [InferInput(k, DataType.from_numpy(v.dtype), tuple(v.shape), v)
                  for k, v in one.items()]  # fmt: skip
        requests.append(InferenceRequest(model_name=name, inputs=inputs))
    server = Server(ServerOptions([repo]))
    await server.start()
    latencies: list[float] = []
    errors: list[str] = []
    try:
        for req in requests[:_WARMUP_REQUESTS]:
            await server.infer(req)
        deadline = time.perf_counter() + seconds

        async def caller(k: int) -> None:
            i = k
            while time.perf_counter() < deadline:
                start = time.perf_counter()
                try:
                    await server.infer(requests[i % len(requests)])
                except Exception as exc:  # a failing config is reported, not fatal
                    errors.append(str(exc))
                    return
                latencies.append(time.perf_counter() - start)
                i += concurrency

        await asyncio.gather(*(caller(k) for k in range(concurrency)))
    finally:
        await server.stop()
    return latencies, len(errors), errors[0] if errors else ""


def measure(
    candidate: Candidate,
    name: str,
    config: ServingConfig,
    workdir: Path,
    data: Batch,
    max_batch_size: int,
    threads: int,
    concurrency: int,
    seconds: float,
) -> ServingPoint:
    repo = workdir / "repo"
    write_entry(repo, name, candidate, max_batch_size, threads, config)
    started = time.perf_counter()
    try:
        latencies, errors, first = asyncio.run(_measure(repo, name, data, concurrency, seconds))
    except Exception as exc:  # the entry did not load: the point failed, the rest go on
        return ServingPoint(config, 0.0, 0.0, 0.0, 0, 1, str(exc).splitlines()[0])
    elapsed = max(time.perf_counter() - started, 1e-9)
    if not latencies:
        return ServingPoint(config, 0.0, 0.0, 0.0, 0, max(errors, 1), first or "no request done")
    ms = np.asarray(latencies) * 1000.0
    window = min(elapsed, seconds) if seconds > 0 else elapsed
    return ServingPoint(
        config,
        throughput=len(latencies) / window,
        p50_ms=float(np.percentile(ms, 50)),
        p99_ms=float(np.percentile(ms, 99)),
        requests=len(latencies),
        errors=errors,
        error=first,
    )


def tune(
    candidate: Candidate,
    name: str,
    workdir: Path,
    data: Batch,
    batch_sizes: list[int],
    threads: int,
    concurrency: int,
    seconds: float,
    budget_ms: float | None,
) -> Tuning:
    max_batch = max(batch_sizes)
    points = [
        measure(candidate, name, config, workdir / f"serving-{i}", data, max_batch, threads,
                concurrency, seconds)
        for i, config in enumerate(grid(batch_sizes))
    ]  # fmt: skip
    best, why = pick(points, budget_ms)
    return Tuning(points, best, why)
