"""The fleet's sources without processes: a kiln server's GPU families translated to DCGM
names, Prometheus's /api/v1/query answer, bad addresses, the fleet table at 80 and 200
columns, and the compare windows and statistics."""

from __future__ import annotations

import io
import json
import threading
from collections.abc import Iterator
from datetime import datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from rich.console import Console

from kiln.monitoring.compare import CompareError, compare, parse_window, quantile, stats
from kiln.monitoring.fleet import (
    FleetError,
    FleetOptions,
    FleetScraper,
    fleet_figures,
    parse_exposition,
    target_url,
)
from kiln.monitoring.fleet_cli import fleet_table
from kiln.monitoring.snapshot import Snapshot

KILN_METRICS = """\
# TYPE nv_gpu_utilization gauge
nv_gpu_utilization{gpu_uuid="GPU-k"} 0.5
nv_gpu_memory_used_bytes{gpu_uuid="GPU-k"} 2147483648
nv_gpu_memory_total_bytes{gpu_uuid="GPU-k"} 85899345920
kiln_gpu_temperature_celsius{gpu_uuid="GPU-k"} 70
nv_inference_count{model="simple",version="1"} 5
"""


def test_kiln_server_gpu_families_become_dcgm_names() -> None:
    series = parse_exposition(KILN_METRICS, "srv:8002")
    labels = (("Hostname", "srv"), ("UUID", "GPU-k"), ("gpu", "0"), ("instance", "srv:8002"))
    assert series["DCGM_FI_DEV_GPU_UTIL"] == {labels: 50.0}
    assert series["DCGM_FI_DEV_FB_USED"] == {labels: 2048.0}
    assert series["DCGM_FI_DEV_FB_FREE"] == {labels: 80 * 1024 - 2048.0}
    assert series["DCGM_FI_DEV_GPU_TEMP"] == {labels: 70.0}
    assert "nv_inference_count" not in series  # another server's models are not ours


class _Prometheus(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        assert self.path.startswith("/api/v1/query?")
        body = json.dumps({"status": "success", "data": {"resultType": "vector", "result": [
            {"metric": {"__name__": "DCGM_FI_DEV_GPU_TEMP", "gpu": "0", "UUID": "GPU-p",
                        "Hostname": "n9", "modelName": "NVIDIA A100", "instance": "n9:9400"},
             "value": [1.7e9, "77"]},
            {"metric": {"__name__": "DCGM_FI_DEV_NOT_A_FIELD_WE_KNOW", "UUID": "GPU-p"},
             "value": [1.7e9, "1"]},
        ]}}).encode()  # fmt: skip
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None: ...


@pytest.fixture
def prometheus() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Prometheus)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_prometheus_source_and_a_dead_agent(prometheus: str) -> None:
    scraper = FleetScraper(FleetOptions(("127.0.0.1:9",), prometheus, timeout_s=2))
    scraper.scrape_once()
    values = scraper.values()
    ((labels, temp),) = values["DCGM_FI_DEV_GPU_TEMP"].items()
    assert temp == 77 and dict(labels)["Hostname"] == "n9"
    assert "DCGM_FI_DEV_NOT_A_FIELD_WE_KNOW" not in values
    up = {dict(k)["instance"]: v for k, v in values["up"].items()}
    assert up == {"127.0.0.1:9": 0.0}
    down = [t for t in scraper.targets() if not t["up"]]
    assert [t["source"] for t in down] == ["127.0.0.1:9"] and down[0]["error"]
    (row,) = fleet_figures(Snapshot(0.0, values))
    assert (row["host"], row["gpu"], row["model_name"]) == ("n9", "0", "NVIDIA A100")


@pytest.mark.parametrize("bad", ["ftp://x:1", "", "http://"])
def test_bad_agent_addresses_are_refused(bad: str) -> None:
    with pytest.raises(FleetError):
        target_url(bad)
    assert target_url("h:9400") == "http://h:9400/metrics"
    assert target_url("https://h/x/metrics") == "https://h/x/metrics"


def _rows() -> list[dict[str, object]]:
    return [
        {"host": f"gpu-node-{i}.cluster.internal", "instance": "", "gpu": str(g),
         "uuid": f"GPU-{i}{g}", "model_name": "NVIDIA H100 80GB HBM3",
         "utilization_percent": 37.0, "memory_used_mib": 10240.0, "memory_free_mib": 71000.0,
         "temperature_celsius": 61.0, "power_watts": 250.0, "xid": 0.0}
        for i in range(2) for g in range(2)
    ]  # fmt: skip


@pytest.mark.parametrize("width", [80, 200])
def test_fleet_table_fits_the_terminal(width: int) -> None:
    out = io.StringIO()
    Console(file=out, width=width).print(fleet_table(_rows(), width))
    text = out.getvalue()
    assert max(len(line) for line in text.splitlines()) <= width
    assert "gpu-node-1.cluster.internal" in text  # host names stay whole
    assert ("NVIDIA H100 80GB HBM3" in text) == (width == 200)
    assert ("hidden" in text) == (width == 80)


def test_compare_windows() -> None:
    now = datetime(2026, 11, 28, 15, 30).timestamp()
    start, end = parse_window("13:00-14:00", now)
    assert datetime.fromtimestamp(start).hour == 13 and end - start == 3600
    assert parse_window("23:30-00:30", now)[1] - parse_window("23:30-00:30", now)[0] == 3600
    assert parse_window("now-2h..now-1h", now) == (now - 7200, now - 3600)
    for bad in ("13:00", "now-1h..now-2h", "x..y"):
        with pytest.raises(CompareError):
            parse_window(bad, now)


def test_compare_statistics_and_change() -> None:
    assert quantile([1, 2, 3, 4], 0.5) == 2.5 and stats([]) is None
    data = {
        (0.0, 10.0): {"gpu=0": [60.0] * 99 + [70.0], "gpu=1": [50.0]},
        (20.0, 30.0): {"gpu=0": [90.0] * 100},
    }

    def fetch(metric: str, start: float, end: float, step: float) -> dict[str, list[float]]:
        assert metric == "DCGM_FI_DEV_GPU_TEMP" and step >= 1
        return data[(start, end)]

    result = compare(fetch, "DCGM_FI_DEV_GPU_TEMP", (0.0, 10.0), (20.0, 30.0))
    g0, g1 = result["series"]
    assert g0["before"]["mean"] == pytest.approx(60.1) and g0["before"]["max"] == 70
    assert g0["before"]["p50"] == 60 and g0["after"]["p99"] == 90
    assert g0["change"]["mean"] == pytest.approx(29.9)
    assert g0["change"]["max_percent"] == pytest.approx(100 * 20 / 70)
    assert g1["after"] is None and g1["change"]["mean"] is None  # gone after: no change
