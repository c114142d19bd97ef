"""A hostile or broken fleet source (``--monitor-agent`` / ``--monitor-prometheus``): what
it answers costs the scraper bounded time and never touches the other sources. Before:
a peer that dribbled its answer held the scraper for as long as it liked (each read had
``timeout_s``, the whole answer none) and counted as up, every other source waiting behind
it; a Prometheus answer of the wrong shape raised past the per-source handler, so the
sources after it were not scraped that round and its own old series stayed. And a source
could answer any number of series with labels of any length: every alert evaluation keeps
the snapshots of its longest window (240 at the shipped rules' 1 h and 15 s), each with
fresh copies, so one 15 MiB label became gigabytes. A source is now held to Prometheus's
scrape limits (``sample_limit``, ``label_limit``, label name and value lengths)."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from kiln.monitoring.fleet import (
    MAX_LABEL_VALUE,
    MAX_LABELS,
    MAX_SERIES,
    FleetError,
    FleetOptions,
    FleetScraper,
    query_prometheus,
)

AGENT = b'DCGM_FI_DEV_GPU_TEMP{gpu="0",UUID="GPU-a",Hostname="n1"} 61\n'
TOO_MANY = b"".join(
    b'DCGM_FI_DEV_GPU_TEMP{gpu="0",UUID="GPU-%d"} 61\n' % i for i in range(MAX_SERIES + 1)
)
LONG_VALUE = b'DCGM_FI_DEV_GPU_TEMP{UUID="GPU-a",Hostname="%s"} 61\n' % (b"h" * 100_000)
MANY_LABELS = b'DCGM_FI_DEV_GPU_TEMP{UUID="GPU-a",%s} 61\n' % b",".join(
    b'l%d="x"' % i for i in range(MAX_LABELS)
)
OVER_LIMITS = {"too-many": TOO_MANY, "long-value": LONG_VALUE, "many-labels": MANY_LABELS}
PROMETHEUS_OVER_LIMITS = json.dumps(
    {"status": "success", "data": {"result": [
        {"metric": {"__name__": "DCGM_FI_DEV_GPU_TEMP", "UUID": "GPU-a",
                    "Hostname": "h" * (MAX_LABEL_VALUE + 1)}, "value": [1, "61"]}]}}
).encode()  # fmt: skip
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
        first = path.split("/")[0]
        if path == "metrics":
            body = AGENT
        elif first in OVER_LIMITS:
            body = OVER_LIMITS[first]
        elif first == "prometheus-over-limits":
            body = PROMETHEUS_OVER_LIMITS
        else:
            body = BAD_PROMETHEUS[first]
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


@pytest.mark.parametrize(
    ("path", "words"),
    [
        ("too-many", f"{MAX_SERIES + 1} series, more than the {MAX_SERIES}"),
        ("long-value", f"label 'Hostname' longer than {MAX_LABEL_VALUE} characters"),
        ("many-labels", f"{MAX_LABELS + 2} labels, more than {MAX_LABELS}"),
    ],
)
def test_an_agent_over_the_scrape_limits_is_down(peer: str, path: str, words: str) -> None:
    source = f"http://{peer}/{path}/metrics"
    scraper = FleetScraper(FleetOptions(agents=(source, peer)))
    scraper.scrape_once()
    status = {t["source"]: t for t in scraper.targets()}
    assert status[source]["up"] is False
    assert words in status[source]["error"]
    assert status[peer]["up"] is True
    temps = scraper.values()["DCGM_FI_DEV_GPU_TEMP"]
    assert [dict(k)["instance"] for k in temps] == [peer]  # nothing of the refused one


def test_a_prometheus_over_the_scrape_limits_is_down(peer: str) -> None:
    scraper = FleetScraper(FleetOptions(prometheus=f"http://{peer}/prometheus-over-limits"))
    scraper.scrape_once()
    (status,) = scraper.targets()
    assert status["up"] is False
    assert f"label 'Hostname' longer than {MAX_LABEL_VALUE}" in status["error"]
