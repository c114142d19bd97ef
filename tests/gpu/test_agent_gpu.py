"""``kiln monitor agent`` on a real GPU: the DCGM core fields are there and plausible."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import free_port

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parents[2]


def test_agent_reports_real_gpus(tmp_path: Path) -> None:
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "KILN_FAKE_NVML"}
    log = open(tmp_path / "agent.log", "wb")  # noqa: SIM115
    proc = subprocess.Popen(
        [sys.executable, "-m", "kiln", "monitor", "agent", "--host", "127.0.0.1",
         "--port", str(port), "--interval", "0.5"],
        stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT,
    )  # fmt: skip
    log.close()
    try:
        text = ""
        for _ in range(300):
            assert proc.poll() is None, (tmp_path / "agent.log").read_text()
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
                    text = r.read().decode()
                break
            except OSError:
                time.sleep(0.1)
        fams = {f.name: f for f in text_string_to_metric_families(text)}
        import pynvml

        pynvml.nvmlInit()
        count = pynvml.nvmlDeviceGetCount()
        pynvml.nvmlShutdown()
        temps = fams["DCGM_FI_DEV_GPU_TEMP"].samples
        assert len(temps) == count
        for s in temps:
            assert s.labels["UUID"].startswith(("GPU-", "MIG-"))
            assert s.labels["modelName"] and s.labels["pci_bus_id"] and s.labels["Hostname"]
            assert s.labels["device"].startswith("nvidia")
            assert 5 <= s.value <= 110
        for s in fams["DCGM_FI_DEV_GPU_UTIL"].samples:
            assert 0 <= s.value <= 100
        used = {s.labels["UUID"]: s.value for s in fams["DCGM_FI_DEV_FB_USED"].samples}
        free = {s.labels["UUID"]: s.value for s in fams["DCGM_FI_DEV_FB_FREE"].samples}
        for uuid, u in used.items():
            assert 1024 <= u + free[uuid] <= 300 * 1024  # MiB: 1 GiB to 300 GiB per GPU
        for s in fams["DCGM_FI_DEV_POWER_USAGE"].samples:
            assert 1 <= s.value <= 2000  # watts
        for s in fams["DCGM_FI_DEV_SM_CLOCK"].samples:
            assert 0 < s.value < 5000  # MHz
        # The energy counter is mJ since the driver loaded: large, and never negative.
        for s in fams.get("DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION").samples:  # type: ignore[union-attr]
            assert s.value > 0
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=15) == 0
