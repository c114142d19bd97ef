"""Dynamic batching benchmark (issue 4): the MLP at concurrency 32, gRPC and HTTP/binary.

In one run, for each server in turn — raw onnxruntime re-measured first (batch sizes 1..32,
one caller with 2 intra-op threads and two callers with 1 each: the physical limit), then:

- **kiln unbatched**: ``max_batch_size: 1`` (kiln's, like Triton's, auto-complete would add
  ``dynamic_batching {}`` to any model with ``max_batch_size > 1``), so the direct scheduler
  runs every request alone; 1 instance;
- **kiln batched x1 / x2**: ``max_batch_size: 64`` + ``dynamic_batching {
  max_queue_delay_microseconds: D }``, 1 and 2 instances;
- **Triton batched**: the pytriton wheel's ``tritonserver``, python backend
  (``peers/triton_batched_model.py``: concatenates the batch, one onnxruntime run, splits),
  the same ``dynamic_batching`` block, 1 instance;
- **MLServer batched**: adaptive batching (``max_batch_size: 32``, ``max_batch_time: D``),
  custom onnxruntime runtime. MLServer has no binary extension: its HTTP row is HTTP/JSON.

Every server's onnxruntime has spinning off and 2 intra-op threads per instance (1 each with
two instances). Each run reports throughput, p50/p99, the average batch formed (statistics
``inference_count / execution_count`` over the window), server CPU split by thread group
(``/proc/<pid>/task/*/stat``; kiln runs under ``named_threads.py`` so its Python threads
have names) and load-generator CPU; then the issue's targets, PASS/MISS. Usage::

    .venv/bin/python benchmarks/batching.py [--duration 5] [--delay-us 1000] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from batching_probe import Counts, batch_counts, raw_sweep, thread_cpu, thread_split
from batching_report import report
from loadgen import Window, drive_grpc, drive_http
from peer_servers import ServerProcess, missing_reason, start_kiln, start_mlserver, start_triton
from serving_baseline import batch1_inputs, json_body, percentiles
from serving_peers import binary_body, grpc_request, verify

from kiln.examples import build_example_repository

MODEL, CONCURRENCY = "mlp", 32


@dataclass(slots=True)
class Run:
    server: str
    protocol: str
    requests: int
    seconds: float
    p50_ms: float
    p99_ms: float
    server_cpu_s: float
    loadgen_cpu_s: float
    avg_batch: float | None
    queue_ms: float | None  # server-side, per request (statistics)
    compute_ms: float | None
    threads: dict[str, float] = field(default_factory=dict)
    raw: list[dict[str, float]] = field(default_factory=list)  # raw ORT measured before it

    @property
    def throughput(self) -> float:
        return self.requests / self.seconds


def kiln_repo(base: Path, work: Path, name: str, edit: Callable[[str], str]) -> Path:
    repo = work / name.replace(" ", "_")
    config = base / MODEL / "config.pbtxt"
    (repo / MODEL / "1").mkdir(parents=True)
    for f in (base / MODEL).iterdir():
        if f.is_file() and f.name != "config.pbtxt":
            (repo / MODEL / f.name).write_bytes(f.read_bytes())
    (repo / MODEL / "1" / "model.onnx").write_bytes(
        (base / MODEL / "1" / "model.onnx").read_bytes()
    )
    (repo / MODEL / "config.pbtxt").write_text(edit(config.read_text()))
    return repo


def _replace(text: str, old: str, new: str) -> str:
    if old not in text:  # the example config changed: fail loudly rather than measure it
        raise RuntimeError(f"'{old}' not in the example mlp config.pbtxt")
    return text.replace(old, new)


def with_batching(delay_us: int, count: int = 1) -> Callable[[str], str]:
    def edit(text: str) -> str:
        text = _replace(text, "count: 1", f"count: {count}")
        return text + f"dynamic_batching {{ max_queue_delay_microseconds: {delay_us} }}\n"

    return edit


def unbatched(text: str) -> str:
    return _replace(text, "max_batch_size: 64", "max_batch_size: 1")


async def window(
    server: ServerProcess, protocol: str, warmup: float, duration: float
) -> tuple[Window, dict[str, float], Counts | None]:
    """One closed-loop window, with thread CPU and statistics sampled at its edges."""
    inputs = batch1_inputs(MODEL)
    url = f"http://127.0.0.1:{server.http_port}/v2/models/{MODEL}/infer"
    if protocol == "gRPC":
        load = drive_grpc(f"127.0.0.1:{server.grpc_port}", grpc_request(MODEL, inputs),
                          CONCURRENCY, server.pid, warmup, duration)  # fmt: skip
    elif protocol == "HTTP/binary":
        body, headers = binary_body(inputs)
        load = drive_http(url, body, headers, CONCURRENCY, server.pid, warmup, duration)
    else:
        headers = {"Content-Type": "application/json"}
        load = drive_http(url, json_body(inputs), headers, CONCURRENCY, server.pid, warmup,
                          duration)  # fmt: skip
    start = time.perf_counter()

    async def probe() -> tuple[dict[str, float], Counts | None, Counts | None]:
        await asyncio.sleep(warmup - (time.perf_counter() - start))
        t0 = thread_cpu(server.pid)
        s0 = await asyncio.to_thread(batch_counts, server.http_port, MODEL)
        await asyncio.sleep(warmup + duration - (time.perf_counter() - start))
        t1 = thread_cpu(server.pid)
        s1 = await asyncio.to_thread(batch_counts, server.http_port, MODEL)
        return thread_split(t0, t1), s0, s1

    w, (threads, s0, s1) = await asyncio.gather(load, probe())
    delta = s1.minus(s0) if s0 and s1 and s1.executions > s0.executions else None
    return w, threads, delta


def measure(server: ServerProcess, name: str, protocols: tuple[str, ...], model_path: Path,
            args: argparse.Namespace, log: Callable[[str], None]) -> list[Run]:  # fmt: skip
    log(f"{name}: raw onnxruntime")
    raw = [asdict(p) | {"inferences_per_s": p.inferences_per_s, "compute_ms": p.compute_ms}
           for p in raw_sweep(model_path, args.raw_seconds)]  # fmt: skip
    runs = []
    for protocol in protocols:
        verify(server, protocol, MODEL)
        log(f"{name}: {protocol}")
        w: Window
        w, threads, c = asyncio.run(window(server, protocol, args.warmup, args.duration))
        p50, p99 = percentiles(w.latencies)
        avg = c.inferences / c.executions if c else None
        queue = c.queue_ns / c.success / 1e6 if c and c.success else None
        compute = c.compute_ns / c.success / 1e6 if c and c.success else None
        runs.append(Run(name, protocol, len(w.latencies), w.seconds, p50, p99, w.server_cpu_s,
                        w.client_cpu_s, avg, queue, compute, threads, raw))  # fmt: skip
    return runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--duration", type=float, default=5.0, help="seconds per window")
    parser.add_argument("--warmup", type=float, default=1.0, help="seconds before each window")
    parser.add_argument("--raw-seconds", type=float, default=0.5, help="per raw batch size")
    parser.add_argument("--delay-us", type=int, default=1000, help="max_queue_delay_microseconds")
    parser.add_argument("--json", type=Path, help="write the runs to this file")
    parser.add_argument("--servers", nargs="*", help="subset of the server names to run")
    args = parser.parse_args()
    both = ("gRPC", "HTTP/binary")
    runs: list[Run] = []
    skipped: dict[str, str] = {}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        base = work / "base"
        build_example_repository(base, (MODEL,))
        model_path = base / MODEL / "1" / "model.onnx"
        d = args.delay_us
        servers: dict[str, tuple[str | None, Callable[[], ServerProcess], tuple[str, ...]]] = {
            "kiln unbatched": (None, lambda: start_kiln(
                kiln_repo(base, work, "kiln unbatched", unbatched), work, True), both),
            "kiln batched x1": (None, lambda: start_kiln(
                kiln_repo(base, work, "kiln batched x1", with_batching(d)), work, True), both),
            "kiln batched x2": (None, lambda: start_kiln(
                kiln_repo(base, work, "kiln batched x2", with_batching(d, 2)), work, True), both),
            "Triton batched": ("pytriton", lambda: start_triton(
                base, (MODEL,), work, "triton_batched_model.py", with_batching(d)), both),
            "MLServer batched": ("mlserver", lambda: start_mlserver(base, (MODEL,), work, {
                "max_batch_size": CONCURRENCY, "max_batch_time": d / 1e6,
                "parameters": {"extra": {"allow_spinning": "0"}}}), ("gRPC", "HTTP/JSON")),
        }  # fmt: skip
        for name, (venv, start, protocols) in servers.items():
            if args.servers and name not in args.servers:
                continue
            reason = missing_reason(venv) if venv else None
            if reason is None:
                try:
                    server = start()
                    server.wait_ready((MODEL,))
                except (RuntimeError, OSError) as exc:
                    reason = f"could not start: {exc}"
            if reason is not None:
                print(f"skipping {name}: {reason}", flush=True)
                skipped[name] = reason
                continue
            try:
                runs.extend(measure(server, name, protocols, model_path, args, _log))
            finally:
                server.close()
    print(report(runs, args.delay_us))
    for name, reason in skipped.items():
        print(f"skipped {name}: {reason}")
    if args.json:
        out = {"delay_us": args.delay_us, "runs": [asdict(r) for r in runs], "skipped": skipped}
        args.json.write_text(json.dumps(out, indent=2))


def _log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


if __name__ == "__main__":
    main()
