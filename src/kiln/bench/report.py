"""Reports of a run: the terminal table, perf_analyzer-like CSV, JSON, latency/throughput PNG."""

from __future__ import annotations

import csv
import json
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from kiln.bench.options import BenchError
from kiln.bench.runner import BenchResult
from kiln.bench.stats import LevelResult

# perf_analyzer's column names where it has the figure; kiln's additions after them.
CSV_COLUMNS = [
    "Concurrency", "Request Rate", "Inferences/Second", "Requests/Second",
    "Network+Server Send/Recv", "Server Queue", "Server Compute Input",
    "Server Compute Infer", "Server Compute Output",
    "Avg latency", "p50 latency", "p90 latency", "p95 latency", "p99 latency",
    "Requests", "Errors", "Dropped", "Late", "Stable", "Client CPU us/request",
]  # fmt: skip


def _level_label(level: LevelResult) -> str:
    return f"{level.concurrency}" if level.concurrency is not None else f"{level.request_rate:g}/s"


def _network_us(level: LevelResult) -> float:
    """Client-seen latency not spent in the server's queue or compute (perf_analyzer's split)."""
    return max(0.0, level.latency_us["avg"] - sum(level.server_us.values()))


def csv_rows(result: BenchResult) -> list[list[str]]:
    rows = [list(CSV_COLUMNS)]
    for lv in result.levels:
        lat, srv = lv.latency_us, lv.server_us
        rows.append([
            "" if lv.concurrency is None else str(lv.concurrency),
            "" if lv.request_rate is None else f"{lv.request_rate:g}",
            f"{lv.throughput:.2f}", f"{lv.requests_per_sec:.2f}",
            f"{_network_us(lv):.0f}", f"{srv['queue']:.0f}", f"{srv['compute_input']:.0f}",
            f"{srv['compute_infer']:.0f}", f"{srv['compute_output']:.0f}",
            *(f"{lat[k]:.0f}" for k in ("avg", "p50", "p90", "p95", "p99")),
            str(lv.requests), str(lv.errors), str(lv.dropped), str(lv.late),
            str(lv.stable).lower(), f"{lv.client_cpu_us_per_request:.1f}",
        ])  # fmt: skip
    return rows


def write_csv(result: BenchResult, path: Path) -> None:
    with path.open("w", newline="") as f:
        csv.writer(f).writerows(csv_rows(result))


def write_json(result: BenchResult, path: Path) -> None:
    path.write_text(json.dumps(result.to_json(), indent=2) + "\n")


def print_table(result: BenchResult, console: Console) -> None:
    o = result.options
    title = f"{o.model} · {result.encoding} · {o.url} · batch {o.batch_size}" + (
        " · shm" if o.shared_memory == "system" else ""
    )
    if result.spec.sequence:
        title += f" · sequences of {o.sequence_length}"
    streaming = result.streaming
    if streaming:
        title += " · streaming"
    table = Table(title=title, title_justify="left")
    first = "concurrency" if not o.open_loop else "rate"
    names = [first, "infer/s", "avg ms", "p50 ms", "p90 ms", "p95 ms", "p99 ms", "queue µs",
             "in µs", "infer µs", "out µs", "errors", "client CPU µs/req"]  # fmt: skip
    for name in names:
        table.add_column(name, justify="right")
    if o.open_loop:
        table.add_column("dropped/late", justify="right")
    if streaming:
        table.add_column("responses/s", justify="right")
    for lv in result.levels:
        lat, srv = lv.latency_us, lv.server_us
        stable = "" if lv.stable else " *"
        row = [
            _level_label(lv) + stable, f"{lv.throughput:,.1f}",
            *(f"{lat[k] / 1e3:.2f}" for k in ("avg", "p50", "p90", "p95", "p99")),
            *(f"{srv[k]:.0f}" for k in ("queue", "compute_input", "compute_infer",
                                        "compute_output")),
            str(lv.errors), f"{lv.client_cpu_us_per_request:.0f}",
        ]  # fmt: skip
        if o.open_loop:
            row.append(f"{lv.dropped}/{lv.late}")
        if streaming:
            row.append(f"{lv.responses_per_sec:,.1f}")
        table.add_row(*row)
    console.print(table)
    if any(not lv.stable for lv in result.levels):
        console.print(
            f"* not stable within {o.stability_percentage:g}% after {o.max_trials} windows; "
            "figures are from the last 3 windows"
        )
    if o.percentile is not None:
        console.print(f"stability judged on p{o.percentile} latency")
    total = result.total_requests + result.total_errors
    console.print(
        f"{total} requests sent, {result.total_errors} failed"
        + (f", {result.total_dropped} dropped (outstanding limit)" if result.total_dropped else "")
    )
    if result.first_error:
        console.print(
            f"[red]first error:[/red] {escape(result.first_error)}", highlight=False, soft_wrap=True
        )


def write_plot(result: BenchResult, path: Path) -> None:
    """Latency (avg, p50, p99) against throughput, one point per level."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise BenchError("--plot needs matplotlib: install kiln-serve[bench]") from None
    levels = sorted(result.levels, key=lambda lv: lv.throughput)
    x = [lv.throughput for lv in levels]
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=100)
    for key, style in (("avg", "o-"), ("p50", "s--"), ("p99", "^-")):
        ax.plot(x, [lv.latency_us[key] / 1e3 for lv in levels], style, label=key)
    for lv in levels:
        ax.annotate(_level_label(lv), (lv.throughput, lv.latency_us["p99"] / 1e3),
                    textcoords="offset points", xytext=(4, 4), fontsize=8)  # fmt: skip
    ax.set_xlabel("throughput (inferences/s)")
    ax.set_ylabel("latency (ms)")
    ax.set_title(f"{result.options.model} · {result.encoding} · batch {result.options.batch_size}")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, format="png")
    plt.close(fig)
