"""Alert evaluation: inactive -> pending -> firing -> resolved, as Prometheus does it.

A background thread takes a snapshot of every exported series each
``--alert-eval-interval-secs``, keeps enough of them in memory for the longest window a
rule looks back over, and evaluates every rule. A result series becomes an alert
(pending); once its condition has held for ``for:`` it fires; when the condition stops
holding it keeps firing for ``keep_firing_for:`` and then resolves. Firing and resolved
transitions go to the ``Notifier`` (log + webhooks), which only enqueues.
"""

from __future__ import annotations

import hashlib
import logging
import math
import re
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from kiln.monitoring.notify import Notifier
from kiln.monitoring.promql import max_range
from kiln.monitoring.promql_eval import evaluate
from kiln.monitoring.rules import TEMPLATE_EXPR, AlertRule
from kiln.monitoring.snapshot import Labels, Snapshot

log = logging.getLogger(__name__)

RESOLVED_RETENTION_S = 15 * 60  # how long /api/alerts still lists a resolved alert
MAX_SNAPSHOTS = 4096  # bounds memory whatever the windows and interval
ZERO_TIME = "0001-01-01T00:00:00Z"  # Alertmanager's "no end yet"


def rfc3339(ts: float) -> str:
    return datetime.fromtimestamp(ts, UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def _humanize(v: float) -> str:
    if v == 0 or math.isnan(v) or math.isinf(v):
        return f"{v:g}"
    for factor, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k"), (1, "")):
        if abs(v) >= factor:
            return f"{v / factor:.4g}{prefix}"
    for factor, prefix in ((1e-3, "m"), (1e-6, "u"), (1e-9, "n")):
        if abs(v) >= factor:
            return f"{v / factor:.4g}{prefix}"
    return f"{v:.4g}"


def render_template(text: str, labels: dict[str, str], value: float) -> str:
    def one(m: re.Match[str]) -> str:
        t = TEMPLATE_EXPR.match(m.group(1))
        if t is None:
            return m.group(0)
        if t.group("label"):
            return labels.get(t.group("label"), "")
        pipe = t.group("pipe") or ""
        if pipe == "humanize":
            return _humanize(value)
        if pipe.startswith("printf"):
            return pipe.split('"')[1] % value
        return f"{value:.6g}"

    return re.sub(r"{{\s*(.*?)\s*}}", one, text)


@dataclass(slots=True)
class Alert:
    rule: AlertRule
    labels: dict[str, str]
    value: float
    active_at: float
    last_true: float
    state: str = "pending"  # pending | firing | resolved
    fired_at: float | None = None
    resolved_at: float | None = None
    annotations: dict[str, str] = field(default_factory=dict)

    def to_json(self, generator_url: str) -> dict[str, Any]:
        """One entry of Alertmanager's webhook ``alerts`` list."""
        key = ",".join(f"{k}={v}" for k, v in sorted(self.labels.items()))
        return {
            "status": "resolved" if self.state == "resolved" else "firing",
            "labels": dict(self.labels),
            "annotations": dict(self.annotations),
            "startsAt": rfc3339(self.active_at),
            "endsAt": rfc3339(self.resolved_at) if self.resolved_at else ZERO_TIME,
            "generatorURL": generator_url,
            "fingerprint": hashlib.sha256(key.encode()).hexdigest()[:16],
        }


@dataclass(slots=True)
class RuleStatus:
    last_evaluation: float | None = None
    last_error: str = ""


class AlertEvaluator:
    def __init__(
        self,
        rules: list[AlertRule],
        source: Callable[[], Snapshot],
        notifier: Notifier,
        interval_s: float,
        external_url: str,
    ) -> None:
        self.rules = rules
        self.source = source
        self.notifier = notifier
        self.interval_s = interval_s
        self.external_url = external_url.rstrip("/")
        lookback = max((max_range(r.expr) for r in rules), default=0.0)
        self.lookback_s = lookback + 2 * interval_s
        self.window: deque[Snapshot] = deque(maxlen=MAX_SNAPSHOTS)
        self.alerts: dict[tuple[str, Labels], Alert] = {}
        self.status = {r.name: RuleStatus() for r in rules}
        self._lock = threading.Lock()  # guards alerts/status against /api/alerts readers
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def evaluate_once(self, snapshot: Snapshot | None = None) -> None:
        snap = snapshot if snapshot is not None else self.source()
        self.window.append(snap)
        while self.window and self.window[0].ts < snap.ts - self.lookback_s:
            self.window.popleft()
        for rule in self.rules:
            try:
                result = evaluate(rule.expr, self.window)
                error = ""
            except Exception as exc:  # one bad rule must not stop the others
                result, error = {}, f"{type(exc).__name__}: {exc}"
                log.error("alert rule %s (%s) failed: %s", rule.name, rule.source, error)
            with self._lock:
                self.status[rule.name] = RuleStatus(snap.ts, error)
                changed = self._update(rule, result if isinstance(result, dict) else {}, snap.ts)
            if changed:
                self.notifier.notify(self._payload(rule, changed))

    def _update(self, rule: AlertRule, result: dict[Labels, float], now: float) -> list[Alert]:
        changed: list[Alert] = []
        seen: set[tuple[str, Labels]] = set()
        for series, value in result.items():
            labels = {**dict(series), **rule.labels, "alertname": rule.name}
            key = (rule.name, tuple(sorted(labels.items())))
            seen.add(key)
            alert = self.alerts.get(key)
            if alert is None or alert.state == "resolved":
                alert = self.alerts[key] = Alert(rule, labels, value, now, now)
            alert.value, alert.last_true = value, now
            alert.annotations = {
                k: render_template(v, labels, value) for k, v in rule.annotations.items()
            }
            if alert.state == "pending" and now - alert.active_at >= rule.for_s:
                alert.state, alert.fired_at = "firing", now
                changed.append(alert)
        for key, alert in list(self.alerts.items()):
            if key[0] != rule.name or key in seen:
                continue
            if alert.state == "pending":
                del self.alerts[key]  # never fired: back to inactive, nobody was told
            elif alert.state == "firing" and now - alert.last_true >= rule.keep_firing_for_s:
                alert.state, alert.resolved_at = "resolved", now
                changed.append(alert)
            elif alert.state == "resolved" and now - (alert.resolved_at or now) > (
                RESOLVED_RETENTION_S
            ):
                del self.alerts[key]
        return changed

    def _payload(self, rule: AlertRule, alerts: list[Alert]) -> dict[str, Any]:
        entries = [a.to_json(f"{self.external_url}/api/alerts") for a in alerts]
        common_labels = dict(set.intersection(*(set(e["labels"].items()) for e in entries)))
        common_ann = dict(set.intersection(*(set(e["annotations"].items()) for e in entries)))
        firing = any(e["status"] == "firing" for e in entries)
        return {
            "version": "4",
            "groupKey": f'{{}}:{{alertname="{rule.name}"}}',
            "truncatedAlerts": 0,
            "status": "firing" if firing else "resolved",
            "receiver": "kiln",
            "groupLabels": {"alertname": rule.name},
            "commonLabels": common_labels,
            "commonAnnotations": common_ann,
            "externalURL": self.external_url,
            "alerts": entries,
        }

    def firing(self, model: str, version: int) -> str | None:
        """The name of an alert firing for this model version (its ``model`` and
        ``version`` labels), for a rollout's guard; None when none is."""
        with self._lock:
            for a in self.alerts.values():
                labels = a.labels
                if (
                    a.state == "firing"
                    and labels.get("model") == model
                    and labels.get("version") == str(version)
                ):
                    return a.rule.name
        return None

    def to_json(self) -> dict[str, Any]:
        """Current state of every rule and alert (``GET /api/alerts``)."""
        with self._lock:
            alerts = sorted(self.alerts.values(), key=lambda a: (a.rule.name, a.active_at))
            rules = []
            for rule in self.rules:
                states = {a.state for a in alerts if a.rule.name == rule.name}
                state = next((s for s in ("firing", "pending") if s in states), "inactive")
                st = self.status[rule.name]
                rules.append(
                    {
                        "name": rule.name,
                        "group": rule.group,
                        "expr": rule.expr_text,
                        "for": rule.for_s,
                        "keep_firing_for": rule.keep_firing_for_s,
                        "labels": rule.labels,
                        "annotations": rule.annotations,
                        "state": state,
                        "health": "err" if st.last_error else "ok",
                        "lastError": st.last_error,
                        "lastEvaluation": rfc3339(st.last_evaluation)
                        if st.last_evaluation
                        else None,
                        "source": rule.source,
                    }
                )
            return {
                "alerts": [
                    {
                        "name": a.rule.name,
                        "state": a.state,
                        "labels": a.labels,
                        "annotations": a.annotations,
                        "value": a.value,
                        "activeAt": rfc3339(a.active_at),
                        "firedAt": rfc3339(a.fired_at) if a.fired_at else None,
                        "resolvedAt": rfc3339(a.resolved_at) if a.resolved_at else None,
                    }
                    for a in alerts
                ],
                "rules": rules,
            }

    # ---- thread ----------------------------------------------------------------------
    def start(self) -> None:
        self.notifier.start()
        self._thread = threading.Thread(target=self._run, name="kiln-alerts", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.evaluate_once()
            except Exception:  # alerting must never take the server down
                log.exception("alert evaluation failed")

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self.notifier.stop()
