"""A daemon thread that samples host and GPU telemetry every ``--metrics-interval-ms``.

NVML calls can take milliseconds each; doing them on the scrape would stall the event
loop that also serves inference, so a scrape only reads the last sample (Triton's
"per interval" metrics work the same way).
"""

from __future__ import annotations

import logging
import threading
from typing import Protocol

log = logging.getLogger(__name__)


class Sampled(Protocol):
    def sample(self) -> None: ...


class TelemetryPoller:
    def __init__(self, sources: list[Sampled], interval_s: float) -> None:
        self.sources = sources
        self.interval_s = interval_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def sample_once(self) -> None:
        for source in self.sources:
            try:
                source.sample()
            except Exception:  # telemetry must never take the server down
                log.exception("telemetry sample from %s failed", type(source).__name__)

    def start(self) -> None:
        self.sample_once()  # the first scrape already has values
        self._thread = threading.Thread(target=self._run, name="kiln-telemetry", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sample_once()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
