"""The GPU agent's DCGM families against a fake NVML (no GPU here): names, labels, units,
metric types, omitted unsupported fields, per-process memory, XID events, the /metrics route."""

from __future__ import annotations

import time
import urllib.request
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kiln.metrics.agent import Agent
from kiln.metrics.dcgm import LABELS, DcgmCollector
from kiln.metrics.exposition import render
from tests.fake_nvml import FakeNvml, GiB, fake_gpu


def collector(nvml: FakeNvml) -> DcgmCollector:
    c = DcgmCollector.create(nvml)
    assert isinstance(c, DcgmCollector)
    c.hostname = "node-a"
    for labels in c.labels.values():
        labels["Hostname"] = "node-a"
    return c


def samples(c: DcgmCollector) -> dict[str, list[tuple[dict[str, str], float]]]:
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for line in render(c.collect()).decode().splitlines():
        if line.startswith("#"):
            continue
        for fam in text_string_to_metric_families(line + "\n"):
            for s in fam.samples:
                out.setdefault(s.name, []).append((dict(s.labels), s.value))
    return out


def value(got: dict[str, Any], name: str, uuid: str) -> float | None:
    for labels, v in got.get(name, []):
        if labels.get("UUID") == uuid:
            return float(v)
    return None


def test_dcgm_names_units_and_labels() -> None:
    nvml = FakeNvml([fake_gpu("GPU-a", 0), fake_gpu("GPU-b", 1, temp=90)])
    c = collector(nvml)
    c.sample()
    c.sample()  # a second reading gives NVLink a rate
    got = samples(c)
    labels = got["DCGM_FI_DEV_GPU_TEMP"][0][0]
    assert list(labels) == list(LABELS)  # dcgm-exporter's label names, in its order
    assert labels == {
        "gpu": "0",
        "UUID": "GPU-a",
        "pci_bus_id": "00000000:18:00.0",
        "device": "nvidia0",
        "modelName": "NVIDIA H100 80GB HBM3",
        "Hostname": "node-a",
    }
    assert value(got, "DCGM_FI_DEV_GPU_TEMP", "GPU-b") == 90
    assert value(got, "DCGM_FI_DEV_GPU_UTIL", "GPU-a") == 37  # percent, as DCGM
    assert value(got, "DCGM_FI_DEV_MEM_COPY_UTIL", "GPU-a") == 12
    assert value(got, "DCGM_FI_DEV_FB_USED", "GPU-a") == 10 * 1024 + 512  # MiB
    assert value(got, "DCGM_FI_DEV_FB_FREE", "GPU-a") == 70 * 1024 - 512
    assert value(got, "DCGM_FI_DEV_POWER_USAGE", "GPU-a") == 250.5  # W
    assert value(got, "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION", "GPU-a") == 5_000_000  # mJ
    assert value(got, "DCGM_FI_DEV_SM_CLOCK", "GPU-a") == 1980
    assert value(got, "DCGM_FI_DEV_MEM_CLOCK", "GPU-a") == 2619
    assert value(got, "DCGM_FI_DEV_MEMORY_TEMP", "GPU-a") == 70
    assert value(got, "DCGM_FI_DEV_ECC_SBE_VOL_TOTAL", "GPU-a") == 3
    assert value(got, "DCGM_FI_DEV_ECC_SBE_AGG_TOTAL", "GPU-a") == 40
    assert value(got, "DCGM_FI_DEV_ECC_DBE_AGG_TOTAL", "GPU-a") == 1
    assert value(got, "DCGM_FI_DEV_RETIRED_SBE", "GPU-a") == 2
    assert value(got, "DCGM_FI_DEV_RETIRED_DBE", "GPU-a") == 1
    assert value(got, "DCGM_FI_DEV_RETIRED_PENDING", "GPU-a") == 0
    assert value(got, "DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS", "GPU-a") == 4
    assert value(got, "DCGM_FI_DEV_CLOCK_THROTTLE_REASONS", "GPU-a") == 0x24
    assert value(got, "DCGM_FI_DEV_CLOCKS_EVENT_REASONS", "GPU-a") == 0x24
    assert value(got, "DCGM_FI_PROF_PCIE_TX_BYTES", "GPU-a") == 100 * 1024  # B/s
    assert value(got, "DCGM_FI_PROF_PCIE_RX_BYTES", "GPU-a") == 2000 * 1024
    assert value(got, "DCGM_FI_DEV_PCIE_REPLAY_COUNTER", "GPU-a") == 2
    assert value(got, "DCGM_FI_DEV_ENC_UTIL", "GPU-a") == 5
    assert value(got, "DCGM_FI_PROF_NVLINK_TX_BYTES", "GPU-a") == 0  # counter did not move
    text = render(c.collect()).decode()
    # Counters keep DCGM's names (no _total added), gauges are gauges.
    assert "# TYPE DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION counter\n" in text
    assert "# TYPE DCGM_FI_DEV_ECC_DBE_VOL_TOTAL counter\n" in text
    assert "# TYPE DCGM_FI_DEV_GPU_TEMP gauge\n" in text
    assert "DCGM_FI_DEV_XID_ERRORS" not in text  # no event watch started: not known, omitted


def test_nvlink_rate_from_the_cumulative_counter() -> None:
    nvml = FakeNvml([fake_gpu("GPU-a")])
    c = collector(nvml)
    clock = iter([100.0, 102.0])
    c._clock = lambda: next(clock)  # type: ignore[method-assign]
    c.sample()
    assert "DCGM_FI_PROF_NVLINK_TX_BYTES" not in c.devices[0].values  # one reading: no rate yet
    nvml.gpus[0].fields["nvlink_kib"] = [1000 + 2048, 2000 + 4096]
    c.sample()
    assert c.devices[0].values["DCGM_FI_PROF_NVLINK_TX_BYTES"] == 1024 * 1024  # 2 MiB in 2 s
    assert c.devices[0].values["DCGM_FI_PROF_NVLINK_RX_BYTES"] == 2 * 1024 * 1024


def test_unsupported_fields_are_omitted_not_zero() -> None:
    old = fake_gpu("GPU-old", 0)
    old.unsupported = {"mem_temp", "ecc", "retired", "remapped_rows", "nvlink_kib", "energy_mj",
                       "pcie_tx_kb", "pcie_rx_kb", "enc", "dec", "reasons"}  # fmt: skip
    nvml = FakeNvml([old, fake_gpu("GPU-new", 1)])
    c = collector(nvml)
    for _ in range(2):
        c.sample()
    got = samples(c)
    for name in ("DCGM_FI_DEV_MEMORY_TEMP", "DCGM_FI_DEV_ECC_SBE_VOL_TOTAL",
                 "DCGM_FI_DEV_RETIRED_SBE", "DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS",
                 "DCGM_FI_PROF_NVLINK_TX_BYTES", "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION",
                 "DCGM_FI_PROF_PCIE_TX_BYTES", "DCGM_FI_DEV_ENC_UTIL",
                 "DCGM_FI_DEV_CLOCKS_EVENT_REASONS"):  # fmt: skip
        assert value(got, name, "GPU-old") is None, name
        assert value(got, name, "GPU-new") is not None, name
    assert value(got, "DCGM_FI_DEV_GPU_TEMP", "GPU-old") == 61  # the rest still read
    # A family no GPU supports is not written at all (no empty HELP/TYPE block).
    for g in nvml.gpus:
        g.unsupported |= {"mem_temp"}
    c2 = collector(nvml)
    c2.sample()
    assert "DCGM_FI_DEV_MEMORY_TEMP" not in render(c2.collect()).decode()


def test_per_process_memory_with_names() -> None:
    nvml = FakeNvml([fake_gpu("GPU-a", 0)])
    c = collector(nvml)
    c.sample()
    got = samples(c)["kiln_gpu_process_memory_used_bytes"]
    assert sorted((lab["pid"], lab["process_name"], v) for lab, v in got) == [
        ("4242", "python3", 3 * GiB),
        ("77", "trtexec", GiB),  # basename of the path NVML gives
    ]
    assert {(lab["gpu"], lab["UUID"], lab["Hostname"]) for lab, _ in got} == {
        ("0", "GPU-a", "node-a")
    }


def test_xid_from_nvml_events() -> None:
    a, b = fake_gpu("GPU-a", 0), fake_gpu("GPU-b", 1)
    b.unsupported.add("xid")
    nvml = FakeNvml([a, b])
    c = collector(nvml)
    c.start_xid_watch()
    try:
        c.sample()
        got = samples(c)
        assert value(got, "DCGM_FI_DEV_XID_ERRORS", "GPU-a") == 0  # watched, none yet
        assert value(got, "DCGM_FI_DEV_XID_ERRORS", "GPU-b") is None  # cannot be watched
        nvml.xids += [("GPU-a", 13), ("GPU-a", 79)]
        deadline = time.monotonic() + 10
        while c.last_xid.get("GPU-a") != 79 and time.monotonic() < deadline:
            time.sleep(0.02)
        c.sample()
        assert value(samples(c), "DCGM_FI_DEV_XID_ERRORS", "GPU-a") == 79  # the last one
    finally:
        c.close()


def test_agent_serves_metrics_over_http() -> None:
    agent = Agent.create("127.0.0.1", 0, 0.2, nvml=FakeNvml([fake_gpu("GPU-a")]))
    import threading

    thread = threading.Thread(target=agent.serve_forever, daemon=True)
    thread.start()
    try:
        base = f"http://127.0.0.1:{agent.port}"
        deadline = time.monotonic() + 10
        while True:
            try:
                with urllib.request.urlopen(f"{base}/metrics", timeout=5) as resp:
                    text = resp.read().decode()
                    ctype = resp.headers["Content-Type"]
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        assert ctype.startswith("text/plain; version=0.0.4")
        assert 'DCGM_FI_DEV_GPU_UTIL{gpu="0",UUID="GPU-a"' in text
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(f"{base}/nope", timeout=5)
        assert err.value.code == 404
    finally:
        agent.shutdown()
        thread.join(timeout=10)
