"""``GET /api/live`` and ``/dashboard`` on a real ``kiln serve``."""

from __future__ import annotations

import urllib.request
from pathlib import Path
from typing import Any

import pytest

from kiln.examples import build_example_repository
from tests.conftest import KilnProcess
from tests.integration.monitor_helpers import get_json, infer_simple, wait_for


@pytest.fixture(scope="module")
def simple_repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("live") / "model_repository"
    build_example_repository(root, ["simple"])
    return root


def test_live_reports_models_rates_host_alerts_and_history(
    make_server: type[KilnProcess], simple_repo: Path, tmp_path: Path
) -> None:
    server = make_server(
        simple_repo,
        args=["--history-path", str(tmp_path / "h.db"), "--history-interval-secs", "1"],
    ).start()
    status, first = get_json(server, "/api/live")
    assert status == 200, first
    assert infer_simple(server, 5) == 5

    def with_rates() -> dict[str, Any] | None:
        body = get_json(server, "/api/live")[1]
        [m] = body["models"]
        return body if m["rates"]["p99_ms"] is not None else None

    body = wait_for(with_rates, 10, "rates over a window holding the 5 requests")
    [m] = body["models"]
    assert (m["model"], m["version"], m["state"]) == ("simple", "1", "READY")
    assert m["totals"]["requests"] == m["totals"]["success"] == 5
    assert m["totals"]["avg_batch_size"] == 1.0
    assert m["rates"]["throughput"] > 0 and m["rates"]["avg_compute_us"] > 0
    assert m["rates"]["p99_ms"] >= m["rates"]["p50_ms"] > 0
    assert body["window_s"] > 0
    assert body["gpus"] == []  # no GPU on this machine
    assert body["host"]["process_rss_bytes"] > 0
    assert body["history"] == {"enabled": True, "available": True, "interval": 1.0, "error": ""}
    assert body["alerting"]["enabled"] is True  # the shipped rules


def test_live_without_metrics_history_or_alerts_is_503_with_the_reason(
    make_server: type[KilnProcess], simple_repo: Path
) -> None:
    server = make_server(
        simple_repo,
        args=["--no-allow-metrics", "--no-history", "--no-default-alert-rules", "--no-allow-grpc"],
    ).start()
    status, body = get_json(server, "/api/live")
    assert status == 503
    assert "--no-allow-metrics" in body["error"]
    assert infer_simple(server, 1) == 1  # serving is unaffected


def test_dashboard_is_served_with_its_vendored_chart_library(kiln_server: KilnProcess) -> None:
    base = f"http://{kiln_server.http_url}"
    with urllib.request.urlopen(f"{base}/dashboard") as resp:  # redirected to /dashboard/
        assert resp.url.endswith("/dashboard/")
        page = resp.read().decode()
    assert 'src="vendor/uPlot.iife.min.js"' in page and "http" not in page.split("<body>")[1]
    for asset in ("vendor/uPlot.iife.min.js", "vendor/uPlot.min.css", "dashboard.js"):
        with urllib.request.urlopen(f"{base}/dashboard/{asset}") as resp:
            assert resp.status == 200 and len(resp.read()) > 1000
    assert get_json(kiln_server, "/dashboard/nope.js")[0] == 404
