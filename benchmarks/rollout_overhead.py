"""What a rollout costs the caller: the MLP's request latency with no policy, a 50/50 split
over two versions, and the split plus a shadow copy of every request to a third.

One ``kiln serve`` (mlp versions 1, 2, 3: the same ONNX file) serves every mode; the
policy is replaced through the repository API between windows, and the modes alternate
(A, B, C, A, B, C, ...) because this VM drifts. Concurrency 1 (one request at a time) so
the figure is a caller's latency, plus concurrency 8 for throughput. Result: the median of
each mode's per-window p50 / p99. Usage::

    .venv/bin/python benchmarks/rollout_overhead.py [--rounds 3] [--duration 4]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shutil
import statistics
import tempfile
import timeit
import urllib.request
from pathlib import Path
from typing import Any

from loadgen import drive_http, start_kiln
from serving_baseline import batch1_inputs, json_body

from kiln.examples import build_example_repository
from kiln.server.rollout import ModelRollout
from kiln.server.rollout_policy import parse_policy

MODES: dict[str, dict[str, str]] = {
    "none": {},  # the latest version (3), as without rollouts
    "route-1": {"traffic_split": "1:1"},  # the split's code, one version
    "split": {"traffic_split": "1:50,2:50"},  # two versions' sessions alternate
    "route+shadow": {"traffic_split": "1:1", "shadow": "3", "shadow_queue_size": "64"},
}


def rollout(port: int, fields: dict[str, str] | None = None) -> dict[str, Any]:
    """POST ``fields`` as the policy (None: GET the rollout)."""
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/v2/repository/models/mlp/rollout",
        data=None if fields is None else json.dumps(fields).encode(),
    )
    with urllib.request.urlopen(req, timeout=10) as resp:
        return json.loads(resp.read() or b"{}")  # type: ignore[no-any-return]


def micro() -> dict[str, float]:
    """The routing decision alone, in-process: microseconds per request."""
    policy = parse_policy("m", {"traffic_split": "1:50,2:50"}, {1, 2})
    sticky = parse_policy("m", {**MODES["split"], "sticky_key": "parameter:user"}, {1, 2})
    assert policy is not None and sticky is not None
    out = {}
    for name, p, params in (("draw", policy, {}), ("sticky", sticky, {"user": "alice-42"})):
        r = ModelRollout("m", p, "api", random.Random(0))
        r.set_versions([1, 2])
        n = 200_000
        t = timeit.timeit(lambda r=r, params=params: r.pick(params, bool), number=n)
        out[name] = t / n * 1e6
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--duration", type=float, default=4.0)
    args = parser.parse_args()
    results: dict[tuple[str, int], list[tuple[float, float, float]]] = {}
    shadows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        repo = Path(tmp) / "models"
        build_example_repository(repo, ["mlp"])
        for v in ("2", "3"):
            shutil.copytree(repo / "mlp" / "1", repo / "mlp" / v)
        config = repo / "mlp" / "config.pbtxt"
        config.write_text(config.read_text() + "version_policy { all {} }\n")
        proc, port = start_kiln(repo, "mlp", [])
        try:
            url = f"http://127.0.0.1:{port}/v2/models/mlp/infer"
            body = json_body(batch1_inputs("mlp"))
            headers = {"Content-Type": "application/json"}
            for _ in range(args.rounds):
                for mode, fields in MODES.items():
                    rollout(port, fields)
                    for conc in (1, 8):
                        w = asyncio.run(
                            drive_http(url, body, headers, conc, proc.pid, 1.0, args.duration)
                        )
                        lat = sorted(w.latencies)
                        p50 = lat[len(lat) // 2] * 1e3
                        p99 = lat[int(len(lat) * 0.99)] * 1e3
                        results.setdefault((mode, conc), []).append(
                            (p50, p99, len(lat) / w.seconds)
                        )
                    if mode == "route+shadow":
                        shadows.append(rollout(port)["shadow"])
        finally:
            proc.terminate()
            proc.wait(30)
    print(f"{'mode':<14}{'conc':>5}{'p50 ms':>9}{'p99 ms':>9}{'req/s':>9}")
    for (mode, conc), rows in results.items():
        p50, p99, rps = (statistics.median(r[i] for r in rows) for i in range(3))
        print(f"{mode:<14}{conc:>5}{p50:>9.3f}{p99:>9.3f}{rps:>9.0f}")
    print("pick() in-process, us per request:", {k: round(v, 2) for k, v in micro().items()})
    for shadow in shadows:  # sent / dropped / compared per round: what the shadow kept up with
        print("shadow:", {k: shadow[k] for k in ("sent", "dropped", "compared", "exact_agreement")})


if __name__ == "__main__":
    main()
