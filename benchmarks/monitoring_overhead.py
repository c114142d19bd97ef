"""What monitoring costs: the MLP at concurrency 32 with metrics + history + alerts on vs off.

"on" is kiln's default (metrics port with GPU/host samplers, SQLite history every second,
default alert rules evaluated every second — faster than the defaults, to make the cost
visible); "off" is ``--no-allow-metrics --no-history --no-default-alert-rules``. The two
alternate several times in one run (on, off, on, off, ...) because this VM drifts; the
result is the median of each. Usage::

    .venv/bin/python benchmarks/monitoring_overhead.py [--rounds 3] [--duration 5]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from loadgen import drive_http, start_kiln
from serving_baseline import batch1_inputs, json_body

from kiln.examples import build_example_repository

ON = ["--history-interval-secs", "1", "--alert-eval-interval-secs", "1"]
OFF = ["--no-allow-metrics", "--no-history", "--no-default-alert-rules"]


def start(repo: Path, work: Path, extra: list[str]) -> tuple[subprocess.Popen[bytes], int]:
    history = ["--history-path", str(work / f"history-{time.monotonic_ns()}.db")]
    return start_kiln(repo, "mlp", [*history, *extra])


def measure(repo: Path, work: Path, extra: list[str], duration: float) -> float:
    proc, port = start(repo, work, extra)
    try:
        url = f"http://127.0.0.1:{port}/v2/models/mlp/infer"
        body = json_body(batch1_inputs("mlp"))
        headers = {"Content-Type": "application/json", "Accept-Encoding": "identity"}
        window = asyncio.run(drive_http(url, body, headers, 32, proc.pid, 1.0, duration))
        return len(window.latencies) / window.seconds
    finally:
        proc.terminate()
        proc.wait(30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--duration", type=float, default=5.0)
    args = parser.parse_args()
    on: list[float] = []
    off: list[float] = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        repo = work / "models"
        build_example_repository(repo, ["mlp"])
        for i in range(args.rounds):
            on.append(measure(repo, work, ON, args.duration))
            off.append(measure(repo, work, OFF, args.duration))
            print(f"round {i + 1}: on {on[-1]:,.0f} req/s, off {off[-1]:,.0f} req/s")
    med_on, med_off = statistics.median(on), statistics.median(off)
    cost = 1 - med_on / med_off
    print(json.dumps({"on": on, "off": off, "median_on": med_on, "median_off": med_off,
                      "cost_pct": round(100 * cost, 2)}))  # fmt: skip
    print(f"monitoring cost: {100 * cost:.1f} % of throughput (median of {args.rounds} rounds)")


if __name__ == "__main__":
    main()
