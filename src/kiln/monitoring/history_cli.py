"""``kiln monitor history URL``: a server's metrics history as rich tables, one per metric."""

from __future__ import annotations

import json
import urllib.error
import urllib.parse
import urllib.request
from datetime import datetime
from typing import Any

from rich.console import Console
from rich.table import Table

DEFAULT_METRICS = (
    "throughput",
    "avg_request_us",
    "avg_queue_us",
    "avg_compute_us",
    "kiln_request_duration_p99_seconds",
)


class HistoryClientError(Exception):
    pass


def base_url(url: str) -> str:
    if "://" not in url:
        url = "http://" + url
    return url.rstrip("/")


def fetch_json(full: str, timeout: float = 10.0, api_key: str | None = None) -> dict[str, Any]:
    """GET a kiln JSON endpoint; every failure becomes a HistoryClientError with the URL.
    ``api_key``: sent as ``Authorization: Bearer`` (servers started with --api-key)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        request = urllib.request.Request(full, headers=headers)
        with urllib.request.urlopen(request, timeout=timeout) as resp:
            return dict(json.loads(resp.read()))
    except urllib.error.HTTPError as exc:
        try:
            message = json.loads(exc.read()).get("error", "")
        except ValueError:
            message = ""
        if exc.code == 401:
            hint = "wrong API key" if api_key else "pass --api-key KEY or set KILN_API_KEY"
            message = f"{message} ({hint})"
        raise HistoryClientError(f"{full}: HTTP {exc.code}: {message}") from None
    except (urllib.error.URLError, OSError, ValueError) as exc:
        raise HistoryClientError(f"cannot reach {full}: {exc}") from None


def fetch_history(
    url: str, params: dict[str, str], timeout: float = 10.0, api_key: str | None = None
) -> dict[str, Any]:
    query = urllib.parse.urlencode(params)
    return fetch_json(f"{base_url(url)}/api/history?{query}", timeout, api_key)


def _series_name(labels: dict[str, str]) -> str:
    return " ".join(f"{k}={v}" for k, v in sorted(labels.items())) or "(server)"


def _fmt(v: float | None) -> str:
    if v is None:
        return "-"
    return f"{v:.4g}"


def history_table(result: dict[str, Any]) -> Table:
    series = result["series"]
    table = Table(title=f"{result['metric']} ({result['kind']}, step {result['step']:g}s)")
    table.add_column("time")
    for s in series:
        table.add_column(_series_name(s["labels"]), justify="right")
    times = sorted({p[0] for s in series for p in s["points"]})
    lookup = [{p[0]: p[1] for p in s["points"]} for s in series]
    for t in times:
        row = [datetime.fromtimestamp(t).strftime("%H:%M:%S")]
        row.extend(_fmt(values.get(t)) for values in lookup)
        table.add_row(*row)
    if not times:
        table.add_row("(no samples in range)", *["" for _ in series])
    return table


def print_history(
    url: str,
    metrics: list[str],
    since: str,
    step: str | None,
    model: str,
    console: Console | None = None,
    api_key: str | None = None,
) -> None:
    console = console or Console()
    for metric in metrics or DEFAULT_METRICS:
        params = {"metric": metric, "start": f"now-{since}", "end": "now"}
        if step:
            params["step"] = step
        if model:
            params["model"] = model
        console.print(history_table(fetch_history(url, params, api_key=api_key)))
