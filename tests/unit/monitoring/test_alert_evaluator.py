"""Alert states inactive -> pending -> firing -> resolved, and the notifications they send."""

from __future__ import annotations

from typing import Any

from kiln.monitoring.alerts import AlertEvaluator, render_template
from kiln.monitoring.notify import Notifier, WebhookOptions
from kiln.monitoring.rules import parse_rules
from kiln.monitoring.snapshot import Labels, Snapshot

RULES = """\
groups:
  - name: g
    rules:
      - alert: Pending
        expr: nv_inference_pending_request_count > 5
        for: 10s
        keep_firing_for: 5s
        labels: {severity: page}
        annotations:
          summary: "{{ $labels.model }} has {{ $value }} pending"
"""
MLP: Labels = (("model", "mlp"), ("version", "1"))


class Recorder(Notifier):
    """The real Notifier (log only, no webhooks) that also keeps what it was given."""

    def __init__(self) -> None:
        super().__init__(WebhookOptions())
        self.payloads: list[dict[str, Any]] = []

    def notify(self, payload: dict[str, object]) -> None:
        super().notify(payload)
        self.payloads.append(payload)


def _evaluator() -> tuple[AlertEvaluator, Recorder]:
    rec = Recorder()
    rules = parse_rules(RULES, "r.yaml")
    ev = AlertEvaluator(rules, lambda: Snapshot(0, {}), rec, 1.0, "http://kiln:8000")
    return ev, rec


def _at(ev: AlertEvaluator, ts: float, pending: float | None) -> None:
    values = {} if pending is None else {"nv_inference_pending_request_count": {MLP: pending}}
    ev.evaluate_once(Snapshot(1_700_000_000 + ts, values))


def _states(ev: AlertEvaluator) -> list[str]:
    return [a["state"] for a in ev.to_json()["alerts"]]


def test_pending_then_firing_then_resolved_with_keep_firing_for() -> None:
    ev, rec = _evaluator()
    _at(ev, 0, 1)
    assert _states(ev) == [] and ev.to_json()["rules"][0]["state"] == "inactive"
    _at(ev, 1, 9)
    assert _states(ev) == ["pending"] and rec.payloads == []
    _at(ev, 5, 9)
    assert _states(ev) == ["pending"]
    _at(ev, 11, 12)  # held for 10 s: fires
    assert _states(ev) == ["firing"]
    [firing] = rec.payloads
    assert firing["version"] == "4" and firing["status"] == "firing"
    assert firing["groupLabels"] == {"alertname": "Pending"}
    [alert] = firing["alerts"]
    assert alert["labels"] == {
        "alertname": "Pending",
        "model": "mlp",
        "version": "1",
        "severity": "page",
    }
    assert alert["annotations"] == {"summary": "mlp has 12 pending"}
    assert alert["startsAt"] == "2023-11-14T22:13:21.000Z"  # when it became pending
    assert alert["endsAt"] == "0001-01-01T00:00:00Z"
    assert alert["generatorURL"] == "http://kiln:8000/api/alerts"
    assert firing["commonLabels"]["alertname"] == "Pending"
    _at(ev, 13, 0)  # condition gone, but keep_firing_for 5 s
    assert _states(ev) == ["firing"] and len(rec.payloads) == 1
    _at(ev, 17, None)  # series gone too: 6 s since last true
    assert _states(ev) == ["resolved"]
    resolved = rec.payloads[1]
    assert resolved["status"] == "resolved"
    assert resolved["alerts"][0]["endsAt"] == "2023-11-14T22:13:37.000Z"
    assert resolved["alerts"][0]["fingerprint"] == alert["fingerprint"]
    _at(ev, 18, 9)  # a new episode of the same series starts from pending again
    assert _states(ev) == ["pending"] and len(rec.payloads) == 2


def test_pending_that_clears_never_notifies() -> None:
    ev, rec = _evaluator()
    _at(ev, 0, 9)
    _at(ev, 3, 0)
    assert _states(ev) == [] and rec.payloads == []


def test_a_failing_rule_reports_its_error_and_others_still_run() -> None:
    ev, _ = _evaluator()
    broken = parse_rules(RULES.replace("Pending", "Broken"), "r.yaml")[0]
    object.__setattr__(broken, "expr", None)  # evaluate() cannot handle it
    ev.rules.insert(0, broken)
    ev.status["Broken"] = type(ev.status["Pending"])()
    _at(ev, 0, 9)
    rules = {r["name"]: r for r in ev.to_json()["rules"]}
    assert rules["Broken"]["health"] == "err" and rules["Broken"]["lastError"]
    assert rules["Pending"]["health"] == "ok" and _states(ev) == ["pending"]


def test_templates() -> None:
    labels = {"model": "mlp"}
    assert render_template("{{ $labels.model }}: {{ $value }}", labels, 0.25) == "mlp: 0.25"
    assert render_template('{{ $value | printf "%.1f" }}', labels, 0.25) == "0.2"
    assert render_template("{{ $value | humanize }}", labels, 1234567) == "1.235M"
    assert render_template("{{$labels.missing}}x", labels, 1) == "x"
