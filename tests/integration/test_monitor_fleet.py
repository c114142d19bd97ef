"""The fleet view against real processes: two ``kiln monitor agent`` (fake NVML) scraped by a
real ``kiln serve --monitor-agent`` (history, an alert rule on DCGM_FI_DEV_GPU_TEMP, the
fleet in /api/live, compare over its history) and by ``kiln monitor --agent``."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kiln.monitoring.compare import compare, kiln_fetch
from tests.conftest import KilnProcess
from tests.integration.agent_helpers import AgentProcess, two_agents
from tests.integration.monitor_helpers import get_json, wait_for

RULES = """\
groups:
  - name: fleet
    rules:
      - alert: GpuHot
        expr: DCGM_FI_DEV_GPU_TEMP > 85
        labels: {severity: critical}
        annotations:
          summary: "{{ $labels.Hostname }} GPU {{ $labels.gpu }} at {{ $value }} C"
"""


@pytest.fixture(scope="module")
def agents(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[AgentProcess]]:
    yield from two_agents(tmp_path_factory.mktemp("agents"), node_b_temp=60)


def test_server_fleet_history_alerts_and_compare(
    agents: list[AgentProcess], make_server: type[KilnProcess], tmp_path: Path
) -> None:
    rules = tmp_path / "fleet.yml"
    rules.write_text(RULES)
    repo = tmp_path / "models"  # no models: only the fleet is watched
    repo.mkdir()
    server = make_server(
        repo,
        args=["--history-interval-secs", "0.2", "--alert-eval-interval-secs", "0.2",
              "--alert-rules", str(rules),
              *(x for a in agents for x in ("--monitor-agent", a.address))]
    ).start()  # fmt: skip
    node_b = agents[1]

    def fleet() -> list[dict[str, Any]] | None:
        rows = get_json(server, "/api/live")[1]["fleet"]
        return rows if len(rows) == 3 else None

    rows = wait_for(fleet, 30, "three GPUs of two agents in /api/live")
    assert [(r["host"], r["gpu"], r["uuid"]) for r in rows] == [
        ("node-a", "0", "GPU-a0"), ("node-a", "1", "GPU-a1"), ("node-b", "0", "GPU-b0")
    ]  # fmt: skip
    assert rows[0]["model_name"] == "NVIDIA H100 80GB HBM3"
    assert rows[0]["utilization_percent"] == 37 and rows[2]["temperature_celsius"] == 60
    assert get_json(server, "/api/alerts")[1]["alerts"] == []
    time.sleep(1.5)  # some "before" history at 60 °C
    t_change = time.time()
    node_b.gpus[0].fields["temp"] = 95  # node-b's GPU overheats
    node_b.update()

    def firing() -> list[dict[str, Any]] | None:
        alerts = get_json(server, "/api/alerts")[1]["alerts"]
        return [a for a in alerts if a["state"] == "firing"] or None

    (alert,) = wait_for(firing, 30, "GpuHot firing from agent data")
    assert alert["labels"]["Hostname"] == "node-b" and alert["labels"]["UUID"] == "GPU-b0"
    assert alert["annotations"]["summary"] == "node-b GPU 0 at 95 C"
    time.sleep(1.5)
    # History stored the fleet's series; compare reads two windows of it.
    status, hist = get_json(server, "/api/history", metric="DCGM_FI_DEV_GPU_TEMP",
                            start="now-1m")  # fmt: skip
    assert status == 200 and len(hist["series"]) == 3
    result = compare(
        kiln_fetch(server.http_url),
        "DCGM_FI_DEV_GPU_TEMP",
        (t_change - 60, t_change - 0.5),
        (t_change + 1.0, time.time()),
    )
    by_uuid = {s["series"].split("UUID=")[1].split(",")[0]: s for s in result["series"]}
    assert by_uuid["GPU-b0"]["before"]["max"] == 60
    assert by_uuid["GPU-b0"]["after"]["p50"] == 95
    assert by_uuid["GPU-b0"]["change"]["mean"] == 35
    assert by_uuid["GPU-a0"]["change"]["max"] == 0
    # The terminal view of the server shows the fleet table too.
    out = subprocess.run(
        [sys.executable, "-m", "kiln", "monitor", server.http_url, "--once", "--interval", "0.1"],
        capture_output=True, text=True, timeout=60, env={"COLUMNS": "200", **_env()},
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "fleet: 3 GPU(s)" in out.stdout and "node-b" in out.stdout


def _env() -> dict[str, str]:
    import os

    return dict(os.environ)


def test_kiln_monitor_agents_view_and_alerts(agents: list[AgentProcess], tmp_path: Path) -> None:
    rules = tmp_path / "fleet.yml"
    rules.write_text(RULES.replace("> 85", "> 58"))
    cmd = [
        sys.executable,
        "-m",
        "kiln",
        "monitor",
        "--once",
        "--alert-rules",
        str(rules),
        *(x for a in agents for x in ("--agent", a.address)),
        "--agent",
        "127.0.0.1:9",
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=60,
                         env={**_env(), "COLUMNS": "120"})  # fmt: skip
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert "fleet: 3 GPU(s)" in text
    for host in ("node-a", "node-b"):
        assert host in text
    assert "DOWN 127.0.0.1:9" in text  # an agent that does not answer is named, not hidden
    assert "FIRING" in text and "GpuHot" in text and "node-b GPU 0" in text
