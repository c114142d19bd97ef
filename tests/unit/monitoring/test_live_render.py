"""``kiln monitor``'s frame at the widths people have: 80 columns (or piped) and 200.

Narrow, the least important columns go (the caption says how many) and no cell is cut to
"…"; model names and GPU ids stay whole. Wide, every column is there."""

from __future__ import annotations

import io

import pytest
from rich.console import Console

from kiln.monitoring.live_cli import LLM_COLUMNS, MODEL_COLUMNS, frame

LONG = "resnet50_imagenet_classification_int8"
UUID = "GPU-5f3c8a2e-91d4-4c6b-a7e0-3b2d1f9e8c71"


def summary(gpus: bool) -> dict[str, object]:
    rates = {"throughput": 1234.5, "p50_ms": 1.25, "p99_ms": 9.87, "avg_queue_us": 120.0,
             "avg_compute_us": 880.0, "avg_batch_size": 7.5}  # fmt: skip
    totals = {"requests": 123456, "failure": 3, "pending": 2, "avg_batch_size": 7.1}
    llm = {"model": "smollm2-135m-instruct", "running": 12, "waiting": 3,
           "kv_cache_usage": 0.42, "prompt_tokens_per_s": 1500.0,
           "generation_tokens_per_s": 420.0, "prefix_cache_hit_rate": 0.8, "ttft_p50_ms": 35.0,
           "ttft_p99_ms": 180.0, "itl_p50_ms": 21.0, "itl_p99_ms": 60.0,
           "preemptions": 1}  # fmt: skip
    gpu = {"uuid": UUID, "utilization": 0.93, "memory_used_bytes": 60 * 2**30,
           "memory_total_bytes": 80 * 2**30, "temperature_celsius": 71,
           "power_watts": 612}  # fmt: skip
    host = {"cpu_utilization": 0.5, "process_cpu_cores": 1.2, "process_rss_bytes": 2**31,
            "memory_used_bytes": 8 * 2**30, "memory_total_bytes": 24 * 2**30}  # fmt: skip
    return {
        "ts": 1_700_000_000.0, "window_s": 5.0,
        "history": {"available": True, "enabled": True, "interval": 5.0, "error": None},
        "models": [
            {"model": LONG, "version": "12", "state": "READY", "totals": totals, "rates": rates},
            {"model": "simple", "version": "1", "state": "UNAVAILABLE", "totals": {},
             "rates": {}},
        ],
        "llm": [llm], "gpus": [gpu] if gpus else [], "host": host,
        "alerting": {"enabled": True, "rules": 4}, "alerts": [],
    }  # fmt: skip


def render(width: int, gpus: bool = True) -> str:
    console = Console(width=width, file=io.StringIO(), color_system=None)
    console.print(frame("localhost:8000", summary(gpus), console.width))
    out = console.file.getvalue()  # type: ignore[attr-defined]
    assert isinstance(out, str)
    return out


@pytest.mark.parametrize("gpus", [True, False])
def test_80_columns_drop_columns_instead_of_cutting_cells(gpus: bool) -> None:
    out = render(80, gpus)
    assert "…" not in out
    assert max(len(line) for line in out.splitlines()) <= 80
    for whole in (LONG, "smollm2-135m-instruct", "UNAVAILABLE", "READY"):
        assert whole in out
    if gpus:
        assert UUID in out
    # the most important figures stay; the caption says what went
    for header in ("model", "state", "errors", "infer/s", "running", "gen tok/s"):
        assert header in out
    assert "hidden: a wider terminal shows them" in out
    assert "batch" not in out.split("LLM engine")[0]  # the first column to go


def test_200_columns_show_every_column() -> None:
    out = render(200)
    assert "…" not in out and "hidden" not in out
    for column in MODEL_COLUMNS + LLM_COLUMNS:
        assert column.name in out, column.name
    assert max(len(line) for line in out.splitlines()) <= 200


def test_no_width_is_every_column_as_before() -> None:
    console = Console(width=300, file=io.StringIO(), color_system=None)
    console.print(frame("localhost:8000", summary(True)))
    out = console.file.getvalue()  # type: ignore[attr-defined]
    assert all(c.name in out for c in MODEL_COLUMNS) and "hidden" not in out
