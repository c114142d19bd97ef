"""``kiln serve``'s history and alert flags, turned into ``MonitorOptions``.

Every bad value (a rules file with an unknown metric, a bad duration, bad YAML; a bad
retention; a webhook that is not an http(s) URL) stops ``kiln serve`` before it starts,
naming the flag, file and line.
"""

from __future__ import annotations

import os
import urllib.parse
from pathlib import Path

import click

from kiln.monitoring.fleet import FleetError, FleetOptions, target_url
from kiln.monitoring.history import HistoryOptions
from kiln.monitoring.notify import WebhookOptions
from kiln.monitoring.promql import parse_duration
from kiln.monitoring.rules import AlertRule, AlertRulesError, default_rules, load_rules
from kiln.monitoring.service import MonitorOptions


def default_history_path(http_port: int) -> Path:
    """Under the XDG state dir, one file per HTTP port: two servers never share one."""
    state = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(state) / "kiln" / f"history-{http_port}.db"


def monitor_options(
    *,
    http_port: int,
    history: bool,
    history_path: Path | None,
    history_interval_secs: float,
    history_retention: str,
    history_max_mb: int,
    alert_rules: tuple[Path, ...],
    default_alert_rules: bool,
    alert_eval_interval_secs: float,
    alert_webhooks: tuple[str, ...],
    alert_webhook_timeout_secs: float,
    monitor_agents: tuple[str, ...] = (),
    monitor_prometheus: str = "",
) -> MonitorOptions:
    try:
        retention = parse_duration(history_retention)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--history-retention") from None
    history_options = (
        HistoryOptions(
            history_path or default_history_path(http_port),
            history_interval_secs,
            retention,
            history_max_mb * 1024 * 1024,
        )
        if history
        else None
    )
    rules: list[AlertRule] = []
    try:
        for path in alert_rules:
            rules.extend(load_rules(path))
        if not alert_rules and default_alert_rules:
            rules = default_rules()
    except AlertRulesError as exc:
        raise click.BadParameter(str(exc), param_hint="--alert-rules") from None
    for url in alert_webhooks:
        parsed = urllib.parse.urlparse(url)
        if parsed.scheme not in ("http", "https") or not parsed.netloc:
            raise click.BadParameter(f"'{url}' is not an http(s) URL", param_hint="--alert-webhook")
    for address in monitor_agents:
        try:
            target_url(address)
        except FleetError as exc:
            raise click.BadParameter(str(exc), param_hint="--monitor-agent") from None
    if monitor_prometheus:
        parsed = urllib.parse.urlparse(monitor_prometheus)
        if parsed.scheme not in ("http", "https") or not parsed.netloc:
            raise click.BadParameter(
                f"'{monitor_prometheus}' is not an http(s) URL", param_hint="--monitor-prometheus"
            )
    # The fleet is scraped as often as history samples (or alerts evaluate, if sooner).
    interval = min(history_interval_secs, alert_eval_interval_secs)
    return MonitorOptions(
        history_options,
        tuple(rules),
        alert_eval_interval_secs,
        WebhookOptions(tuple(alert_webhooks), alert_webhook_timeout_secs),
        FleetOptions(tuple(monitor_agents), monitor_prometheus, interval),
    )
