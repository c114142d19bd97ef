"""Alerts of a real ``kiln serve``: a rule fires and resolves at a real webhook receiver;
receivers that hang or fail are retried and never slow serving; bad rules stop startup."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from kiln.examples import build_example_repository
from tests.conftest import KilnProcess
from tests.integration.monitor_helpers import get_json, infer_simple, wait_for

RULES = """\
groups:
  - name: test
    rules:
      - alert: SimpleBusy
        expr: sum by (model) (increase(nv_inference_request_success{model="simple"}[1s])) > 0
        for: 200ms
        labels: {severity: info}
        annotations:
          summary: "{{ $labels.model }} served {{ $value }} requests in 1s"
"""


class Receiver:
    """A loopback webhook receiver: ``ok`` answers 200, ``fail`` 500, ``hang`` never."""

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.bodies: list[dict[str, Any]] = []
        self.release = threading.Event()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                receiver.bodies.append(json.loads(body))
                if receiver.mode == "hang":
                    receiver.release.wait(30)
                    return
                self.send_response(200 if receiver.mode == "ok" else 500)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}/hook"

    def statuses(self) -> list[str]:
        return [b["status"] for b in list(self.bodies)]

    def close(self) -> None:
        self.release.set()
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def receivers() -> Iterator[dict[str, Receiver]]:
    made = {mode: Receiver(mode) for mode in ("ok", "fail", "hang")}
    yield made
    for r in made.values():
        r.close()


@pytest.fixture(scope="module")
def simple_repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("alerts") / "model_repository"
    build_example_repository(root, ["simple"])
    return root


def test_firing_then_resolved_at_webhooks_that_work_fail_and_hang(
    make_server: type[KilnProcess],
    simple_repo: Path,
    tmp_path: Path,
    receivers: dict[str, Receiver],
) -> None:
    rules = tmp_path / "rules.yaml"
    rules.write_text(RULES)
    args = ["--alert-rules", str(rules), "--alert-eval-interval-secs", "0.1",
            "--alert-webhook-timeout-secs", "0.3", "--no-history", "--no-allow-grpc"]  # fmt: skip
    for r in receivers.values():
        args += ["--alert-webhook", r.url]
    server = make_server(simple_repo, args=args).start()
    ok, fail, hang = receivers["ok"], receivers["fail"], receivers["hang"]

    served = 0

    def busy_until_firing() -> bool:
        nonlocal served
        served += infer_simple(server, 1)
        return "firing" in ok.statuses()

    wait_for(busy_until_firing, 60, "a firing notification")
    firing = ok.bodies[0]
    assert firing["version"] == "4" and firing["status"] == "firing"
    assert firing["receiver"] == "kiln" and firing["groupLabels"] == {"alertname": "SimpleBusy"}
    [alert] = firing["alerts"]
    assert alert["status"] == "firing"
    assert alert["labels"] == {"alertname": "SimpleBusy", "model": "simple", "severity": "info"}
    assert alert["annotations"]["summary"].startswith("simple served ")
    assert alert["endsAt"] == "0001-01-01T00:00:00Z"
    assert alert["generatorURL"] == f"http://{server.http_url}/api/alerts"
    assert set(firing) >= {"commonLabels", "commonAnnotations", "externalURL", "groupKey"}

    # The hanging receiver holds a connection and the failing one keeps answering 500:
    # both are retried, and serving goes on meanwhile.
    wait_for(lambda: len(hang.bodies) >= 2, 30, "a retry after the hanging webhook timed out")
    wait_for(lambda: len(fail.bodies) >= 2, 30, "a retry after HTTP 500")
    assert fail.bodies[0] == fail.bodies[1] == firing
    assert infer_simple(server, 20) == 20
    status, state = get_json(server, "/api/alerts")
    assert status == 200 and [a["state"] for a in state["alerts"]] == ["firing"]

    # No more requests: the 1 s increase drops to 0 and the alert resolves.
    wait_for(lambda: "resolved" in ok.statuses(), 30, "a resolved notification")
    resolved = next(b for b in ok.bodies if b["status"] == "resolved")
    assert resolved["alerts"][0]["labels"] == alert["labels"]
    assert resolved["alerts"][0]["fingerprint"] == alert["fingerprint"]
    assert resolved["alerts"][0]["endsAt"] != "0001-01-01T00:00:00Z"
    status, state = get_json(server, "/api/alerts")
    assert [a["state"] for a in state["alerts"]] == ["resolved"]
    assert state["rules"][0]["state"] == "inactive" and state["rules"][0]["health"] == "ok"
    assert "alert SimpleBusy FIRING" in server.log()
    assert "attempt 1 failed (HTTP 500)" in server.log()
    assert served >= 1 and infer_simple(server, 1) == 1
    assert server.stop() == 0  # a webhook still hanging does not block shutdown


BAD_RULES = [
    ("unknown metric", RULES.replace("nv_inference_request_success", "nv_requests"), 5,
     "alert 'SimpleBusy': expr: unknown metric 'nv_requests'"),
    ("bad duration", RULES.replace("for: 200ms", "for: 200 ms"), 6,
     "'for': invalid duration '200 ms'"),
    ("bad yaml", RULES.replace("labels: {severity: info}", "labels: {severity: info"), None,
     "invalid YAML"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("case", "text", "line", "reason"), BAD_RULES, ids=[b[0] for b in BAD_RULES]
)
def test_bad_rules_file_stops_kiln_serve_with_file_line_and_reason(
    simple_repo: Path, tmp_path: Path, case: str, text: str, line: int | None, reason: str
) -> None:
    rules = tmp_path / "rules.yaml"
    rules.write_text(text)
    out = subprocess.run(
        [sys.executable, "-m", "kiln", "serve", "--model-repository", str(simple_repo),
         "--alert-rules", str(rules)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 2
    assert "--alert-rules" in out.stderr and reason in out.stderr
    assert f"{rules}:{line}:" in out.stderr if line else f"{rules}:" in out.stderr


def test_bad_webhook_url_stops_kiln_serve(simple_repo: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "kiln", "serve", "--model-repository", str(simple_repo),
         "--alert-webhook", "localhost:9093/hook"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 2 and "'localhost:9093/hook' is not an http(s) URL" in out.stderr


def test_default_rules_are_loaded(kiln_server: KilnProcess) -> None:
    status, state = get_json(kiln_server, "/api/alerts")
    assert status == 200
    rules = {r["name"]: r for r in state["rules"]}
    assert set(rules) == {
        "KilnGpuTemperatureHigh", "KilnGpuMemoryNearFull", "KilnP99LatencyHigh",
        "KilnQueueTimeRising", "KilnErrorRatioHigh", "KilnModelNotReady",
        "KilnLLMTimeToFirstTokenHigh", "KilnLLMKVCachePressure", "KilnLLMPreemptions",
        "KilnLLMWaitingQueueHigh",
    }  # fmt: skip
    assert all(r["source"].startswith("<kiln>/default_rules.yaml:") for r in rules.values())
    assert all(r["health"] == "ok" for r in rules.values())
    assert not [a for a in state["alerts"] if a["state"] == "firing"]
