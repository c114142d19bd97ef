"""Alert notifications: the log, and webhooks with an Alertmanager-compatible payload.

Each webhook URL has its own worker thread and bounded queue, so a receiver that hangs
delays only its own later notifications, never serving, the evaluator, or another
receiver. A failed POST (connection error, timeout, non-2xx) is retried with exponential
backoff; when a queue is full the newest notification is dropped and logged.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import urllib.error
import urllib.request
from dataclasses import dataclass

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class WebhookOptions:
    urls: tuple[str, ...] = ()
    timeout_s: float = 10.0
    max_attempts: int = 6
    backoff_s: float = 0.5  # first retry delay; doubles up to max_backoff_s
    max_backoff_s: float = 30.0
    queue_size: int = 256


class _Worker:
    def __init__(self, url: str, options: WebhookOptions, stop: threading.Event) -> None:
        self.url = url
        self.options = options
        self.stop = stop
        self.queue: queue.Queue[bytes] = queue.Queue(options.queue_size)
        self.thread = threading.Thread(target=self._run, name="kiln-alert-webhook", daemon=True)

    def offer(self, body: bytes) -> None:
        try:
            self.queue.put_nowait(body)
        except queue.Full:
            log.error("alert webhook %s: queue full, notification dropped", self.url)

    def _run(self) -> None:
        while not self.stop.is_set():
            try:
                body = self.queue.get(timeout=0.5)
            except queue.Empty:
                continue
            self._deliver(body)

    def _deliver(self, body: bytes) -> None:
        delay = self.options.backoff_s
        for attempt in range(1, self.options.max_attempts + 1):
            error = self._post(body)
            if error is None:
                return
            if attempt == self.options.max_attempts:
                log.error(
                    "alert webhook %s: giving up after %d attempts: %s", self.url, attempt, error
                )
                return
            log.warning(
                "alert webhook %s: attempt %d failed (%s); retrying in %.1fs",
                self.url,
                attempt,
                error,
                delay,
            )
            if self.stop.wait(delay):
                return
            delay = min(delay * 2, self.options.max_backoff_s)

    def _post(self, body: bytes) -> str | None:
        req = urllib.request.Request(
            self.url, body, {"Content-Type": "application/json"}, method="POST"
        )
        try:
            # The status says it was delivered; the body is not read: a receiver that kept
            # sending would hold this thread, and memory, for as long as it liked.
            with urllib.request.urlopen(req, timeout=self.options.timeout_s):
                pass
            return None
        except urllib.error.HTTPError as exc:
            return f"HTTP {exc.code}"
        except (urllib.error.URLError, OSError) as exc:
            reason = getattr(exc, "reason", exc)
            return f"{type(reason).__name__}: {reason}"


class Notifier:
    """Fans each notification out to the log and to every webhook's queue."""

    def __init__(self, options: WebhookOptions) -> None:
        self._stop = threading.Event()
        self.workers = [_Worker(url, options, self._stop) for url in options.urls]

    def start(self) -> None:
        for w in self.workers:
            w.thread.start()

    def notify(self, payload: dict[str, object]) -> None:
        """Never blocks: only enqueues."""
        for alert in payload.get("alerts", []):  # type: ignore[attr-defined]
            labels = alert["labels"]
            summary = alert["annotations"].get("summary", "")
            if alert["status"] == "firing":
                log.warning("alert %s FIRING %s: %s", labels["alertname"], labels, summary)
            else:
                log.info("alert %s resolved %s", labels["alertname"], labels)
        if self.workers:
            body = json.dumps(payload).encode()
            for w in self.workers:
                w.offer(body)

    def stop(self) -> None:
        self._stop.set()
        for w in self.workers:
            if w.thread.is_alive():
                w.thread.join(timeout=1)
