"""PyTorch backend: the example ``torch_mlp`` (TorchScript) served by kiln, against the same
module run by torch in this process (the physical limit of a server that does not batch),
and the same weights as ONNX (``mlp``) on kiln's ONNX Runtime backend against raw
onnxruntime, in one run.

Both models are the example repository's (64 -> 256 -> 128 -> 10, batch 1, the weights of
:func:`kiln.examples.models.mlp_weights`), each with the config the example ships. Per
round: raw torch (``torch.jit.load`` + ``torch.inference_mode``, N Python threads calling
the module, torch's own intra-op threads as kiln sets them) and raw ORT, then ``kiln
serve`` driven over HTTP/binary and gRPC at concurrency 1 and 16 with ``loadgen.py``.
Before timing, one request per protocol is decoded and compared with raw torch's output.
Medians over rounds; "of raw" = kiln's throughput over its engine's in-process throughput,
"over raw µs" = 1e6/throughput - 1e6/raw throughput.

No peer row: the ``nvidia-pytriton`` wheel ships Triton's python backend only, not its
PyTorch (libtorch) backend, and MLServer has no TorchScript runtime. Usage::

    .venv/bin/python benchmarks/pytorch_backend.py [--rounds 2] [--duration 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import tempfile
import urllib.request
from dataclasses import asdict
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import torch
from loadgen import MODEL_INFER, Window, drive_grpc, drive_http
from peer_servers import ServerProcess, start_kiln
from python_backend import Key, Row, medians
from rich.console import Console
from rich.table import Table
from serving_baseline import percentiles, run_raw, run_threads
from serving_peers import binary_body, grpc_request
from tritonclient.grpc import service_pb2

from kiln.examples import build_example_repository

TORCH_MODEL, ONNX_MODEL = "torch_mlp", "mlp"
CONCURRENCY = (1, 16)
PROTOCOLS = ("HTTP/binary", "gRPC")
IMAGE = np.random.default_rng(0).standard_normal((1, 64), dtype=np.float32)
FEEDS = {TORCH_MODEL: {"INPUT__0": IMAGE}, ONNX_MODEL: {"INPUT": IMAGE}}
OUTPUTS = {TORCH_MODEL: "LOGITS__0", ONNX_MODEL: "LOGITS"}


def run_raw_torch(repo: Path, concurrency: int, duration: float) -> Row:
    """The TorchScript module called from ``concurrency`` threads of this process."""
    module = torch.jit.load(str(repo / TORCH_MODEL / "1" / "model.pt")).eval()
    image = torch.from_numpy(IMAGE)

    def call() -> object:
        with torch.inference_mode():
            return module(image)

    for _ in range(50):  # warm-up (and TorchScript's profiling runs)
        call()
    r = run_threads(call, concurrency, duration, "raw torch")
    return _raw_row(r, TORCH_MODEL)


def _raw_row(r: Any, model: str) -> Row:
    return Row(0, r.target, model, "in-process", r.concurrency, r.requests / r.seconds,
               r.p50_ms, r.p99_ms, r.server_cpu_s / max(r.requests, 1) * 1e6, 0.0)  # fmt: skip


def expected_logits(repo: Path) -> np.ndarray:
    module = torch.jit.load(str(repo / TORCH_MODEL / "1" / "model.pt")).eval()
    with torch.inference_mode():
        logits, _ = module(torch.from_numpy(IMAGE))
    return logits.numpy()


def verify(server: ServerProcess, protocol: str, model: str, want: np.ndarray) -> None:
    """One decoded request: kiln's logits must equal raw torch's (float32 rounding)."""
    inputs = FEEDS[model]
    if protocol == "gRPC":
        with grpc.insecure_channel(f"127.0.0.1:{server.grpc_port}") as channel:
            raw = channel.unary_unary(MODEL_INFER)(grpc_request(model, inputs), timeout=30)
        response = service_pb2.ModelInferResponse.FromString(raw)
        names = [o.name for o in response.outputs]
        got = np.frombuffer(response.raw_output_contents[names.index(OUTPUTS[model])], np.float32)
    else:
        body = json.dumps({
            "inputs": [{"name": n, "shape": list(a.shape), "datatype": "FP32",
                        "data": a.ravel().tolist()} for n, a in inputs.items()],
            "outputs": [{"name": OUTPUTS[model]}],
        }).encode()  # fmt: skip
        url = f"http://127.0.0.1:{server.http_port}/v2/models/{model}/infer"
        request = urllib.request.Request(url, body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=30) as r:
            got = np.asarray(json.loads(r.read())["outputs"][0]["data"], np.float32)
    if not np.allclose(got.reshape(want.shape), want, rtol=1e-4, atol=1e-5):
        raise RuntimeError(f"kiln {protocol} {model}: logits differ from raw torch's")


def drive(server: ServerProcess, protocol: str, model: str, c: int, duration: float) -> Window:
    warmup = min(1.0, duration / 5)
    inputs = FEEDS[model]
    if protocol == "gRPC":
        target = f"127.0.0.1:{server.grpc_port}"
        return asyncio.run(
            drive_grpc(target, grpc_request(model, inputs), c, server.pid, warmup, duration)
        )
    url = f"http://127.0.0.1:{server.http_port}/v2/models/{model}/infer"
    body, headers = binary_body(inputs)
    return asyncio.run(drive_http(url, body, headers, c, server.pid, warmup, duration))


def measure(repo: Path, work: Path, rnd: int, duration: float, log: Console) -> list[Row]:
    rows: list[Row] = []
    raw: dict[tuple[str, int], float] = {}  # this round's raw throughput per (model, c)
    for c in CONCURRENCY:
        for row in (run_raw_torch(repo, c, duration),
                    _raw_row(run_raw(repo, ONNX_MODEL, c, duration, FEEDS[ONNX_MODEL]),
                             ONNX_MODEL)):  # fmt: skip
            row.round = rnd
            raw[(row.model, c)] = row.throughput
            rows.append(row)
    want = expected_logits(repo)
    server = start_kiln(repo, work)
    try:
        server.wait_ready((TORCH_MODEL, ONNX_MODEL))
        for c in CONCURRENCY:
            for model in (TORCH_MODEL, ONNX_MODEL):
                for protocol in PROTOCOLS:
                    log.log(f"round {rnd}: kiln {model} {protocol} c={c}")
                    if c == CONCURRENCY[0]:
                        verify(server, protocol, model, want)
                    w = drive(server, protocol, model, c, duration)
                    n = len(w.latencies)
                    p50, p99 = percentiles(w.latencies)
                    over = 1e6 * w.seconds / n - 1e6 / raw[(model, c)]
                    rows.append(Row(rnd, "kiln", model, protocol, c, n / w.seconds, p50, p99,
                                    w.server_cpu_s / max(n, 1) * 1e6, over))  # fmt: skip
    finally:
        server.close()
    return rows


def raw_of(med: dict[Key, dict[str, float]], model: str, c: int) -> dict[str, float]:
    target = "raw torch" if model == TORCH_MODEL else "raw ORT"
    return med[(target, model, "in-process", c)]


def table(med: dict[Key, dict[str, float]], title: str) -> Table:
    out = Table(title=title)
    for col in ("conc", "target", "model", "protocol", "req/s", "p50 ms", "p99 ms", "of raw",
                "over raw µs", "CPU µs/req"):  # fmt: skip
        out.add_column(col, justify="right")
    for key in sorted(med, key=lambda k: (k[3], k[1] != TORCH_MODEL, k[0] != "kiln", k[2])):
        target, model, protocol, c = key
        m = med[key]
        raw = raw_of(med, model, c)
        served = target == "kiln"
        ratio = f"{m['throughput'] / raw['throughput']:.3f}" if served else ""
        over = f"{m['over_raw_us']:,.0f}" if served else ""
        out.add_row(str(c), target, model, protocol, f"{m['throughput']:,.0f}",
                    f"{m['p50_ms']:.3f}", f"{m['p99_ms']:.3f}", ratio, over,
                    f"{m['server_cpu_us']:,.0f}")  # fmt: skip
    return out


def summary(med: dict[Key, dict[str, float]]) -> list[str]:
    """Per cell: the PyTorch backend's cost over raw torch against the ONNX Runtime
    backend's over raw ORT (the same serving path, another engine)."""
    lines = []
    for protocol in PROTOCOLS:
        for c in CONCURRENCY:
            over = {m: med[("kiln", m, protocol, c)]["over_raw_us"] for m in FEEDS}
            lines.append(
                f"{protocol} c={c}: kiln pytorch {over[TORCH_MODEL]:,.0f} µs over raw torch, "
                f"kiln onnxruntime {over[ONNX_MODEL]:,.0f} µs over raw ORT"
            )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--duration", type=float, default=3.0, help="seconds per measurement")
    parser.add_argument("--json", type=Path, help="write results to this file")
    args = parser.parse_args()
    console = Console(width=160)
    load_before = os.getloadavg()
    rows: list[Row] = []
    with tempfile.TemporaryDirectory() as tmp:
        repo = Path(tmp) / "models"
        build_example_repository(repo, [TORCH_MODEL, ONNX_MODEL])
        for rnd in range(1, args.rounds + 1):
            work = Path(tmp) / f"round{rnd}"
            work.mkdir()
            rows.extend(measure(repo, work, rnd, args.duration, console))
    load_after = os.getloadavg()
    med = medians(rows)
    title = (
        f"PyTorch backend ({os.cpu_count()} CPUs, torch {torch.__version__}, "
        f"{args.rounds} rounds x {args.duration:g}s, medians)"
    )
    console.print(table(med, title))
    console.print(f"load average before {load_before}, after {load_after}")
    for line in summary(med):
        console.print(line)
    if args.json:
        payload = {
            "rows": [asdict(r) for r in rows],
            "medians": [{"key": list(k), **v} for k, v in med.items()],
            "summary": summary(med),
            "loadavg": {"before": load_before, "after": load_after},
        }
        args.json.write_text(json.dumps(payload, indent=2))


if __name__ == "__main__":
    main()
