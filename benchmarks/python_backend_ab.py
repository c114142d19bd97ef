"""A/B of kiln source trees on the Python-backend benchmark's models, interleaved in pairs.

Each pair re-measures raw onnxruntime, then starts ``kiln serve`` once per tree (its
``src`` folder first on ``PYTHONPATH``, which the Python workers inherit) and drives
``identity_python`` with ``loadgen.py``, as ``python_backend.py`` does. Trees are usually
git worktrees of two commits::

    git worktree add /tmp/before HEAD~1
    .venv/bin/python benchmarks/python_backend_ab.py --trees /tmp/before/src,src --pairs 3

Options shape the model: ``--max-batch-size 0`` (no batch dimension, so the scheduler
without batching), ``--dynamic-batching``, ``--compute-us N`` (the identity behind an N µs
busy loop), ``--sequence`` (``sequence_batching { }``: over gRPC, each client sends
requests that are each a sequence of their own, START and END, its own sequence id),
``--bls`` (the Python model answers each request with a BLS call to ``identity_onnx``;
``--bls-callee python``: to a second Python identity, ``callee_python``).
Prints, per tree and cell, µs over raw (1/throughput), server CPU µs per request, p50 and
p99 ms, one figure per pair.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import tempfile
from pathlib import Path

import python_backend as pb
from loadgen import Window, drive_grpc
from peer_servers import ServerProcess, start_kiln
from serving_baseline import percentiles, run_raw
from tritonclient.grpc import service_pb2

COMPUTE = """        import time

        until = time.perf_counter() + {seconds!r}
        while time.perf_counter() < until:
            pass
"""


def build(
    repo: Path, max_batch_size: int, batching: bool, compute_us: int, sequence: bool,
    bls: bool = False, bls_callee: str = "onnx",
) -> None:  # fmt: skip
    pb.build_repository(repo, batching)
    if bls:
        callee = pb.ONNX_MODEL
        if bls_callee == "python":  # a copy of the Python identity under another name
            callee = "callee_python"
            shutil.copytree(repo / pb.PY_MODEL, repo / callee)
            config = repo / callee / "config.pbtxt"
            config.write_text(config.read_text().replace(pb.PY_MODEL, callee))
        # Triton's BLS model of python_backend.py --bls, calling ``callee`` instead
        source = (pb.PEERS / "bls_model.py").read_text()
        model = repo / pb.PY_MODEL / "1" / "model.py"
        model.write_text(source.replace(f'model_name="{pb.PY_MODEL}"', f'model_name="{callee}"'))
    if sequence:
        config = repo / pb.PY_MODEL / "config.pbtxt"
        config.write_text(config.read_text() + "sequence_batching { }\n")
    if max_batch_size != 8:
        config = repo / pb.PY_MODEL / "config.pbtxt"
        text = config.read_text().replace("max_batch_size: 8", f"max_batch_size: {max_batch_size}")
        if max_batch_size == 0:  # the batch dimension becomes part of the shape
            text = text.replace(f"dims: [ {pb.WIDTH} ]", f"dims: [ 1, {pb.WIDTH} ]")
        config.write_text(text)
    if compute_us:
        model = repo / pb.PY_MODEL / "1" / "model.py"
        source = model.read_text()
        anchor = "        responses = []\n"
        model.write_text(source.replace(anchor, COMPUTE.format(seconds=compute_us / 1e6) + anchor))


def drive_sequences(server: ServerProcess, c: int, duration: float) -> Window:
    """gRPC load in which every request is a sequence of its own (START and END), each
    client with its own sequence id, so the sequence batcher runs every one."""
    requests = []
    for i in range(c):
        request = service_pb2.ModelInferRequest.FromString(pb.grpc_request(pb.PY_MODEL, pb.INPUTS))
        request.parameters["sequence_id"].int64_param = 1000 + i
        request.parameters["sequence_start"].bool_param = True
        request.parameters["sequence_end"].bool_param = True
        requests.append(request.SerializeToString())
    target = f"127.0.0.1:{server.grpc_port}"
    warmup = min(1.0, duration / 5)
    return asyncio.run(drive_grpc(target, requests, c, server.pid, warmup, duration))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trees", required=True, help="comma-separated kiln src folders")
    parser.add_argument("--pairs", type=int, default=2)
    parser.add_argument("--concurrency", default="1,16")
    parser.add_argument("--protocols", default="HTTP/binary", help="HTTP/binary and/or gRPC")
    parser.add_argument("--duration", type=float, default=3.0)
    parser.add_argument("--max-batch-size", type=int, default=8)
    parser.add_argument("--dynamic-batching", action="store_true")
    parser.add_argument("--compute-us", type=int, default=0)
    parser.add_argument("--sequence", action="store_true")
    parser.add_argument("--bls", action="store_true")
    parser.add_argument("--bls-callee", choices=("onnx", "python"), default="onnx")
    args = parser.parse_args()
    if args.sequence and args.protocols != "gRPC":
        parser.error("--sequence drives gRPC only: add --protocols gRPC")
    trees = [str(Path(t).resolve()) for t in args.trees.split(",")]
    concurrency = [int(c) for c in args.concurrency.split(",")]
    results: dict[str, list[str]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        repo = Path(tmp) / "models"
        build(
            repo, args.max_batch_size, args.dynamic_batching, args.compute_us, args.sequence,
            args.bls, args.bls_callee,
        )  # fmt: skip
        for pair in range(args.pairs):
            raw = {}
            for c in concurrency:
                r = run_raw(repo, pb.ONNX_MODEL, c, args.duration, pb.INPUTS)
                raw[c] = r.requests / r.seconds
            for i, tree in enumerate(trees):
                work = Path(tmp) / f"pair{pair}-tree{i}"
                work.mkdir()
                os.environ["PYTHONPATH"] = tree
                server = start_kiln(repo, work)
                try:
                    server.wait_ready(tuple(sorted(p.name for p in repo.iterdir())))
                    for c in concurrency:
                        for protocol in args.protocols.split(","):
                            if args.sequence:
                                w = drive_sequences(server, c, args.duration)
                            else:
                                pb.verify(server, protocol, pb.PY_MODEL)
                                w = pb.drive(server, protocol, pb.PY_MODEL, c, args.duration)
                            n = len(w.latencies)
                            over = 1e6 * w.seconds / n - 1e6 / raw[c]
                            p50, p99 = percentiles(w.latencies)
                            cell = f"{protocol} c={c}  {tree}"
                            figure = (
                                f"{over:.0f} ({w.server_cpu_s / n * 1e6:.0f}) {p50:.2f}/{p99:.2f}"
                            )
                            results.setdefault(cell, []).append(figure)
                            print(f"pair {pair}: {cell}: {figure}", flush=True)
                finally:
                    server.close()
    print("\nover raw µs (server CPU µs/req) p50/p99 ms, one per pair:")
    for cell, figures in results.items():
        print(f"{cell}: " + ", ".join(figures))


if __name__ == "__main__":
    main()
