"""Reports of ``kiln bench --openai``: terminal table, JSON, per-request CSV, latency PNG."""

from __future__ import annotations

import csv
import json
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from kiln.bench.llm_stats import METRICS, LLMBenchResult
from kiln.bench.options import BenchError

LABELS = {
    "ttft": "Time to first token",
    "tpot": "Time per output token (excl. 1st)",
    "itl": "Inter-token latency",
    "e2el": "End-to-end latency",
}
CSV_COLUMNS = [
    "index", "prompt_tokens", "output_tokens", "ttft_ms", "tpot_ms", "e2el_ms",
    "chunks", "finish_reason", "error",
]  # fmt: skip


def print_table(result: LLMBenchResult, console: Console) -> None:
    s = result.settings
    limit = s["max_concurrency"] or "none"
    title = (f"{result.model} · /v1/{result.endpoint} · {result.url} · rate {s['request_rate']}"
             f" · max concurrency {limit}")  # fmt: skip
    console.print(escape(title), highlight=False, soft_wrap=True)
    totals = Table(show_header=False)
    totals.add_column("figure")
    totals.add_column("value", justify="right")
    for name, value in (
        ("Successful requests", f"{result.completed}"),
        ("Failed requests", f"{result.failed}"),
        ("Benchmark duration (s)", f"{result.duration_s:.2f}"),
        ("Total input tokens", f"{result.total_input_tokens}"),
        ("Total output tokens", f"{result.total_output_tokens}"),
        ("Request throughput (req/s)", f"{result.request_throughput:.2f}"),
        ("Output token throughput (tok/s)", f"{result.output_throughput:.2f}"),
        ("Total token throughput (tok/s)", f"{result.total_token_throughput:.2f}"),
    ):
        totals.add_row(name, value)
    console.print(totals)
    latency = Table(title_justify="left")
    for name in ("latency (ms)", "mean", "p50", "p99"):
        latency.add_column(name, justify="right" if name != "latency (ms)" else "left")
    for m in METRICS:
        row = result.latency_ms[m]
        latency.add_row(LABELS[m], *(f"{row[k]:.2f}" for k in ("mean", "p50", "p99")))
    console.print(latency)
    for message, count in result.errors.items():
        console.print(f"[red]{count} failed:[/red] {escape(message)}", highlight=False,
                      soft_wrap=True)  # fmt: skip


def write_json(result: LLMBenchResult, path: Path) -> None:
    path.write_text(json.dumps(result.to_json(), indent=2) + "\n")


def write_csv(result: LLMBenchResult, path: Path) -> None:
    """One row per request (latencies in ms), for the user's own analysis."""
    with path.open("w", newline="") as f:
        out = csv.writer(f)
        out.writerow(CSV_COLUMNS)
        for r in result.results:
            tpot = r.tpot
            out.writerow([
                r.index, r.prompt_tokens, r.output_tokens, f"{r.ttft * 1e3:.3f}",
                "" if tpot is None else f"{tpot * 1e3:.3f}", f"{r.latency * 1e3:.3f}",
                r.chunks, r.finish_reason or "", r.error or "",
            ])  # fmt: skip


def write_plot(result: LLMBenchResult, path: Path) -> None:
    """Histograms of TTFT, TPOT, ITL and E2E latency over the successful requests."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise BenchError("--plot needs matplotlib: install kiln-serve[bench]") from None
    done = [r for r in result.results if r.ok]
    series = {
        "ttft": [r.ttft * 1e3 for r in done],
        "tpot": [t * 1e3 for r in done if (t := r.tpot) is not None],
        "itl": [gap * 1e3 for r in done for gap in r.itl],
        "e2el": [r.latency * 1e3 for r in done],
    }
    fig, axes = plt.subplots(2, 2, figsize=(10, 7), dpi=100)
    for ax, m in zip(axes.flat, METRICS, strict=True):
        values = series[m]
        if values:
            ax.hist(values, bins=min(50, max(5, len(values) // 4)), color="tab:blue", alpha=0.8)
            for key, style in (("p50", "--"), ("p99", ":")):
                ax.axvline(result.latency_ms[m][key], color="tab:red", linestyle=style,
                           label=f"{key} {result.latency_ms[m][key]:.1f} ms")  # fmt: skip
            ax.legend(fontsize=8)
        ax.set_title(LABELS[m], fontsize=10)
        ax.set_xlabel("ms")
        ax.grid(True, alpha=0.3)
    fig.suptitle(f"{result.model} · {result.completed} requests · "
                 f"{result.output_throughput:.1f} output tok/s")  # fmt: skip
    fig.tight_layout()
    fig.savefig(path, format="png")
    plt.close(fig)
