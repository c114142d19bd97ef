"""``/api/history`` and ``/api/alerts`` on the HTTP port (JSON; schema in docs/monitoring.md).

Kept apart from the KServe routes in ``app.py``: these serve monitoring, not inference.
SQLite reads run on a worker thread; alert state is copied under its lock.
"""

from __future__ import annotations

import asyncio
import math
import sqlite3
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime
from typing import Any, TypeVar

import orjson
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from kiln.monitoring.history_query import HistoryQuery, HistoryQueryError, catalog, run_query
from kiln.monitoring.promql import parse_duration
from kiln.monitoring.service import MonitorService

T = TypeVar("T")
DEFAULT_RANGE_S = 3600.0
DEFAULT_POINTS = 240
# Monitoring reads run on workers of their own: asyncio's default executor decodes large
# inference bodies, inflates gRPC messages and tokenizes prompts, and a burst of slow
# history queries must not make inference wait. Reads running and waiting are bounded.
MONITOR_READ_WORKERS = 2
MAX_MONITOR_READS = 256


class _Reads:
    executor = ThreadPoolExecutor(MONITOR_READ_WORKERS, thread_name_prefix="kiln-monitor-read")
    in_flight = 0  # running and waiting, on the event loop's thread only


class MonitorBusy(Exception):
    pass


async def monitor_read(fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` on the monitoring workers; ``MonitorBusy`` when too many wait."""
    if _Reads.in_flight >= MAX_MONITOR_READS:
        raise MonitorBusy(
            f"too many monitoring reads at once ({MAX_MONITOR_READS}): try again shortly"
        )
    _Reads.in_flight += 1
    try:
        return await asyncio.get_running_loop().run_in_executor(_Reads.executor, fn, *args)
    finally:
        _Reads.in_flight -= 1


def busy_response(exc: MonitorBusy) -> Response:
    response = json_response({"error": str(exc)}, 503)
    response.headers["Retry-After"] = "1"
    return response


def json_response(obj: object, status: int = 200) -> Response:
    return Response(
        orjson.dumps(obj, option=orjson.OPT_SERIALIZE_NUMPY), status, media_type="application/json"
    )


def parse_time(text: str, now: float, field: str) -> float:
    """Unix seconds, RFC 3339, ``now`` or ``now-10m``."""
    text = text.strip()
    if text == "now":
        return now
    if text.startswith("now-"):
        try:
            return now - parse_duration(text[4:])
        except ValueError as exc:
            raise HistoryQueryError(f"'{field}': {exc}") from None
    try:
        value = float(text)
        if math.isfinite(value):
            return value
    except ValueError:
        pass
    try:
        return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()
    except ValueError:
        raise HistoryQueryError(
            f"'{field}' must be unix seconds, RFC 3339, 'now' or 'now-<duration>', got '{text}'"
        ) from None


def parse_query(params: dict[str, str], interval_s: float, now: float) -> HistoryQuery:
    if "metric" not in params:
        raise HistoryQueryError("missing 'metric' (see GET /api/history/metrics)")
    end = parse_time(params.get("end", "now"), now, "end")
    start = parse_time(params.get("start", str(end - DEFAULT_RANGE_S)), now, "start")
    if "step" in params:
        text = params["step"]
        try:
            step = float(text)
        except ValueError:
            try:
                step = parse_duration(text)
            except ValueError as exc:
                raise HistoryQueryError(
                    f"'step' must be seconds or a duration like 30s, got '{text[:40]}'"
                    + (f": {exc}" if "out of range" in str(exc) else "")
                ) from None
    else:
        step = max(interval_s, (end - start) / DEFAULT_POINTS)
    raw = params.get("fn", "") == "raw"
    if params.get("fn", "raw") not in ("raw", "rate"):
        raise HistoryQueryError(f"'fn' must be 'rate' or 'raw', got '{params['fn']}'")
    return HistoryQuery(
        params["metric"], start, end, step, params.get("model", ""), params.get("version", ""), raw
    )


def monitor_routes(monitor: MonitorService | None) -> list[Route]:
    history = monitor.history if monitor is not None else None
    alerts = monitor.alerts if monitor is not None else None

    def history_unavailable() -> Response | None:
        if history is None:
            return json_response({"error": "history is disabled (kiln serve --no-history)"}, 503)
        if not history.available:
            return json_response({"error": f"history is unavailable: {history.error}"}, 503)
        return None

    async def history_metrics(request: Request) -> Response:
        down = history_unavailable()
        if down is not None or history is None:
            return down or json_response({}, 503)
        return json_response(
            {
                "metrics": catalog(),
                "interval": history.options.interval_s,
                "retention": history.options.retention_s,
                "path": str(history.options.path),
                "samples_written": history.samples_written,
                "error": history.error,
            }
        )

    async def history_query(request: Request) -> Response:
        down = history_unavailable()
        if down is not None or history is None:
            return down or json_response({}, 503)
        try:
            q = parse_query(dict(request.query_params), history.options.interval_s, time.time())
            result = await monitor_read(run_query, history.options.path, q)
        except MonitorBusy as exc:
            return busy_response(exc)
        except HistoryQueryError as exc:
            return json_response({"error": str(exc)}, 400)
        except sqlite3.Error as exc:
            return json_response({"error": f"history is unavailable: {exc}"}, 503)
        return json_response(result)

    async def alert_state(request: Request) -> Response:
        if alerts is None:
            return json_response({"alerts": [], "rules": []})
        return json_response(alerts.to_json())

    return [
        Route("/api/history", history_query, methods=["GET"]),
        Route("/api/history/metrics", history_metrics, methods=["GET"]),
        Route("/api/alerts", alert_state, methods=["GET"]),
    ]
