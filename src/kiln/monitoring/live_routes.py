"""``GET /api/live`` and the ``/dashboard`` page on the HTTP port (schema in docs/monitoring.md).

``/api/live`` is one JSON snapshot of what a viewer needs right now: per-model state,
totals and short-window rates, host or GPU figures, current alerts, and whether history
is there to fill the charts' past. The dashboard and ``kiln monitor URL`` both read it.
"""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import RedirectResponse, Response
from starlette.routing import BaseRoute, Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kiln.dashboard import STATIC_DIR
from kiln.metrics.app import MetricsService
from kiln.monitoring.live import LiveTracker
from kiln.monitoring.routes import MonitorBusy, busy_response, json_response, monitor_read
from kiln.monitoring.service import MonitorOptions, MonitorService
from kiln.server.server import Server


def _history_status(monitor: MonitorService | None) -> dict[str, Any]:
    history = monitor.history if monitor is not None else None
    if history is None:
        return {"enabled": False, "available": False, "interval": None, "error": ""}
    return {
        "enabled": True,
        "available": history.available,
        "interval": history.options.interval_s,
        "error": history.error,
    }


def merge_models(
    index: list[dict[str, str]], figures: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """Every model the repository knows (state, reason), with its figures where it has any."""
    by_key = {(f["model"], f["version"]): f for f in figures}
    rows: list[dict[str, Any]] = []
    for entry in index:
        key = (entry["name"], entry["version"])
        row = by_key.pop(key, None) or {"model": key[0], "version": key[1], "totals": None}
        row.setdefault("rates", None)
        rows.append({**row, "state": entry["state"], "reason": entry["reason"]})
    # Figures of a version no longer in the index (just unloaded): still worth showing.
    rows.extend({**f, "state": "", "reason": ""} for f in by_key.values())
    return rows


# The page must not be framed by another site (clickjacking) nor have a response sniffed
# into another type; a policy a response already has keeps its directives.
_NOSNIFF = (b"x-content-type-options", b"nosniff")
_FRAME_ANCESTORS = b"frame-ancestors 'none'"


def page_headers(raw: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    out = [(k, v) for k, v in raw if k.lower() != b"x-content-type-options"]
    out.append(_NOSNIFF)
    for i, (k, v) in enumerate(out):
        if k.lower() == b"content-security-policy":
            out[i] = (k, v.rstrip(b"; ") + b"; " + _FRAME_ANCESTORS)
            return out
    out.append((b"content-security-policy", _FRAME_ANCESTORS))
    return out


class DashboardHeaders:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": page_headers(list(message.get("headers", [])))}
            await send(message)

        await self.app(scope, receive, send_with_headers)


def live_routes(
    server: Server, metrics: MetricsService | None, monitor: MonitorService | None
) -> list[BaseRoute]:
    tracker: LiveTracker | None = None
    if monitor is not None:
        tracker = LiveTracker(monitor.snapshot)
    elif metrics is not None:
        # No history and no rules: a bare service only for its (retrying) snapshot.
        tracker = LiveTracker(MonitorService(metrics, MonitorOptions(), "").snapshot)

    async def live(request: Request) -> Response:
        if tracker is None:
            return json_response(
                {
                    "error": "live figures need the metrics collectors: start kiln serve "
                    "without --no-allow-metrics, or with history or alerts on"
                },
                503,
            )
        try:
            summary = await monitor_read(tracker.summary)
        except MonitorBusy as exc:
            return busy_response(exc)
        summary["models"] = merge_models(server.repository_index(), summary["models"])
        alerts = monitor.alerts if monitor is not None else None
        summary["alerting"] = {
            "enabled": alerts is not None,
            "rules": len(alerts.rules) if alerts is not None else 0,
        }
        summary["alerts"] = alerts.to_json()["alerts"] if alerts is not None else []
        summary["history"] = _history_status(monitor)
        summary["rollouts"] = server.rollouts.to_json()  # docs/rollouts.md
        return json_response(summary)

    async def to_page(request: Request) -> Response:
        redirect = RedirectResponse("/dashboard/", 307)
        redirect.raw_headers = page_headers(redirect.raw_headers)
        return redirect

    return [
        Route("/api/live", live, methods=["GET"]),
        Route("/dashboard", to_page, methods=["GET"]),
        Mount(
            "/dashboard",
            DashboardHeaders(StaticFiles(directory=STATIC_DIR, html=True)),
            name="dashboard",
        ),
    ]
