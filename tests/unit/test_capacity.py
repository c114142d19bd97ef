"""benchmarks/capacity.py on a real `kiln bench` report (benchmarks/capacity-example-mlp.json)."""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import pytest

from benchmarks.capacity import main, plan

REPORT = json.loads(
    (Path(__file__).resolve().parents[2] / "benchmarks" / "capacity-example-mlp.json").read_text()
)


def test_picks_the_fastest_level_within_p99() -> None:
    target_p99_us = sorted(lv["latency_us"]["p99"] for lv in REPORT["levels"])[
        1
    ]  # 2 levels qualify
    ok = [lv for lv in REPORT["levels"] if lv["latency_us"]["p99"] <= target_p99_us]
    best = max(ok, key=lambda lv: lv["throughput_infer_per_sec"])
    result = plan(REPORT, target_qps=5000, p99_ms=target_p99_us / 1000, utilization=0.8, spare=1)
    assert result is not None
    assert result.concurrency == best["concurrency"]
    assert result.replicas == math.ceil(5000 / (best["throughput_infer_per_sec"] * 0.8)) + 1


def test_levels_with_errors_are_not_capacity() -> None:
    report = copy.deepcopy(REPORT)
    for lv in report["levels"]:
        lv["errors"] = 1
    assert plan(report, 100, 1e9) is None


def test_unreachable_p99_says_so(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "r.json"
    path.write_text(json.dumps(REPORT))
    assert main([str(path), "--target-qps", "100", "--p99-ms", "0.001"]) == 1
    assert "latency floor" in capsys.readouterr().out
    assert main([str(path), "--target-qps", "2000", "--p99-ms", "50"]) == 0
    assert "replicas for 2,000 infer/s" in capsys.readouterr().out


def test_bad_utilization_is_refused() -> None:
    with pytest.raises(ValueError, match="utilization"):
        plan(REPORT, 100, 50, utilization=0)
