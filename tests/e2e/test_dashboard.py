"""The dashboard page in real headless Chromium (Debian ``chromium``, driven by Playwright)
against a real ``kiln serve``: it draws figures that came from real inferences, shows a
firing alert, loads nothing from outside kiln, and copes with history and alerts off."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
from playwright.sync_api import Browser

from kiln.examples import build_example_repository
from tests.conftest import KilnProcess
from tests.e2e.conftest import TIMEOUT_MS, Watched
from tests.integration.monitor_helpers import infer_simple

ARTIFACTS = Path(__file__).resolve().parents[2] / "artifacts"
RULES = """\
groups:
  - name: dashboard-test
    rules:
      - alert: SimpleBusy
        expr: nv_inference_request_success{model="simple"} > 3
        for: 0s
        labels: {severity: info}
        annotations:
          summary: "{{ $labels.model }} served {{ $value }} requests"
"""


@pytest.fixture(scope="module")
def simple_repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("dashboard") / "model_repository"
    build_example_repository(root, ["simple", "mlp"])
    return root


def _keep_inferring(server: KilnProcess, stop: threading.Event) -> threading.Thread:
    # A trickle while the page is open, so live (not only history) points carry traffic.
    def run() -> None:
        while not stop.wait(0.1):
            infer_simple(server, 1)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_dashboard_draws_real_traffic_and_a_firing_alert(
    browser: Browser, make_server: type[KilnProcess], simple_repo: Path, tmp_path: Path
) -> None:
    rules = tmp_path / "rules.yaml"
    rules.write_text(RULES)
    server = make_server(
        simple_repo,
        args=[
            "--history-interval-secs", "0.2", "--history-path", str(tmp_path / "h.db"),
            "--alert-rules", str(rules), "--alert-eval-interval-secs", "0.1",
            "--no-allow-grpc",
        ],
    ).start()  # fmt: skip
    sent = 7
    assert infer_simple(server, sent) == sent
    w = Watched(browser)
    w.page.goto(f"http://{server.http_url}/dashboard")
    requests_cell = w.page.locator('#models tr[data-model="simple"] td.requests')
    requests_cell.filter(has_text=str(sent)).wait_for(timeout=TIMEOUT_MS)
    assert w.page.locator('#models tr[data-model="mlp"] td.requests').inner_text() == "0"
    assert w.page.locator('#models tr[data-model="simple"] td.state-READY').count() == 1
    # No llm model: no LLM section, and no LLM chart was made
    assert w.page.evaluate("window.kilnDashboard.summary().llm") == []
    assert w.page.locator("#llm-panel").is_hidden()
    assert w.page.locator("#llm-charts .chart").count() == 0

    firing = w.page.locator('#alerts li.firing[data-alert="SimpleBusy"]')
    firing.wait_for(timeout=TIMEOUT_MS)
    assert "simple served" in firing.inner_text()

    stop = threading.Event()
    thread = _keep_inferring(server, stop)
    try:
        for chart_id in ("throughput", "latency", "queue-compute", "batch", "cpu", "rss"):
            w.wait_chart_positive(chart_id)
    finally:
        stop.set()
        thread.join()
    latency = w.chart("latency")
    assert latency["simple v1 p50"] > 0 and latency["simple v1 p99"] >= latency["simple v1 p50"]
    throughput = w.chart("throughput")
    assert throughput["simple v1"] > 0 and throughput.get("mlp v1", 0) == 0  # mlp got none
    assert set(w.chart("queue-compute")) == {"simple v1 queue", "simple v1 compute"}
    for chart_id in ("throughput", "latency", "cpu"):
        assert int(w.page.locator(f"#chart-{chart_id}").get_attribute("data-points") or 0) > 0
        assert w.page.locator(f"#chart-{chart_id} canvas").count() == 1
    assert "No GPU telemetry" in w.page.locator("#notes").inner_text()  # no GPU here

    ARTIFACTS.mkdir(exist_ok=True)
    w.page.screenshot(path=str(ARTIFACTS / "dashboard.png"), full_page=True)

    # The range picker refills the charts from history.
    w.page.click('#range button[data-range="1h"]')
    assert w.page.locator("#range button.active").inner_text() == "1h"
    w.wait_chart_positive("throughput")

    assert w.errors == []
    assert w.hosts == {"127.0.0.1"}
    w.page.close()


def test_dashboard_without_history_or_alerts_says_so_and_shows_live_data(
    browser: Browser, make_server: type[KilnProcess], simple_repo: Path
) -> None:
    server = make_server(
        simple_repo, args=["--no-history", "--no-default-alert-rules", "--no-allow-grpc"]
    ).start()
    w = Watched(browser)
    w.page.goto(f"http://{server.http_url}/dashboard/")
    w.page.locator("#notes").filter(has_text="History is off").wait_for(timeout=TIMEOUT_MS)
    assert w.page.locator("#alerts").inner_text() == "alerting is off (no rules loaded)"
    assert w.page.locator("#llm-panel").is_hidden()
    stop = threading.Event()
    thread = _keep_inferring(server, stop)
    try:
        w.wait_chart_positive("throughput")
    finally:
        stop.set()
        thread.join()
    assert w.errors == []
    assert w.hosts == {"127.0.0.1"}
    w.page.close()
