"""``kiln monitor compare``: one time window against another (the hour before a deployment
and the hour after), per series: mean, p50, p99 and max of the samples, and the change.

The samples come from a kiln server's history (``GET /api/history``, one point per sample:
the step is small enough that no two samples share a bucket unless the window is long) or
from Prometheus (``/api/v1/query_range``). Counters are compared as their per-second rate,
as ``/api/history`` returns them.
"""

from __future__ import annotations

import json
import math
import re
import time
import urllib.parse
from collections.abc import Callable
from datetime import datetime
from typing import Any

from kiln.monitoring.history_cli import HistoryClientError, base_url, fetch_history, fetch_json

MAX_POINTS = 10_000  # under /api/history's and Prometheus's 11,000 points per series
STATS = ("mean", "p50", "p99", "max")
_CLOCK = re.compile(r"^(\d{1,2}):(\d{2})$")
Fetch = Callable[[str, float, float, float], dict[str, list[float]]]  # series -> values


class CompareError(ValueError):
    pass


def _time(text: str, now: float) -> float:
    """HH:MM (today, local time), unix seconds, RFC 3339, ``now`` or ``now-<duration>``."""
    from kiln.monitoring.promql import parse_duration

    text = text.strip()
    m = _CLOCK.match(text)
    if m:
        day = datetime.fromtimestamp(now)
        return day.replace(hour=int(m[1]), minute=int(m[2]), second=0, microsecond=0).timestamp()
    if text == "now":
        return now
    if text.startswith("now-"):
        return now - parse_duration(text[4:])
    try:
        return float(text)
    except ValueError:
        return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


def parse_window(text: str, now: float | None = None) -> tuple[float, float]:
    """``13:00-14:00``, or ``START..END`` with any form ``_time`` reads."""
    now = time.time() if now is None else now
    if ".." in text:
        start_text, end_text = text.split("..", 1)
    elif text.count("-") == 1 and all(_CLOCK.match(p.strip()) for p in text.split("-")):
        start_text, end_text = text.split("-")
    else:
        raise CompareError(f"window '{text}': expected HH:MM-HH:MM or START..END")
    try:
        start, end = _time(start_text, now), _time(end_text, now)
    except ValueError as exc:
        raise CompareError(f"window '{text}': {exc}") from None
    if _CLOCK.match(start_text.strip()) and end <= start:
        end += 86400  # 23:00-01:00 crosses midnight
    if not end > start:
        raise CompareError(f"window '{text}': the end must be after the start")
    return start, end


def quantile(values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    xs = sorted(values)
    pos = q * (len(xs) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def stats(values: list[float]) -> dict[str, float] | None:
    if not values:
        return None
    return {
        "mean": sum(values) / len(values),
        "p50": quantile(values, 0.5),
        "p99": quantile(values, 0.99),
        "max": max(values),
        "samples": float(len(values)),
    }


def _series_key(labels: dict[str, str]) -> str:
    return ",".join(f"{k}={v}" for k, v in sorted(labels.items())) or "(all)"


def kiln_fetch(url: str, api_key: str | None = None) -> Fetch:
    def fetch(metric: str, start: float, end: float, step: float) -> dict[str, list[float]]:
        params = {"metric": metric, "start": repr(start), "end": repr(end), "step": repr(step)}
        result = fetch_history(url, params, api_key=api_key)
        return {
            _series_key(s["labels"]): [float(v) for _, v in s["points"] if v is not None]
            for s in result["series"]
        }

    return fetch


def prometheus_fetch(url: str) -> Fetch:
    def fetch(metric: str, start: float, end: float, step: float) -> dict[str, list[float]]:
        query = urllib.parse.urlencode(
            {"query": metric, "start": repr(start), "end": repr(end), "step": repr(step)}
        )
        doc = fetch_json(f"{base_url(url)}/api/v1/query_range?{query}")
        if doc.get("status") != "success":
            raise HistoryClientError(f"Prometheus: {doc.get('error', 'query failed')}")
        out = {}
        for item in doc["data"]["result"]:
            labels = {k: v for k, v in item["metric"].items() if k != "__name__"}
            out[_series_key(labels)] = [float(v) for _, v in item["values"]]
        return out

    return fetch


def compare(
    fetch: Fetch, metric: str, before: tuple[float, float], after: tuple[float, float]
) -> dict[str, Any]:
    windows = {}
    for name, (start, end) in (("before", before), ("after", after)):
        step = max(1.0, (end - start) / MAX_POINTS)
        windows[name] = fetch(metric, start, end, step)
    series = []
    for key in sorted(set(windows["before"]) | set(windows["after"])):
        b = stats(windows["before"].get(key, []))
        a = stats(windows["after"].get(key, []))
        change: dict[str, float | None] = {}
        for s in STATS:
            if a is None or b is None:
                change[s] = None
            else:
                change[s] = a[s] - b[s]
                change[f"{s}_percent"] = (a[s] - b[s]) / abs(b[s]) * 100 if b[s] else None
        series.append({"series": key, "before": b, "after": a, "change": change})
    return {
        "metric": metric,
        "before": {"start": before[0], "end": before[1]},
        "after": {"start": after[0], "end": after[1]},
        "series": series,
    }


def to_json(result: dict[str, Any]) -> str:
    return json.dumps(result, indent=2)


def _fmt(v: float | None) -> str:
    return "-" if v is None else f"{v:.4g}"


def _pct(v: float | None) -> str:
    return "" if v is None else f" ({v:+.1f} %)"


def print_compare(result: dict[str, Any], width: int | None = None) -> None:
    from rich.console import Console

    from kiln.monitoring.live_cli import Column, fitted_table

    columns = [Column("series", 0, "left")]
    for s in STATS:
        columns += [Column(f"{s} before", 2), Column(f"{s} after", 1)]
    columns.append(Column("samples", 3))
    rows: list[list[Any]] = []
    for item in result["series"]:
        b, a, c = item["before"] or {}, item["after"] or {}, item["change"]
        row: list[Any] = [item["series"]]
        for s in STATS:
            row += [_fmt(b.get(s)), _fmt(a.get(s)) + _pct(c.get(f"{s}_percent"))]
        row.append(f"{int(b.get('samples', 0))} / {int(a.get('samples', 0))}")
        rows.append(row)
    console = Console(width=width) if width else Console()
    fmt = "%Y-%m-%d %H:%M"
    spans = [
        f"{datetime.fromtimestamp(w['start']).strftime(fmt)} → "
        f"{datetime.fromtimestamp(w['end']).strftime('%H:%M')}"
        for w in (result["before"], result["after"])
    ]
    title = f"{result['metric']}: before {spans[0]}  vs  after {spans[1]}"
    if not rows:
        console.print(f"{title}: no samples in either window")
        return
    console.print(fitted_table(title, columns, rows, console.width))
