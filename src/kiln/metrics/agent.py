"""``kiln monitor agent``: a DCGM-compatible GPU exporter for any host, no model serving.

A poller thread reads NVML every ``--interval`` seconds (``TelemetryPoller``, as
``kiln serve`` does); a scrape of ``/metrics`` only renders the last sample, so a slow
NVML call never stalls a scrape. Nothing here imports torch or the serving stack.

Test hook: ``KILN_FAKE_NVML=module:attr`` makes the agent use that object (or the result of
calling it) instead of ``pynvml``, so tests drive a real agent process without a GPU.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import signal
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from kiln.metrics.dcgm import DcgmCollector
from kiln.metrics.exposition import CONTENT_TYPE, render
from kiln.metrics.gpu import load_nvml
from kiln.metrics.telemetry import TelemetryPoller

log = logging.getLogger(__name__)
FAKE_NVML_ENV = "KILN_FAKE_NVML"


class AgentError(RuntimeError):
    pass


def nvml_module() -> Any:
    spec = os.environ.get(FAKE_NVML_ENV)
    if not spec:
        return load_nvml()
    module, _, attr = spec.partition(":")
    if not attr:
        raise AgentError(f"{FAKE_NVML_ENV}={spec!r}: expected module:attribute")
    obj = getattr(importlib.import_module(module), attr)
    return obj() if callable(obj) and not hasattr(obj, "nvmlInit") else obj


class _Handler(BaseHTTPRequestHandler):
    server: _AgentHTTPServer

    def do_GET(self) -> None:
        path = self.path.split("?", 1)[0]
        if path == "/metrics":
            body, ctype, status = self.server.render(), CONTENT_TYPE, 200
        elif path in ("/", "/health"):
            body, ctype, status = b"kiln GPU agent: metrics at /metrics\n", "text/plain", 200
        else:
            body, ctype, status = b"not found\n", "text/plain", 404
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("%s " + format, self.address_string(), *args)


class _AgentHTTPServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, address: tuple[str, int], collector: DcgmCollector) -> None:
        super().__init__(address, _Handler)
        self.collector = collector
        self._lock = threading.Lock()

    def render(self) -> bytes:
        with self._lock:  # one reader of the collector's dicts at a time
            return render(self.collector.collect())


class Agent:
    def __init__(self, collector: DcgmCollector, host: str, port: int, interval_s: float) -> None:
        self.collector = collector
        self.poller = TelemetryPoller([collector], interval_s)
        self.http = _AgentHTTPServer((host, port), collector)

    @classmethod
    def create(cls, host: str, port: int, interval_s: float, nvml: Any = None) -> Agent:
        collector = DcgmCollector.create(nvml if nvml is not None else nvml_module())
        if collector is None:
            raise AgentError("no GPU to monitor: NVML is not available or lists no GPU")
        assert isinstance(collector, DcgmCollector)
        return cls(collector, host, port, interval_s)

    @property
    def port(self) -> int:
        return int(self.http.server_address[1])

    def serve_forever(self) -> None:
        self.collector.start_xid_watch()
        self.poller.start()
        log.info(
            "kiln GPU agent: %d GPU(s), http://%s:%d/metrics",
            len(self.collector.devices),
            *self.http.server_address[:2],
        )
        try:
            self.http.serve_forever(poll_interval=0.5)
        finally:
            self.poller.stop()
            self.collector.close()
            self.http.server_close()

    def shutdown(self) -> None:
        # serve_forever returns once the poll loop sees this; never call it on that thread.
        threading.Thread(target=self.http.shutdown, daemon=True).start()


def run_agent(host: str, port: int, interval_s: float) -> None:
    agent = Agent.create(host, port, interval_s)
    signal.signal(signal.SIGTERM, lambda *_: agent.shutdown())
    with contextlib.suppress(KeyboardInterrupt):
        agent.serve_forever()
