"""Serving benchmark against peers: raw onnxruntime, kiln, Triton and MLServer, in one run.

For each server (kiln, then Triton, then MLServer), each model (``simple``, ``mlp``) and each
concurrency (1, 8, 32):

- **raw ORT** is re-measured first (batch-1 ``InferenceSession.run`` from C threads in this
  process: the physical limit of a server that does not batch; this VM drifts, so every
  server is compared with the raw figure taken just before it);
- then the server is driven over **HTTP/JSON**, **HTTP/binary** (Triton's binary tensor
  extension: JSON header + raw bytes, ``Inference-Header-Content-Length``) and **gRPC**
  (``ModelInfer`` with ``raw_input_contents``, pre-serialised), with the lean load generator
  of ``loadgen.py``. Peers get the same bodies; MLServer has no binary extension.

No server batches: kiln runs with ``--disable-auto-complete-config`` (its direct scheduler,
as Triton runs a python-backend model whose config names no scheduler), MLServer without
adaptive batching. ``batching.py`` compares the servers with their batchers on.

Reports throughput, p50/p99, ratios to raw ORT and to kiln (same protocol), the per-request
overhead over raw ORT in µs (1/throughput difference and p50 difference) and server /
load-generator CPU per request. Peers come from ``benchmarks/setup_peers.sh``; a missing one
is skipped with the reason printed. Usage::

    .venv/bin/python benchmarks/serving_peers.py [--duration 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import tempfile
import urllib.request
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import grpc
import numpy as np
from loadgen import MODEL_INFER, Window, drive_grpc, drive_http
from peer_servers import (
    ServerProcess,
    missing_reason,
    start_kiln,
    start_mlserver,
    start_triton,
)
from rich.console import Console
from rich.table import Table
from serving_baseline import batch1_inputs, json_body, percentiles, run_raw
from tritonclient.grpc import service_pb2

from kiln.examples import build_example_repository, reference_outputs

MODELS = ("simple", "mlp")
CONCURRENCY = (1, 8, 32)
DATATYPES = {np.dtype(np.int32): "INT32", np.dtype(np.float32): "FP32"}
RAW = "raw ORT"


@dataclass(slots=True)
class Row:
    server: str  # "raw ORT", "kiln", "Triton", "MLServer"
    protocol: str  # "in-process", "HTTP/JSON", "HTTP/binary", "gRPC"
    model: str
    concurrency: int
    requests: int
    seconds: float
    p50_ms: float
    p99_ms: float
    server_cpu_s: float
    client_cpu_s: float

    @property
    def throughput(self) -> float:
        return self.requests / self.seconds

    @property
    def server_cpu_us_per_req(self) -> float:
        return self.server_cpu_s / max(self.requests, 1) * 1e6

    @property
    def client_cpu_us_per_req(self) -> float:
        return self.client_cpu_s / max(self.requests, 1) * 1e6


def binary_body(inputs: dict[str, np.ndarray]) -> tuple[bytes, dict[str, str]]:
    header = json.dumps(
        {
            "inputs": [
                {
                    "name": name,
                    "shape": list(a.shape),
                    "datatype": DATATYPES[a.dtype],
                    "parameters": {"binary_data_size": a.nbytes},
                }
                for name, a in inputs.items()
            ],
            "parameters": {"binary_data_output": True},
        }
    ).encode()
    headers = {
        "Content-Type": "application/octet-stream",
        "Inference-Header-Content-Length": str(len(header)),
    }
    return header + b"".join(a.tobytes() for a in inputs.values()), headers


def grpc_request(model: str, inputs: dict[str, np.ndarray]) -> bytes:
    request = service_pb2.ModelInferRequest(model_name=model)
    for name, a in inputs.items():
        request.inputs.add(name=name, datatype=DATATYPES[a.dtype], shape=list(a.shape))
        request.raw_input_contents.append(a.tobytes())
    return request.SerializeToString()


def drive(server: ServerProcess, protocol: str, model: str, c: int, duration: float) -> Window:
    inputs = batch1_inputs(model)
    warmup = min(1.0, duration / 5)
    url = f"http://127.0.0.1:{server.http_port}/v2/models/{model}/infer"
    # identity: MLServer gzips responses for clients that accept it.
    json_headers = {"Content-Type": "application/json", "Accept-Encoding": "identity"}
    if protocol == "HTTP/JSON":
        coro = drive_http(url, json_body(inputs), json_headers, c, server.pid, warmup, duration)
    elif protocol == "HTTP/binary":
        body, headers = binary_body(inputs)
        headers["Accept-Encoding"] = "identity"
        coro = drive_http(url, body, headers, c, server.pid, warmup, duration)
    else:
        target = f"127.0.0.1:{server.grpc_port}"
        coro = drive_grpc(target, grpc_request(model, inputs), c, server.pid, warmup, duration)
    return asyncio.run(coro)


def verify(server: ServerProcess, protocol: str, model: str) -> None:
    """One untimed request whose answer is decoded: a 200 with empty outputs must not count."""
    inputs = batch1_inputs(model)
    expected = sum(a.nbytes for a in reference_outputs(model, inputs).values())
    if protocol == "gRPC":
        channel = grpc.insecure_channel(f"127.0.0.1:{server.grpc_port}")
        with channel:
            raw = channel.unary_unary(MODEL_INFER)(grpc_request(model, inputs), timeout=30)
        reply = service_pb2.ModelInferResponse.FromString(raw)
        got = sum(len(b) for b in reply.raw_output_contents)
        got += sum(4 * (len(o.contents.int_contents) + len(o.contents.fp32_contents))
                   for o in reply.outputs)  # fmt: skip
    else:
        body, headers = json_body(inputs), {"Content-Type": "application/json"}
        if protocol == "HTTP/binary":
            body, headers = binary_body(inputs)
        url = f"http://127.0.0.1:{server.http_port}/v2/models/{model}/infer"
        request = urllib.request.Request(url, data=body, headers=headers)
        with urllib.request.urlopen(request, timeout=30) as resp:
            payload = resp.read()
            header_len = resp.headers.get("Inference-Header-Content-Length")
        if header_len is not None:
            got = len(payload) - int(header_len)
        else:
            got = sum(4 * len(o["data"]) for o in json.loads(payload)["outputs"])
    if got != expected:
        raise RuntimeError(f"{server.name} {protocol} {model}: {got} output bytes, want {expected}")


def measure_server(
    server: ServerProcess, repo: Path, duration: float, log: Callable[[str], None]
) -> list[Row]:
    rows: list[Row] = []
    for model in MODELS:
        for c in CONCURRENCY:
            log(f"{server.name}: {model} c={c}: raw onnxruntime")
            r = run_raw(repo, model, c, duration)
            rows.append(Row(RAW, f"before {server.name}", model, c, r.requests, r.seconds,
                            r.p50_ms, r.p99_ms, r.server_cpu_s, 0.0))  # fmt: skip
            for protocol in server.protocols:
                log(f"{server.name}: {model} c={c}: {protocol}")
                if c == CONCURRENCY[0]:
                    verify(server, protocol, model)
                w = drive(server, protocol, model, c, duration)
                p50, p99 = percentiles(w.latencies)
                rows.append(Row(server.name, protocol, model, c, len(w.latencies), w.seconds,
                                p50, p99, w.server_cpu_s, w.client_cpu_s))  # fmt: skip
    return rows


def table(rows: list[Row], title: str) -> Table:
    out = Table(title=title)
    for col in ("model", "conc", "server", "protocol", "req/s", "p50 ms", "p99 ms", "x raw",
                "x kiln", "over raw µs (1/thr, c=1)", "p50 Δ raw µs", "server CPU µs/req",
                "loadgen CPU µs/req"):  # fmt: skip
        out.add_column(col, justify="right")
    raw: Row | None = None
    kiln = {(r.model, r.concurrency, r.protocol): r for r in rows if r.server == "kiln"}
    for r in sorted(rows, key=lambda r: (MODELS.index(r.model), r.concurrency)):
        if r.server == RAW:
            raw = r  # the raw figure measured right before this server
            out.add_section()
        assert raw is not None
        k = kiln.get((r.model, r.concurrency, r.protocol))
        per_req = 1e6 / r.throughput - 1e6 / raw.throughput
        out.add_row(
            r.model, str(r.concurrency), r.server, r.protocol, f"{r.throughput:,.0f}",
            f"{r.p50_ms:.3f}", f"{r.p99_ms:.3f}", f"{r.throughput / raw.throughput:.2f}",
            f"{r.throughput / k.throughput:.2f}" if k and r.server not in ("kiln", RAW) else "",
            f"{per_req:,.0f}" if r.concurrency == 1 and r.server != RAW else "",
            f"{(r.p50_ms - raw.p50_ms) * 1000:,.0f}" if r.server != RAW else "",
            f"{r.server_cpu_us_per_req:,.0f}", f"{r.client_cpu_us_per_req:,.0f}",
        )  # fmt: skip
    return out


def to_json(rows: list[Row], skipped: dict[str, str]) -> dict[str, object]:
    results = []
    raw: Row | None = None
    for r in rows:
        raw = r if r.server == RAW else raw
        assert raw is not None
        results.append(
            asdict(r)
            | {
                "throughput": r.throughput,
                "ratio_to_raw": r.throughput / raw.throughput,
                "overhead_us_inv_throughput": 1e6 / r.throughput - 1e6 / raw.throughput,
                "overhead_us_p50": (r.p50_ms - raw.p50_ms) * 1000,
                "server_cpu_us_per_request": r.server_cpu_us_per_req,
                "client_cpu_us_per_request": r.client_cpu_us_per_req,
            }
        )
    return {"results": results, "skipped": skipped}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--duration", type=float, default=3.0, help="seconds per measurement")
    parser.add_argument("--json", type=Path, help="write results to this file")
    parser.add_argument("--peers", nargs="*", default=["kiln", "triton", "mlserver"],
                        help="servers to run (default: all)")  # fmt: skip
    args = parser.parse_args()
    console = Console(width=200)
    rows: list[Row] = []
    skipped: dict[str, str] = {}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        repo = work / "models"
        build_example_repository(repo, MODELS)
        starters: dict[str, Callable[[], ServerProcess]] = {
            # As written, like Triton's python models: no auto-completed dynamic_batching.
            "kiln": lambda: start_kiln(repo, work, args=("--disable-auto-complete-config",)),
            "triton": lambda: start_triton(repo, MODELS, work),
            "mlserver": lambda: start_mlserver(repo, MODELS, work),
        }
        for name in args.peers:
            venv = {"triton": "pytriton", "mlserver": "mlserver"}.get(name)
            reason = missing_reason(venv) if venv else None
            if reason is None:
                try:
                    server = starters[name]()
                    server.wait_ready(MODELS)
                except (RuntimeError, OSError) as exc:
                    reason = f"could not start: {exc}"
            if reason is not None:
                console.print(f"[bold red]skipping {name}[/]: {reason}")
                skipped[name] = reason
                continue
            try:
                rows.extend(measure_server(server, repo, args.duration, console.log))
            finally:
                server.close()
    cpus, host = os.cpu_count(), platform.node()
    console.print(table(rows, f"serving vs peers ({host}, {cpus} CPUs, {args.duration:g}s each)"))
    for name, reason in skipped.items():
        console.print(f"skipped {name}: {reason}")
    if args.json:
        args.json.write_text(json.dumps(to_json(rows, skipped), indent=2))


if __name__ == "__main__":
    main()
