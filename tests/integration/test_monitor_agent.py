"""``kiln monitor agent`` as a real process, scraped over HTTP (fake NVML: no GPU here)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from tests.fake_nvml import fake_gpu
from tests.integration.agent_helpers import AgentProcess


def test_agent_process_serves_dcgm_families(tmp_path: Path) -> None:
    gpu = fake_gpu("GPU-1111", 0, temp=66)
    gpu.unsupported = {"mem_temp"}
    agent = AgentProcess(tmp_path, [gpu], hostname="gpu-node-7").start()
    try:
        text = agent.scrape()
        fams = {f.name: f for f in text_string_to_metric_families(text)}
        temp = fams["DCGM_FI_DEV_GPU_TEMP"].samples[0]
        assert temp.value == 66
        assert temp.labels == {"gpu": "0", "UUID": "GPU-1111", "pci_bus_id": "00000000:18:00.0",
                               "device": "nvidia0", "modelName": "NVIDIA H100 80GB HBM3",
                               "Hostname": "gpu-node-7"}  # fmt: skip
        assert "DCGM_FI_DEV_MEMORY_TEMP" not in text  # unsupported: omitted
        assert fams["DCGM_FI_DEV_XID_ERRORS"].samples[0].value == 0
        procs = {
            s.labels["process_name"] for s in fams["kiln_gpu_process_memory_used_bytes"].samples
        }
        assert procs == {"python3", "trtexec"}
        # The agent re-reads NVML on its interval: a change shows in a later scrape,
        # and an XID event arrives through the event thread.
        gpu.fields["temp"] = 88
        agent.update(xids=(("GPU-1111", 48),))
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            text = agent.scrape()
            if 'Hostname="gpu-node-7"} 88' in text and "XID_ERRORS{" in text and '"} 48' in text:
                break
            time.sleep(0.1)
        else:
            raise AssertionError(text)
    finally:
        assert agent.stop() == 0


def test_agent_imports_no_serving_stack() -> None:
    # The agent runs on every GPU host: torch and the model server stay out of it (the
    # command line's option tables read kiln.llm's small config modules, no engine).
    serving = "('torch', 'kiln.launch', 'kiln.server', 'kiln.llm.engine', 'kiln.backends')"
    code = (
        "import sys, kiln.cli, kiln.metrics.agent, kiln.monitoring.fleet; "
        f"print(sorted(m for m in {serving} if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
