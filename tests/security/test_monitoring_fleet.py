"""A hostile or broken fleet source (``--monitor-agent`` / ``--monitor-prometheus``): what
it answers costs the scraper bounded time and never touches the other sources. Before:
a peer that dribbled its answer held the scraper for as long as it liked (each read had
``timeout_s``, the whole answer none) and counted as up, every other source waiting behind
it; a Prometheus answer of the wrong shape raised past the per-source handler, so the
sources after it were not scraped that round and its own old series stayed."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from kiln.monitoring.fleet import FleetError, FleetOptions, FleetScraper, query_prometheus

AGENT = b'DCGM_FI_DEV_GPU_TEMP{gpu="0",UUID="GPU-a",Hostname="n1"} 61\n'
BAD_PROMETHEUS = {
    "list": b"[]",
    "data-string": b'{"status": "success", "data": "x"}',
    "result-not-list": b'{"status": "success", "data": {"result": {"a": 1}}}',
    "item-not-object": b'{"status": "success", "data": {"result": [7]}}',
    "metric-not-object": b'{"status": "success", "data": {"result": [{"metric": 1}]}}',
    "value-short": (
        b'{"status": "success", "data": {"result": [{"metric": '
        b'{"__name__": "DCGM_FI_DEV_GPU_TEMP"}, "value": [1]}]}}'
    ),
    "nested": b"[" * 100_000 + b"]" * 100_000,
    "not-json": b"\xff\xfe",
}


class _Peer(BaseHTTPRequestHandler):
    def log_message(self, *args: object) -> None:
        pass

    def do_GET(self) -> None:
        path = self.path.split("?")[0].strip("/")
        self.send_response(200)
        if path == "slow/metrics":  # a valid answer, one byte at a time: never finishes
            self.send_header("Content-Length", str(len(AGENT) * 1000))
            self.end_headers()
            try:
                for byte in AGENT * 1000:
                    self.wfile.write(bytes([byte]))
                    self.wfile.flush()
                    time.sleep(0.05)
            except OSError:
                pass  # the scraper gave up and closed: what it should do
            return
        body = AGENT if path == "metrics" else BAD_PROMETHEUS[path.split("/")[0]]
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@pytest.fixture(scope="module")
def peer() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Peer)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"127.0.0.1:{server.server_port}"
    server.shutdown()


def test_a_peer_that_dribbles_its_answer_is_down_and_others_are_scraped(peer: str) -> None:
    slow, good = f"http://{peer}/slow/metrics", f"{peer}"
    scraper = FleetScraper(FleetOptions(agents=(slow, good), timeout_s=0.5))
    scraper.scrape_once()
    status = {t["source"]: t for t in scraper.targets()}
    assert status[slow]["up"] is False
    assert "no complete answer within 0.5 s" in status[slow]["error"]
    assert status[good]["up"] is True
    temps = scraper.values()["DCGM_FI_DEV_GPU_TEMP"]
    assert [dict(k)["instance"] for k in temps] == [peer]


@pytest.mark.parametrize("shape", sorted(BAD_PROMETHEUS))
def test_a_prometheus_answer_of_the_wrong_shape_is_a_fleet_error(peer: str, shape: str) -> None:
    with pytest.raises(FleetError, match="Prometheus"):
        query_prometheus(f"http://{peer}/{shape}", 5)


def test_a_broken_prometheus_is_down_and_the_agents_are_still_scraped(peer: str) -> None:
    scraper = FleetScraper(FleetOptions(agents=(peer,), prometheus=f"http://{peer}/list"))
    scraper.scrape_once()
    status = {t["source"]: t for t in scraper.targets()}
    assert status[f"prometheus http://{peer}/list"]["up"] is False
    assert status[peer]["up"] is True
    assert json.dumps(scraper.targets())  # the status stays JSON for /api/live
