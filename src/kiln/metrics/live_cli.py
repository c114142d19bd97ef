"""``kiln monitor URL``: the dashboard's live figures in a terminal (for people on SSH).

Reads ``GET URL/api/live`` (schema in docs/monitoring.md) every ``interval`` seconds and
redraws one rich frame: per-model rates, the LLM engine's figures when an llm model is
loaded, host or GPU figures, alerts.
"""

from __future__ import annotations

import time
from datetime import datetime
from typing import Any

from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.table import Table
from rich.text import Text

from kiln.metrics.history_cli import HistoryClientError, base_url, fetch_json

MiB, GiB = 2**20, 2**30


def fetch_live(url: str, timeout: float = 10.0, api_key: str | None = None) -> dict[str, Any]:
    return fetch_json(f"{base_url(url)}/api/live", timeout, api_key)


def _n(v: float | None, digits: int = 1, scale: float = 1.0) -> str:
    return "-" if v is None else f"{v * scale:.{digits}f}"


def models_table(summary: dict[str, Any]) -> Table:
    table = Table(title=f"models (rates over the last {summary['window_s']:.0f} s)")
    for name in ("model", "version", "state"):
        table.add_column(name)
    for name in ("requests", "errors", "infer/s", "p50 ms", "p99 ms", "queue µs", "compute µs"):
        table.add_column(name, justify="right")
    table.add_column("batch", justify="right")
    table.add_column("pending", justify="right")
    for m in summary["models"]:
        t, r = m["totals"] or {}, m["rates"] or {}
        state = Text(m["state"] or "?", style="green" if m["state"] == "READY" else "red")
        errors = t.get("failure", 0)
        table.add_row(
            m["model"],
            m["version"] or "-",
            state,
            str(t.get("requests", 0)),
            Text(str(errors), style="red" if errors else ""),
            _n(r.get("throughput")),
            _n(r.get("p50_ms"), 2),
            _n(r.get("p99_ms"), 2),
            _n(r.get("avg_queue_us"), 0),
            _n(r.get("avg_compute_us"), 0),
            # the window's batch size when it had executions, else the lifetime average
            _n(r.get("avg_batch_size") or t.get("avg_batch_size"), 2),
            str(t.get("pending", 0)),
        )
    return table


def llm_table(summary: dict[str, Any]) -> Table:
    table = Table(title=f"LLM engine (rates over the last {summary['window_s']:.0f} s)")
    table.add_column("model")
    for name in (
        "running", "waiting", "KV cache %", "prompt tok/s", "gen tok/s", "prefix hit %",
        "TTFT p50 ms", "TTFT p99 ms", "ITL p50 ms", "ITL p99 ms", "preemptions",
    ):  # fmt: skip
        table.add_column(name, justify="right")
    for m in summary["llm"]:
        preempted = m["preemptions"]
        table.add_row(
            m["model"],
            str(m["running"]),
            str(m["waiting"]),
            _n(m["kv_cache_usage"], 1, 100),
            _n(m["prompt_tokens_per_s"]),
            _n(m["generation_tokens_per_s"]),
            _n(m["prefix_cache_hit_rate"], 1, 100),
            _n(m["ttft_p50_ms"]),
            _n(m["ttft_p99_ms"]),
            _n(m["itl_p50_ms"]),
            _n(m["itl_p99_ms"]),
            Text(str(preempted), style="yellow" if preempted else ""),
        )
    return table


def resources_table(summary: dict[str, Any]) -> Table:
    if summary["gpus"]:
        table = Table(title="GPUs")
        for name in ("gpu", "util %", "memory GiB", "temp °C", "power W"):
            table.add_column(name, justify="left" if name == "gpu" else "right")
        for g in summary["gpus"]:
            used, total = g.get("memory_used_bytes"), g.get("memory_total_bytes")
            memory = f"{_n(used, 1, 1 / GiB)} / {_n(total, 1, 1 / GiB)}"
            table.add_row(
                g["uuid"],
                _n(g.get("utilization"), 0, 100),
                memory,
                _n(g.get("temperature_celsius"), 0),
                _n(g.get("power_watts"), 0),
            )
        return table
    h = summary["host"]
    table = Table(title="host (no GPU telemetry)")
    for name in ("host CPU %", "kiln CPU % of a core", "kiln RSS MiB", "host memory GiB"):
        table.add_column(name, justify="right")
    host_mem = (
        f"{_n(h['memory_used_bytes'], 1, 1 / GiB)} / {_n(h['memory_total_bytes'], 1, 1 / GiB)}"
    )
    table.add_row(
        _n(h["cpu_utilization"], 0, 100),
        _n(h["process_cpu_cores"], 0, 100),
        _n(h["process_rss_bytes"], 0, 1 / MiB),
        host_mem,
    )
    return table


def alerts_text(summary: dict[str, Any]) -> Text:
    if not summary["alerting"]["enabled"]:
        return Text("alerts: off (no rules loaded)", style="dim")
    active = [a for a in summary["alerts"] if a["state"] in ("firing", "pending")]
    if not active:
        return Text(f"alerts: none firing ({summary['alerting']['rules']} rules)", style="green")
    text = Text("alerts:\n")
    for a in sorted(active, key=lambda a: (a["state"] != "firing", a["name"])):
        labels = " ".join(f"{k}={v}" for k, v in a["labels"].items() if k != "alertname")
        style = "bold red" if a["state"] == "firing" else "yellow"
        text.append(f"  {a['state'].upper():8}", style=style)
        text.append(f" {a['name']} {{{labels}}} {a['annotations'].get('summary', '')}\n")
    return text


def frame(url: str, summary: dict[str, Any]) -> RenderableType:
    h = summary["history"]
    history = (
        f"history every {h['interval']:g}s"
        if h["available"]
        else ("history off" if not h["enabled"] else f"history unavailable: {h['error']}")
    )
    when = datetime.fromtimestamp(summary["ts"]).strftime("%H:%M:%S")
    header = Text(f"kiln {base_url(url)}  ·  {when}  ·  {history}", style="bold")
    parts: list[RenderableType] = [header, models_table(summary)]
    if summary.get("llm"):  # only when an llm model is loaded (and from servers that know)
        parts.append(llm_table(summary))
    return Group(*parts, resources_table(summary), alerts_text(summary))


def run_live(
    url: str,
    interval: float,
    once: bool,
    console: Console | None = None,
    api_key: str | None = None,
) -> None:
    console = console or Console()
    summary = fetch_live(url, api_key=api_key)
    if once:
        if summary["window_s"] == 0:  # nobody asked before: a second reading gives rates
            time.sleep(interval)
            summary = fetch_live(url, api_key=api_key)
        console.print(frame(url, summary))
        return
    with Live(frame(url, summary), console=console, auto_refresh=False) as live:
        try:
            while True:
                time.sleep(interval)
                try:
                    view: RenderableType = frame(url, fetch_live(url, api_key=api_key))
                except HistoryClientError as exc:  # keep trying: the server may restart
                    view = Text(f"{exc} (retrying every {interval:g}s)", style="red")
                live.update(view, refresh=True)
        except KeyboardInterrupt:
            pass
