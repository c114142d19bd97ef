"""The dashboard's fleet and rollout panels in real headless Chromium: a ``kiln serve`` that
scrapes two ``kiln monitor agent`` processes (fake NVML) shows every host's GPUs, an
overheating one marked; a model with a shadow version shows its rollout row with the
copies sent and their agreement."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests
from playwright.sync_api import Browser

from kiln.examples import build_example_repository
from tests.conftest import KilnProcess
from tests.e2e.conftest import TIMEOUT_MS, Watched
from tests.integration.agent_helpers import AgentProcess, two_agents
from tests.integration.monitor_helpers import infer_simple


@pytest.fixture(scope="module")
def agents(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[AgentProcess]]:
    yield from two_agents(tmp_path_factory.mktemp("agents"), node_b_temp=95)


def test_fleet_and_rollout_panels(
    browser: Browser, agents: list[AgentProcess], make_server: type[KilnProcess], tmp_path: Path
) -> None:
    repo = tmp_path / "models"
    build_example_repository(repo, ["simple"])
    shutil.copytree(repo / "simple" / "1", repo / "simple" / "2")
    config = repo / "simple" / "config.pbtxt"
    config.write_text(config.read_text() + "version_policy { all {} }\n")
    server = make_server(
        repo, args=[*(x for a in agents for x in ("--monitor-agent", a.address)), "--no-allow-grpc"]
    ).start()  # fmt: skip
    r = requests.post(
        f"http://{server.http_url}/v2/repository/models/simple/rollout",
        json={"traffic_split": "1:100", "shadow": "2"},
        timeout=10,
    )
    assert r.status_code == 200, r.text
    assert infer_simple(server, 5) == 5

    w = Watched(browser)
    w.page.goto(f"http://{server.http_url}/dashboard")
    rows = w.page.locator("#fleet tbody tr")
    w.page.locator('#fleet tr[data-uuid="GPU-b0"]').wait_for(timeout=TIMEOUT_MS)
    assert rows.count() == 3
    assert w.page.locator("#fleet-panel").is_visible()
    hot = w.page.locator('#fleet tr[data-uuid="GPU-b0"] td.temp')
    assert hot.inner_text() == "95" and "hot" in (hot.get_attribute("class") or "")
    cool = w.page.locator('#fleet tr[data-uuid="GPU-a0"] td.temp')
    assert cool.inner_text() == "50" and "hot" not in (cool.get_attribute("class") or "")
    assert "node-a" in w.page.locator('#fleet tr[data-uuid="GPU-a1"]').inner_text()

    row = w.page.locator("#rollouts tbody tr", has_text="simple")
    row.wait_for(timeout=TIMEOUT_MS)
    # the five copies reached the shadow (identical weights: every answer agrees)
    row.filter(has_text="100.0").wait_for(timeout=TIMEOUT_MS)
    assert "v1=100" in row.inner_text()
    assert w.errors == []
    assert w.hosts == {"127.0.0.1"}
    w.page.close()
