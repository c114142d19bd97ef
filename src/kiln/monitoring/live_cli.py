"""``kiln monitor URL``: the dashboard's live figures in a terminal (for people on SSH).

Reads ``GET URL/api/live`` (schema in docs/monitoring.md) every ``interval`` seconds and
redraws one rich frame: per-model rates, the LLM engine's figures when an llm model is
loaded, host or GPU figures, alerts.
"""

from __future__ import annotations

import io
import time
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from rich.console import Console, Group, JustifyMethod, RenderableType
from rich.live import Live
from rich.measure import Measurement
from rich.table import Table
from rich.text import Text

from kiln.monitoring.history_cli import HistoryClientError, base_url, fetch_json

MiB, GiB = 2**20, 2**30


def fetch_live(url: str, timeout: float = 10.0, api_key: str | None = None) -> dict[str, Any]:
    return fetch_json(f"{base_url(url)}/api/live", timeout, api_key)


def _n(v: float | None, digits: int = 1, scale: float = 1.0) -> str:
    return "-" if v is None else f"{v * scale:.{digits}f}"


@dataclass(frozen=True, slots=True)
class Column:
    """A column of a live table; ``rank`` 0 is always shown, higher ranks go first when the
    terminal is too narrow for every column."""

    name: str
    rank: int
    justify: JustifyMethod = "right"


def fitted_table(
    title: str, columns: list[Column], rows: list[list[RenderableType]], width: int | None
) -> Table:
    """A table of ``rows`` that fits ``width`` without cutting a cell: the highest-ranked
    columns (the rightmost first among equals) are dropped until it fits, and the caption
    says how many. Names (rank 0, left-aligned) fold rather than end in "…"."""
    keep = list(range(len(columns)))
    while True:
        table = Table(title=title)
        for i in keep:
            c = columns[i]
            table.add_column(c.name, justify=c.justify, no_wrap=c.rank > 0,
                             overflow="fold" if c.rank == 0 else "ellipsis")  # fmt: skip
        for row in rows:
            table.add_row(*(row[i] for i in keep))
        droppable = [i for i in keep if columns[i].rank > 0]
        if width is None or not droppable or _width(table) <= width:
            break
        keep.remove(max(droppable, key=lambda i: (columns[i].rank, i)))
    hidden = len(columns) - len(keep)
    if hidden:
        table.caption = f"{hidden} column{'s' * (hidden > 1)} hidden: a wider terminal shows them"
    return table


def _width(table: Table) -> int:
    console = Console(width=10_000, file=io.StringIO())
    return Measurement.get(console, console.options, table).maximum


MODEL_COLUMNS = [
    Column("model", 0, "left"), Column("version", 2, "left"), Column("state", 0, "left"),
    Column("requests", 2), Column("errors", 1), Column("infer/s", 1), Column("p50 ms", 2),
    Column("p99 ms", 1), Column("queue µs", 3), Column("compute µs", 3), Column("batch", 4),
    Column("pending", 3),
]  # fmt: skip


def models_table(summary: dict[str, Any], width: int | None = None) -> Table:
    rows: list[list[RenderableType]] = []
    for m in summary["models"]:
        t, r = m["totals"] or {}, m["rates"] or {}
        state = Text(m["state"] or "?", style="green" if m["state"] == "READY" else "red")
        errors = t.get("failure", 0)
        rows.append([
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
        ])  # fmt: skip
    title = f"models (rates over the last {summary['window_s']:.0f} s)"
    return fitted_table(title, MODEL_COLUMNS, rows, width)


LLM_COLUMNS = [
    Column("model", 0, "left"), Column("running", 1), Column("waiting", 1),
    Column("KV cache %", 1), Column("prompt tok/s", 3), Column("gen tok/s", 1),
    Column("prefix hit %", 3), Column("TTFT p50 ms", 2), Column("TTFT p99 ms", 2),
    Column("ITL p50 ms", 3), Column("ITL p99 ms", 3), Column("preemptions", 2),
]  # fmt: skip


def llm_table(summary: dict[str, Any], width: int | None = None) -> Table:
    rows: list[list[RenderableType]] = []
    for m in summary["llm"]:
        preempted = m["preemptions"]
        rows.append([
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
        ])  # fmt: skip
    title = f"LLM engine (rates over the last {summary['window_s']:.0f} s)"
    return fitted_table(title, LLM_COLUMNS, rows, width)


GPU_COLUMNS = [Column("gpu", 0, "left"), Column("util %", 1), Column("memory GiB", 1),
               Column("temp °C", 2), Column("power W", 2)]  # fmt: skip
HOST_COLUMNS = [Column("host CPU %", 1), Column("kiln CPU % of a core", 2),
                Column("kiln RSS MiB", 2), Column("host memory GiB", 1)]  # fmt: skip


def resources_table(summary: dict[str, Any], width: int | None = None) -> Table:
    if summary["gpus"]:
        rows: list[list[RenderableType]] = []
        for g in summary["gpus"]:
            used, total = g.get("memory_used_bytes"), g.get("memory_total_bytes")
            rows.append([
                g["uuid"],
                _n(g.get("utilization"), 0, 100),
                f"{_n(used, 1, 1 / GiB)} / {_n(total, 1, 1 / GiB)}",
                _n(g.get("temperature_celsius"), 0),
                _n(g.get("power_watts"), 0),
            ])  # fmt: skip
        return fitted_table("GPUs", GPU_COLUMNS, rows, width)
    h = summary["host"]
    host_mem = (
        f"{_n(h['memory_used_bytes'], 1, 1 / GiB)} / {_n(h['memory_total_bytes'], 1, 1 / GiB)}"
    )
    row: list[RenderableType] = [
        _n(h["cpu_utilization"], 0, 100),
        _n(h["process_cpu_cores"], 0, 100),
        _n(h["process_rss_bytes"], 0, 1 / MiB),
        host_mem,
    ]
    return fitted_table("host (no GPU telemetry)", HOST_COLUMNS, [row], width)


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


def frame(url: str, summary: dict[str, Any], width: int | None = None) -> RenderableType:
    """One screen of the live view; ``width`` (the terminal's columns) drops the least
    important columns of a table that would not fit, instead of cutting every cell."""
    h = summary["history"]
    history = (
        f"history every {h['interval']:g}s"
        if h["available"]
        else ("history off" if not h["enabled"] else f"history unavailable: {h['error']}")
    )
    when = datetime.fromtimestamp(summary["ts"]).strftime("%H:%M:%S")
    header = Text(f"kiln {base_url(url)}  ·  {when}  ·  {history}", style="bold")
    parts: list[RenderableType] = [header, models_table(summary, width)]
    if summary.get("llm"):  # only when an llm model is loaded (and from servers that know)
        parts.append(llm_table(summary, width))
    parts.append(resources_table(summary, width))
    if summary.get("fleet"):  # a server started with --monitor-agent / --monitor-prometheus
        from kiln.monitoring.fleet_cli import fleet_table

        parts.append(fleet_table(summary["fleet"], width))
    if summary.get("rollouts"):  # docs/rollouts.md
        from kiln.metrics.rollout import rollouts_text

        parts.append(rollouts_text(summary["rollouts"]))
    return Group(*parts, alerts_text(summary))


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
        console.print(frame(url, summary, console.width))
        return
    with Live(frame(url, summary, console.width), console=console, auto_refresh=False) as live:
        try:
            while True:
                time.sleep(interval)
                try:
                    latest = fetch_live(url, api_key=api_key)
                    view: RenderableType = frame(url, latest, console.width)
                except HistoryClientError as exc:  # keep trying: the server may restart
                    view = Text(f"{exc} (retrying every {interval:g}s)", style="red")
                live.update(view, refresh=True)
        except KeyboardInterrupt:
            pass
