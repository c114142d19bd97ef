"""``kiln monitor --agent H:P [--agent ...] [--prometheus URL] [URL]``: every host's GPUs.

With agents or a Prometheus the terminal scrapes them itself (``FleetScraper``) and
evaluates ``--alert-rules`` files on what it read (kiln's evaluator, the rules files
unchanged); with a server URL too, the server's own view is shown above the fleet.
A server started with ``--monitor-agent`` already carries its fleet in ``/api/live``.
"""

from __future__ import annotations

import time
from datetime import datetime
from pathlib import Path
from typing import Any

from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.table import Table
from rich.text import Text

from kiln.monitoring.alerts import AlertEvaluator
from kiln.monitoring.fleet import FleetOptions, FleetScraper, fleet_figures
from kiln.monitoring.history_cli import HistoryClientError
from kiln.monitoring.live_cli import Column, _n, alerts_text, fetch_live, fitted_table, frame
from kiln.monitoring.notify import Notifier, WebhookOptions
from kiln.monitoring.rules import load_rules

FLEET_COLUMNS = [
    Column("host", 0, "left"), Column("gpu", 0), Column("model", 3, "left"),
    Column("util %", 1), Column("memory GiB", 1), Column("temp °C", 1), Column("power W", 2),
    Column("xid", 4),
]  # fmt: skip


def fleet_table(rows: list[dict[str, Any]], width: int | None = None) -> Table:
    cells: list[list[RenderableType]] = []
    for r in rows:
        used, free = r.get("memory_used_mib"), r.get("memory_free_mib")
        total = used + free if used is not None and free is not None else None
        temp = r.get("temperature_celsius")
        xid = r.get("xid")
        cells.append([
            r["host"],
            r["gpu"],
            r["model_name"] or "-",
            _n(r.get("utilization_percent"), 0),
            f"{_n(used, 1, 1 / 1024)} / {_n(total, 1, 1 / 1024)}",
            Text(_n(temp, 0), style="red" if temp is not None and temp >= 85 else ""),
            _n(r.get("power_watts"), 0),
            Text(_n(xid, 0), style="red" if xid else ""),
        ])  # fmt: skip
    return fitted_table(f"fleet: {len(rows)} GPU(s)", FLEET_COLUMNS, cells, width)


def targets_text(targets: list[dict[str, Any]]) -> Text:
    down = [t for t in targets if not t["up"]]
    if not down:
        return Text(f"sources: {len(targets)} up", style="green")
    text = Text()
    for t in down:
        text.append(f"DOWN {t['source']}: {t['error'] or 'no answer yet'}\n", style="red")
    return text


class FleetView:
    def __init__(
        self, options: FleetOptions, url: str | None, rules: list[Path], api_key: str | None
    ) -> None:
        self.scraper = FleetScraper(options)
        self.url = url
        self.api_key = api_key
        loaded = [rule for path in rules for rule in load_rules(path)]
        self.alerts = (
            AlertEvaluator(loaded, self.scraper.snapshot, Notifier(WebhookOptions()), 1.0, "")
            if loaded
            else None
        )

    def refresh(self) -> None:
        self.scraper.scrape_once()
        if self.alerts is not None:
            self.alerts.evaluate_once()

    def frame(self, width: int | None) -> RenderableType:
        parts: list[RenderableType] = []
        if self.url is not None:
            try:
                parts.append(frame(self.url, fetch_live(self.url, api_key=self.api_key), width))
            except HistoryClientError as exc:
                parts.append(Text(str(exc), style="red"))
        else:
            when = datetime.now().strftime("%H:%M:%S")
            parts.append(Text(f"kiln fleet  ·  {when}", style="bold"))
        snap = self.scraper.snapshot()
        parts += [fleet_table(fleet_figures(snap), width), targets_text(self.scraper.targets())]
        if self.alerts is not None:
            summary = {
                "alerting": {"enabled": True, "rules": len(self.alerts.rules)},
                "alerts": self.alerts.to_json()["alerts"],
            }
            parts.append(alerts_text(summary))
        return Group(*parts)


def run_fleet(view: FleetView, interval: float, once: bool, console: Console | None = None) -> None:
    console = console or Console()
    view.refresh()
    if once:
        console.print(view.frame(console.width))
        return
    with Live(view.frame(console.width), console=console, auto_refresh=False) as live:
        try:
            while True:
                time.sleep(interval)
                view.refresh()
                live.update(view.frame(console.width), refresh=True)
        except KeyboardInterrupt:
            pass
