"""History and alerting for one ``kiln serve``: built from flags, started and stopped with it.

Both read the same collectors /metrics serves (``MetricsService.registry``), each on its
own thread at its own interval, so neither ever runs on the event loop.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kiln.metrics.app import MetricsService
from kiln.monitoring.alerts import AlertEvaluator
from kiln.monitoring.fleet import FleetOptions, FleetScraper
from kiln.monitoring.history import HistoryOptions, HistoryRecorder
from kiln.monitoring.notify import Notifier, WebhookOptions
from kiln.monitoring.rules import AlertRule
from kiln.monitoring.snapshot import Snapshot, take_snapshot


@dataclass(frozen=True, slots=True)
class MonitorOptions:
    history: HistoryOptions | None = None
    alert_rules: tuple[AlertRule, ...] = ()
    alert_eval_interval_s: float = 15.0
    webhooks: WebhookOptions = field(default_factory=WebhookOptions)
    fleet: FleetOptions = field(default_factory=FleetOptions)

    @property
    def enabled(self) -> bool:
        return self.history is not None or bool(self.alert_rules) or self.fleet.enabled


class MonitorService:
    def __init__(self, metrics: MetricsService, options: MonitorOptions, external_url: str) -> None:
        self.metrics = metrics
        self.options = options
        # The fleet's GPUs join every snapshot: history, alert rules and /api/live see them.
        self.fleet = FleetScraper(options.fleet) if options.fleet.enabled else None
        self.history = (
            HistoryRecorder(options.history, self.snapshot) if options.history is not None else None
        )
        self.alerts = (
            AlertEvaluator(
                list(options.alert_rules),
                self.snapshot,
                Notifier(options.webhooks),
                options.alert_eval_interval_s,
                external_url,
            )
            if options.alert_rules
            else None
        )

    def snapshot(self) -> Snapshot:
        snap = self._local_snapshot()
        if self.fleet is not None:
            for name, values in self.fleet.values().items():
                snap.values.setdefault(name, {}).update(values)
        return snap

    def _local_snapshot(self) -> Snapshot:
        for _ in range(3):
            try:
                return take_snapshot(self.metrics.registry.collect())
            except RuntimeError:
                # A model (un)loaded on the event loop while this thread walked the
                # runtimes ("dictionary changed size during iteration"): read again.
                continue
        return take_snapshot(self.metrics.registry.collect())

    def start(self) -> None:
        if self.fleet is not None:
            self.fleet.start()
        if self.history is not None:
            self.history.start()
        if self.alerts is not None:
            self.alerts.start()

    def stop(self) -> None:
        if self.alerts is not None:
            self.alerts.stop()
        if self.history is not None:
            self.history.stop()
        if self.fleet is not None:
            self.fleet.stop()
