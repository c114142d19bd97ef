"""``kiln monitor URL`` (the live terminal view) against a real ``kiln serve``."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from kiln.examples import build_example_repository
from tests.conftest import KilnProcess, free_port
from tests.integration.monitor_helpers import infer_simple

RULES = """\
groups:
  - name: cli-test
    rules:
      - alert: SimpleBusy
        expr: nv_inference_request_success{model="simple"} > 3
        for: 0s
"""


def monitor(*args: str, columns: int = 160) -> subprocess.CompletedProcess[str]:
    # A wide terminal by default, so every column the test reads is shown.
    env = dict(os.environ, COLUMNS=str(columns), NO_COLOR="1")
    return subprocess.run(
        [sys.executable, "-m", "kiln", "monitor", *args],
        capture_output=True, text=True, timeout=60, check=False, env=env,
    )  # fmt: skip


@pytest.fixture(scope="module")
def simple_repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("monitor") / "model_repository"
    build_example_repository(root, ["simple", "mlp"])
    return root


def _row(output: str, model: str) -> list[str]:
    line = next(ln for ln in output.splitlines() if re.match(rf"│ {model}\s", ln))
    return [cell.strip() for cell in line.strip("│ ").split("│")]


def test_once_prints_models_their_requests_host_and_firing_alerts(
    make_server: type[KilnProcess], simple_repo: Path, tmp_path: Path
) -> None:
    rules = tmp_path / "rules.yaml"
    rules.write_text(RULES)
    server = make_server(
        simple_repo,
        args=["--alert-rules", str(rules), "--alert-eval-interval-secs", "0.1", "--no-history"],
    ).start()
    assert infer_simple(server, 5) == 5
    for url in (server.http_url, f"http://{server.http_url}/"):  # bare host:port or a URL
        result = monitor(url, "--once", "--interval", "0.2")
        assert result.returncode == 0, result.stderr
        simple = _row(result.stdout, "simple")
        assert simple[:5] == ["simple", "1", "READY", "5", "0"]  # model version state req err
        assert _row(result.stdout, "mlp")[3] == "0"
    assert "host (no GPU telemetry)" in result.stdout  # no GPU on this machine
    assert "history off" in result.stdout
    assert re.search(r"FIRING\s+SimpleBusy \{model=simple version=1\}", result.stdout)
    # The explicit subcommand is the same view.
    live = monitor("live", server.http_url, "--once")
    assert live.returncode == 0 and _row(live.stdout, "simple")[3] == "5"
    # 80 columns: whole names and states, fewer columns, nothing cut to "…"
    narrow = monitor(server.http_url, "--once", columns=80)
    assert narrow.returncode == 0, narrow.stderr
    assert "…" not in narrow.stdout and max(map(len, narrow.stdout.splitlines())) <= 80
    assert _row(narrow.stdout, "simple")[:3] == ["simple", "1", "READY"]
    assert "columns hidden" in narrow.stdout, narrow.stdout


def test_history_subcommand_still_works_beside_it(kiln_server: KilnProcess) -> None:
    result = monitor("history", kiln_server.http_url, "--metric", "throughput", "--since", "1m")
    assert result.returncode == 0, result.stderr
    assert "throughput (rate" in result.stdout


def test_unreachable_server_and_disabled_metrics_are_clear_errors(
    make_server: type[KilnProcess], simple_repo: Path
) -> None:
    down = monitor(f"127.0.0.1:{free_port()}", "--once")
    assert down.returncode == 1
    assert "cannot reach http://127.0.0.1:" in down.stderr and "/api/live" in down.stderr
    server = make_server(
        simple_repo,
        args=["--no-allow-metrics", "--no-history", "--no-default-alert-rules", "--no-allow-grpc"],
    ).start()
    off = monitor(server.http_url, "--once")
    assert off.returncode == 1
    assert "HTTP 503" in off.stderr and "--no-allow-metrics" in off.stderr
    bad = monitor(server.http_url, "--once", "--interval", "0")
    assert bad.returncode == 2 and "--interval" in bad.stderr
