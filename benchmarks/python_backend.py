"""Python-backend overhead: an identity model in kiln's Python backend, in kiln's ONNX Runtime
backend, and in Triton's python backend, with raw onnxruntime as the floor, in one run.

Models (FP32 ``INPUT0`` [1, 1024] -> ``OUTPUT0``, max_batch_size 8, one CPU instance, no
scheduling block. The Python model then runs every request as its own ``execute`` on both
servers (neither adds a batcher to a Python model); kiln's ONNX model gets the dynamic
batcher Triton's auto-complete adds. ``--dynamic-batching`` writes ``dynamic_batching { }``
into both models' configs instead, so both servers batch what is queued):

- ``identity_onnx`` — an ONNX ``Identity`` node on kiln (``platform: "onnxruntime_onnx"``);
- ``identity_python`` — ``peers/identity_model.py`` (``return`` the input) on kiln and, the
  same file and config, on the ``tritonserver`` of the nvidia-pytriton wheel;
- raw — ``InferenceSession.run`` of the same ONNX file from threads in this process,
  re-measured before each server (the VM drifts).

Each round starts kiln then Triton and drives each model over HTTP/binary and gRPC at
concurrency 1 and 16 with ``loadgen.py``; medians over rounds are reported. Usage::

    .venv/bin/python benchmarks/python_backend.py [--rounds 2] [--duration 3] [--json out.json]
        [--dynamic-batching] [--bls]

``--bls`` adds ``bls_python`` (``peers/bls_model.py``) on both servers: each request answered
with a BLS call to ``identity_python``; its µs over raw minus the identity's is what a BLS
call costs on each server.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import tempfile
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path

import grpc
import numpy as np
import onnx
from loadgen import MODEL_INFER, Window, drive_grpc, drive_http
from onnx import TensorProto, helper
from peer_servers import PEERS, ServerProcess, missing_reason, start_kiln, start_triton
from rich.console import Console
from rich.table import Table
from serving_baseline import percentiles, run_raw
from serving_peers import binary_body, grpc_request
from tritonclient.grpc import service_pb2

WIDTH = 1024
CONCURRENCY = (1, 16)
PROTOCOLS = ("HTTP/binary", "gRPC")
ONNX_MODEL, PY_MODEL = "identity_onnx", "identity_python"
BLS_MODEL = "bls_python"  # --bls: answers each request with a BLS call to PY_MODEL
INPUTS = {"INPUT0": np.random.default_rng(0).standard_normal((1, WIDTH), dtype=np.float32)}


def _config(name: str, engine: str, batching: bool = False) -> str:
    batcher = "dynamic_batching { }\n" if batching else ""
    return (
        batcher
        + f"""\
name: "{name}"
{engine}
max_batch_size: 8
input [ {{ name: "INPUT0" data_type: TYPE_FP32 dims: [ {WIDTH} ] }} ]
output [ {{ name: "OUTPUT0" data_type: TYPE_FP32 dims: [ {WIDTH} ] }} ]
instance_group [ {{ count: 1 kind: KIND_CPU }} ]
"""
    )


def build_repository(repo: Path, batching: bool = False, bls: bool = False) -> None:
    (repo / ONNX_MODEL / "1").mkdir(parents=True)
    (repo / PY_MODEL / "1").mkdir(parents=True)
    spec = ["batch", WIDTH]
    graph = helper.make_graph(
        [helper.make_node("Identity", ["INPUT0"], ["OUTPUT0"])],
        ONNX_MODEL,
        [helper.make_tensor_value_info("INPUT0", TensorProto.FLOAT, spec)],
        [helper.make_tensor_value_info("OUTPUT0", TensorProto.FLOAT, spec)],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save_model(model, repo / ONNX_MODEL / "1" / "model.onnx")
    (repo / ONNX_MODEL / "config.pbtxt").write_text(
        _config(ONNX_MODEL, 'platform: "onnxruntime_onnx"', batching)
    )
    (repo / PY_MODEL / "config.pbtxt").write_text(_config(PY_MODEL, 'backend: "python"', batching))
    shutil.copy(PEERS / "identity_model.py", repo / PY_MODEL / "1" / "model.py")
    if bls:
        (repo / BLS_MODEL / "1").mkdir(parents=True)
        (repo / BLS_MODEL / "config.pbtxt").write_text(
            _config(BLS_MODEL, 'backend: "python"', batching)
        )
        shutil.copy(PEERS / "bls_model.py", repo / BLS_MODEL / "1" / "model.py")


@dataclass(slots=True)
class Row:
    round: int
    server: str  # "raw ORT", "kiln", "Triton"
    model: str
    protocol: str
    concurrency: int
    throughput: float
    p50_ms: float
    p99_ms: float
    server_cpu_us: float  # per request, the server's whole process tree
    over_raw_us: float  # 1e6/throughput - 1e6/raw throughput (raw measured just before)


def verify(server: ServerProcess, protocol: str, model: str) -> None:
    """One decoded request: the identity must hand back exactly the input bytes."""
    want = INPUTS["INPUT0"].tobytes()
    if protocol == "gRPC":
        with grpc.insecure_channel(f"127.0.0.1:{server.grpc_port}") as channel:
            raw = channel.unary_unary(MODEL_INFER)(grpc_request(model, INPUTS), timeout=30)
        got = b"".join(service_pb2.ModelInferResponse.FromString(raw).raw_output_contents)
    else:
        body, headers = binary_body(INPUTS)
        url = f"http://127.0.0.1:{server.http_port}/v2/models/{model}/infer"
        with urllib.request.urlopen(urllib.request.Request(url, body, headers), timeout=30) as r:
            got = r.read()[int(r.headers["Inference-Header-Content-Length"]) :]
    if got != want:
        raise RuntimeError(f"{server.name} {protocol} {model}: output differs from the input")


def drive(server: ServerProcess, protocol: str, model: str, c: int, duration: float) -> Window:
    warmup = min(1.0, duration / 5)
    if protocol == "gRPC":
        target = f"127.0.0.1:{server.grpc_port}"
        request = grpc_request(model, INPUTS)
        return asyncio.run(drive_grpc(target, request, c, server.pid, warmup, duration))
    url = f"http://127.0.0.1:{server.http_port}/v2/models/{model}/infer"
    body, headers = binary_body(INPUTS)
    return asyncio.run(drive_http(url, body, headers, c, server.pid, warmup, duration))


def measure(
    server: ServerProcess, models: tuple[str, ...], repo: Path, rnd: int, duration: float,
    log: Console,
) -> list[Row]:  # fmt: skip
    rows: list[Row] = []
    for c in CONCURRENCY:
        r = run_raw(repo, ONNX_MODEL, c, duration, INPUTS)
        raw_thr = r.requests / r.seconds
        cpu = r.server_cpu_s / max(r.requests, 1) * 1e6
        rows.append(Row(rnd, "raw ORT", ONNX_MODEL, "in-process", c, raw_thr, r.p50_ms,
                        r.p99_ms, cpu, 0.0))  # fmt: skip
        for model in models:
            for protocol in PROTOCOLS:
                log.log(f"round {rnd}: {server.name} {model} {protocol} c={c}")
                if c == CONCURRENCY[0]:
                    verify(server, protocol, model)
                w = drive(server, protocol, model, c, duration)
                n = len(w.latencies)
                p50, p99 = percentiles(w.latencies)
                thr = n / w.seconds
                cpu = w.server_cpu_s / max(n, 1) * 1e6
                over = 1e6 / thr - 1e6 / raw_thr
                rows.append(Row(rnd, server.name, model, protocol, c, thr, p50, p99, cpu, over))
    return rows


Key = tuple[str, str, str, int]


def medians(rows: list[Row]) -> dict[Key, dict[str, float]]:
    """Median over rounds of every figure of one (server, model, protocol, concurrency)."""
    groups: dict[Key, list[Row]] = {}
    for r in rows:
        key = (r.server, r.model, r.protocol if r.server != "raw ORT" else "in-process",
               r.concurrency)  # fmt: skip
        groups.setdefault(key, []).append(r)
    fields = ("throughput", "p50_ms", "p99_ms", "server_cpu_us", "over_raw_us")
    return {
        key: {f: statistics.median(getattr(r, f) for r in group) for f in fields}
        for key, group in groups.items()
    }


def bls_lines(med: dict[Key, dict[str, float]]) -> list[str]:
    """``--bls``: what the BLS call adds to the identity on each server (bls_python's µs
    over raw minus identity_python's), kiln against Triton."""
    lines = []
    for protocol in PROTOCOLS:
        for c in CONCURRENCY:
            cost = {}
            for server in ("kiln", "Triton"):
                b = med.get((server, BLS_MODEL, protocol, c))
                i = med.get((server, PY_MODEL, protocol, c))
                if b is not None and i is not None:
                    cost[server] = b["over_raw_us"] - i["over_raw_us"]
            if cost:
                lines.append(f"{protocol} c={c}: a BLS call adds " + ", ".join(
                    f"{server} {us:+,.0f} µs" for server, us in cost.items()))  # fmt: skip
    return lines


def verdicts(med: dict[Key, dict[str, float]]) -> list[str]:
    """kiln's Python backend against Triton's, per protocol and concurrency."""
    lines = []
    for protocol in PROTOCOLS:
        for c in CONCURRENCY:
            k = med.get(("kiln", PY_MODEL, protocol, c))
            t = med.get(("Triton", PY_MODEL, protocol, c))
            o = med.get(("kiln", ONNX_MODEL, protocol, c))
            if k is None or t is None:
                continue
            ok = k["over_raw_us"] <= t["over_raw_us"]
            backend_cost = f"{k['over_raw_us'] - o['over_raw_us']:+,.0f}" if o else "?"
            lines.append(
                f"{protocol} c={c}: kiln python {k['over_raw_us']:,.0f} µs over raw "
                f"({k['server_cpu_us']:,.0f} CPU µs/req) vs Triton python "
                f"{t['over_raw_us']:,.0f} µs ({t['server_cpu_us']:,.0f}); kiln python vs kiln "
                f"ORT {backend_cost} µs -> {'PASS' if ok else 'MISS'}"
            )
    return lines


def table(med: dict[Key, dict[str, float]], title: str) -> Table:
    out = Table(title=title)
    for col in ("conc", "server", "model", "protocol", "req/s", "p50 ms", "p99 ms",
                "over raw µs (1/thr)", "server CPU µs/req"):  # fmt: skip
        out.add_column(col, justify="right")
    for key in sorted(med, key=lambda k: (k[3], k[0] != "raw ORT", k[0], k[1], k[2])):
        server, model, protocol, c = key
        m = med[key]
        out.add_row(str(c), server, model, protocol, f"{m['throughput']:,.0f}",
                    f"{m['p50_ms']:.3f}", f"{m['p99_ms']:.3f}",
                    f"{m['over_raw_us']:,.0f}" if server != "raw ORT" else "",
                    f"{m['server_cpu_us']:,.0f}")  # fmt: skip
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=2, help="kiln+Triton passes (median)")
    parser.add_argument("--duration", type=float, default=3.0, help="seconds per measurement")
    parser.add_argument("--json", type=Path, help="write results to this file")
    parser.add_argument(
        "--dynamic-batching", action="store_true", help="dynamic_batching { } in both configs"
    )
    parser.add_argument(
        "--bls", action="store_true",
        help=f"also {BLS_MODEL}: a BLS call to {PY_MODEL} per request, on both servers",
    )  # fmt: skip
    args = parser.parse_args()
    console = Console(width=160)
    load_before = os.getloadavg()
    rows: list[Row] = []
    skipped = missing_reason("pytriton")
    with tempfile.TemporaryDirectory() as tmp:
        repo = Path(tmp) / "models"
        build_repository(repo, args.dynamic_batching, args.bls)
        python_models = (PY_MODEL, BLS_MODEL) if args.bls else (PY_MODEL,)
        for rnd in range(1, args.rounds + 1):
            work = Path(tmp) / f"round{rnd}"
            work.mkdir()
            runs = [("kiln", (ONNX_MODEL, *python_models))]
            if skipped is None:
                runs.append(("Triton", python_models))
            for name, models in runs:
                if name == "kiln":
                    server = start_kiln(repo, work)
                else:
                    server = start_triton(
                        repo, models, work, model_file="identity_model.py",
                        model_files={BLS_MODEL: "bls_model.py"},
                    )  # fmt: skip
                try:
                    server.wait_ready(models)
                    rows.extend(measure(server, models, repo, rnd, args.duration, console))
                finally:
                    server.close()
    load_after = os.getloadavg()
    med = medians(rows)
    mode = "dynamic_batching" if args.dynamic_batching else "no scheduling block"
    title = f"Python-backend overhead, {mode} ({os.cpu_count()} CPUs, {args.rounds} rounds x "
    console.print(table(med, title + f"{args.duration:g}s, medians)"))
    console.print(f"load average before {load_before}, after {load_after}")
    if skipped:
        console.print(f"[bold red]Triton skipped[/]: {skipped}")
    for line in verdicts(med):
        console.print(line)
    for line in bls_lines(med):
        console.print(line)
    if args.json:
        payload = {
            "rows": [asdict(r) for r in rows],
            "medians": [{"key": list(k), **v} for k, v in med.items()],
            "verdicts": verdicts(med),
            "bls": bls_lines(med),
            "loadavg": {"before": load_before, "after": load_after},
            "skipped_triton": skipped,
            "dynamic_batching": args.dynamic_batching,
        }
        args.json.write_text(json.dumps(payload, indent=2))


if __name__ == "__main__":
    main()
