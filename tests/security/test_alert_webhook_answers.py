"""An alert webhook receiver's answer body is not kiln's business: the status says whether
the notification was delivered. Before, the notifier read the whole body, so a receiver
that answered 200 and then kept sending (or sent a byte at a time) held that webhook's
thread, and kiln's memory grew with what it sent; no later notification went out."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from kiln.monitoring.notify import Notifier, WebhookOptions


class _Receiver(BaseHTTPRequestHandler):
    received: list[str] = []
    done = threading.Event()

    def log_message(self, *args: object) -> None:
        pass

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.received.append(body["status"])
        self.send_response(200)
        self.send_header("Content-Type", "text/plain")
        self.end_headers()
        try:
            while not self.done.is_set():  # an answer without end
                self.wfile.write(b"x" * 65536)
                self.wfile.flush()
                time.sleep(0.01)
        except OSError:
            pass  # kiln closed the connection: what it should do


@pytest.fixture
def receiver() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Receiver)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_port}/hook"
    _Receiver.done.set()
    server.shutdown()


def test_an_endless_answer_does_not_hold_the_webhook(receiver: str) -> None:
    notifier = Notifier(WebhookOptions((receiver,), timeout_s=5))
    notifier.start()
    try:
        for status in ("firing", "resolved"):
            notifier.notify({"status": status, "alerts": []})
        for _ in range(3000):  # both delivered, the second after the first's endless answer
            if len(_Receiver.received) == 2:
                break
            time.sleep(0.01)
        assert _Receiver.received == ["firing", "resolved"]
    finally:
        _Receiver.done.set()
        notifier.stop()
