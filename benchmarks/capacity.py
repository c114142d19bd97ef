"""How many kiln replicas for a target load, from one replica's `kiln bench` sweep.

    kiln bench MODEL -u REPLICA:8000 --concurrency 1:64:2 --json r.json
    python benchmarks/capacity.py r.json --target-qps 2000 --p99-ms 50

The model (docs/scaling.md): a replica's usable throughput is the best closed-loop level
whose p99 meets the target and that had no errors; run replicas at `--utilization` of it
(headroom for bursts and for the HPA to react), and add `--spare` replicas so one can be
drained or lost (PodDisruptionBudget, rolling updates) without breaking the SLO.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True, slots=True)
class Plan:
    concurrency: int  # the per-replica operating point (requests in flight)
    replica_qps: float  # inferences/s one replica sustains there
    p99_ms: float
    replicas: int
    at_sweep_end: bool  # the best level was the last measured: sweep further


def plan(
    report: dict[str, Any],
    target_qps: float,
    p99_ms: float,
    utilization: float = 0.8,
    spare: int = 1,
) -> Plan | None:
    """None when no measured level meets the p99 target (more replicas cannot fix that)."""
    if not 0 < utilization <= 1:
        raise ValueError(f"utilization must be in (0, 1], got {utilization}")
    levels = [lv for lv in report["levels"] if lv["concurrency"] is not None]
    if not levels:
        raise ValueError("the report has no concurrency levels (run kiln bench with --concurrency)")
    ok = [lv for lv in levels if lv["errors"] == 0 and lv["latency_us"]["p99"] <= p99_ms * 1000]
    if not ok:
        return None
    best = max(ok, key=lambda lv: lv["throughput_infer_per_sec"])
    qps = float(best["throughput_infer_per_sec"])
    replicas = max(1, math.ceil(target_qps / (qps * utilization))) + spare
    last = max(lv["concurrency"] for lv in levels)
    return Plan(
        best["concurrency"],
        qps,
        best["latency_us"]["p99"] / 1000,
        replicas,
        best["concurrency"] == last,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("report", type=Path, help="kiln bench --json report of ONE replica")
    parser.add_argument("--target-qps", type=float, required=True, help="inferences/s to serve")
    parser.add_argument("--p99-ms", type=float, required=True, help="p99 latency objective")
    parser.add_argument(
        "--utilization",
        type=float,
        default=0.8,
        help="fraction of a replica's capacity to plan for",
    )
    parser.add_argument("--spare", type=int, default=1, help="replicas beyond the need (N+spare)")
    args = parser.parse_args(argv)
    report = json.loads(args.report.read_text())
    result = plan(report, args.target_qps, args.p99_ms, args.utilization, args.spare)
    if result is None:
        floor = min(lv["latency_us"]["p99"] for lv in report["levels"]) / 1000
        print(f"no level meets p99 <= {args.p99_ms} ms (lowest measured p99: {floor:.2f} ms): "
              "one replica's latency floor is above the target; make the model faster "
              "(batching, instances, GPU) — more replicas do not lower it")  # fmt: skip
        return 1
    print(f"{report['model']}: one replica sustains {result.replica_qps:,.0f} infer/s at p99 "
          f"{result.p99_ms:.2f} ms (concurrency {result.concurrency})")  # fmt: skip
    print(f"replicas for {args.target_qps:,.0f} infer/s at {args.utilization:.0%} utilization "
          f"+ {args.spare} spare: {result.replicas}")  # fmt: skip
    print(f"per-replica concurrency to route/limit at: {result.concurrency}")
    if result.at_sweep_end:
        print("note: the best level is the highest concurrency measured; sweep further "
              "(--concurrency 1:64:2) — a replica may sustain more", file=sys.stderr)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
