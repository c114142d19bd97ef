"""What a response-cache hit costs and saves: one model, the same request over and over, with
no cache (the model runs every time), the local cache and the redis cache (a
``redis-server`` started here on loopback), against raw onnxruntime in-process (what a
miss costs the engine). Closed loop over HTTP (JSON, kiln bench's transport); the
configurations alternate in rounds because this VM drifts; medians are reported. Usage::

    .venv/bin/python benchmarks/response_cache.py [--model cnn|heavy] [--concurrency 1,8]
        [--rounds 2] [--duration 4]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import numpy as np
import redis
from loadgen import drive_http, start_kiln
from serving_baseline import cpu_seconds, free_port, json_body, run_raw

from kiln.config.loader import parse_config_text
from kiln.examples import build_example_repository

ENABLE = "response_cache { enable: true }\n"


HEAVY_CONFIG = """name: "heavy"
platform: "onnxruntime_onnx"
max_batch_size: 8
input [ { name: "INPUT" data_type: TYPE_FP32 dims: [ 1024 ] } ]
output [ { name: "OUTPUT" data_type: TYPE_FP32 dims: [ 1024 ] } ]
"""


def build_heavy(repo: Path, layers: int = 12) -> None:
    """A model worth caching: ``layers`` dense 1024x1024 layers with ReLU (about a
    millisecond of one core per request here)."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    nodes, weights, name = [], [], "INPUT"
    for i in range(layers):
        w = (rng.standard_normal((1024, 1024)) / 32).astype(np.float32)
        weights.append(numpy_helper.from_array(w, f"W{i}"))
        out = "OUTPUT" if i == layers - 1 else f"h{i}"
        nodes.append(helper.make_node("MatMul", [name, f"W{i}"], [f"m{i}"]))
        nodes.append(helper.make_node("Relu", [f"m{i}"], [out]))
        name = out
    graph = helper.make_graph(
        nodes, "heavy",
        [helper.make_tensor_value_info("INPUT", TensorProto.FLOAT, ["N", 1024])],
        [helper.make_tensor_value_info("OUTPUT", TensorProto.FLOAT, ["N", 1024])],
        initializer=weights,
    )  # fmt: skip
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    (repo / "heavy" / "1").mkdir(parents=True)
    onnx.save(model, repo / "heavy" / "1" / "model.onnx")
    (repo / "heavy" / "config.pbtxt").write_text(HEAVY_CONFIG)


def inputs(repo: Path, model: str) -> dict[str, np.ndarray]:
    config = parse_config_text((repo / model / "config.pbtxt").read_text())
    rng = np.random.default_rng(0)
    lead = [1] if config.max_batch_size > 0 else []
    return {i.name: rng.standard_normal([*lead, *i.dims]).astype(np.float32) for i in config.input}


def measure(
    repo: Path, model: str, extra: list[str], concurrency: int, duration: float,
    redis_pid: int | None,
) -> dict[str, float]:  # fmt: skip
    proc, port = start_kiln(repo, model, ["--no-history", "--no-default-alert-rules", *extra])
    try:
        body = json_body(inputs(repo, model))
        url = f"http://127.0.0.1:{port}/v2/models/{model}/infer"
        headers = {"Content-Type": "application/json"}
        r0 = cpu_seconds(redis_pid) if redis_pid else 0.0
        window = asyncio.run(drive_http(url, body, headers, concurrency, proc.pid, 1.0, duration))
        r1 = cpu_seconds(redis_pid) if redis_pid else 0.0
        n = len(window.latencies)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v2/models/{model}/stats") as r:
            stats = json.load(r)["model_stats"][0]
        return {
            "rps": n / window.seconds,
            "p50_us": float(np.percentile(window.latencies, 50) * 1e6),
            "server_cpu_us": window.server_cpu_s / n * 1e6,
            # redis-server's CPU over the whole run (warm-up included), per measured request
            "redis_cpu_us": (r1 - r0) / n * 1e6 if redis_pid else 0.0,
            "hits": stats["inference_stats"]["cache_hit"]["count"],
            "executions": stats["execution_count"],
        }
    finally:
        proc.terminate()
        proc.wait(30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="cnn", help="an example model, or 'heavy'")
    parser.add_argument("--concurrency", default="1,8")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--duration", type=float, default=4.0)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    server_bin = shutil.which("redis-server")
    if server_bin is None:
        sys.exit("redis-server is not installed (scripts/system-deps.sh)")
    levels = [int(c) for c in args.concurrency.split(",")]
    results: dict[str, list[dict[str, float]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        repo = work / "models"
        if args.model == "heavy":
            build_heavy(repo)
        else:
            build_example_repository(repo, [args.model])
        config = repo / args.model / "config.pbtxt"
        config.write_text(config.read_text() + ENABLE)
        rport = free_port()
        redis_proc = subprocess.Popen(
            [server_bin, "--port", str(rport), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", tmp],
            stdout=subprocess.DEVNULL,
        )  # fmt: skip
        try:
            client = redis.Redis(port=rport)
            for _ in range(100):
                try:
                    client.ping()
                    break
                except redis.ConnectionError:
                    time.sleep(0.05)
            setups = {
                "no cache": ([], None),
                "local": (["--cache-config", "local,size=67108864"], None),
                "redis": (["--cache-config", "redis,host=127.0.0.1", "--cache-config",
                           f"redis,port={rport}", "--cache-config", "redis,pool_size=8"],
                          redis_proc.pid),
            }  # fmt: skip
            for c in levels:
                raw = run_raw(repo, args.model, c, args.duration, inputs(repo, args.model))
                results.setdefault(f"raw ORT c={c}", []).append(
                    {"rps": raw.throughput, "p50_us": raw.p50_ms * 1000}
                )
                for r in range(args.rounds):
                    for name, (extra, pid) in setups.items():
                        got = measure(repo, args.model, extra, c, args.duration, pid)
                        results.setdefault(f"{name} c={c}", []).append(got)
                        print(f"round {r + 1} c={c} {name}: {got}", flush=True)
        finally:
            redis_proc.terminate()
            redis_proc.wait(10)
    medians = {
        key: {k: statistics.median(run[k] for run in runs) for k in runs[0]}
        for key, runs in results.items()
    }
    print(f"\n{args.model}, medians of {args.rounds} rounds")
    print(f"{'setup':<16}{'req/s':>10}{'p50 µs':>10}{'server CPU µs/req':>20}"
          f"{'redis CPU µs/req':>18}{'vs no cache':>13}")  # fmt: skip
    for c in levels:
        base = medians[f"no cache c={c}"]["rps"]
        for name in ("raw ORT", "no cache", "local", "redis"):
            m = medians[f"{name} c={c}"]
            print(f"{name + f' c={c}':<16}{m['rps']:>10,.0f}{m['p50_us']:>10,.0f}"
                  f"{m.get('server_cpu_us', 0):>20,.0f}{m.get('redis_cpu_us', 0):>18,.0f}"
                  f"{m['rps'] / base:>12.2f}x")  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps({"results": results, "medians": medians}, indent=1))


if __name__ == "__main__":
    main()
