"""The optimize report: ``report.json`` (the numbers), ``report.md`` and ``report.html`` (plots).

Every figure in the Markdown and HTML is read from the same dict that becomes ``report.json``,
so the three files cannot disagree.
"""

from __future__ import annotations

import base64
import html
import io
import json
from pathlib import Path
from typing import Any


def _fmt(value: object, digits: int = 3) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def before_after(report: dict[str, Any]) -> list[tuple[str, str, str, str]]:
    """Rows (metric, before, after, change) for the FP32 baseline vs the chosen candidate."""
    base, chosen = report["baseline"], report["chosen"]
    if chosen is None:
        return []
    after = next(r for r in report["candidates"] if r["name"] == chosen)
    rows: list[tuple[str, str, str, str]] = []
    for b_before, b_after in zip(
        base["profile"]["batches"], after["profile"]["batches"], strict=True
    ):
        size = b_before["batch_size"]
        speedup = b_before["p50_ms"] / b_after["p50_ms"]
        rows.append(
            (f"p50 latency, batch {size} (ms)", _fmt(b_before["p50_ms"]),
             _fmt(b_after["p50_ms"]), f"{speedup:.2f}x faster")
        )  # fmt: skip
        rows.append(
            (f"throughput, batch {size} (/s)", _fmt(b_before["throughput"], 0),
             _fmt(b_after["throughput"], 0),
             f"{b_after['throughput'] / b_before['throughput']:.2f}x")
        )  # fmt: skip
    size_b, size_a = base["profile"]["file_size_mb"], after["profile"]["file_size_mb"]
    rows.append(("model file (MB)", _fmt(size_b), _fmt(size_a), f"{size_b - size_a:+.3f} MB saved"))
    rss_b, rss_a = base["profile"]["rss_mb"], after["profile"]["rss_mb"]
    rows.append(("host RSS added (MB)", _fmt(rss_b, 1), _fmt(rss_a, 1), f"{rss_b - rss_a:+.1f} MB"))
    gpu_b, gpu_a = base["profile"].get("gpu_mb"), after["profile"].get("gpu_mb")
    if gpu_b is not None or gpu_a is not None:
        saved = f"{gpu_b - gpu_a:+.1f} MB" if gpu_b is not None and gpu_a is not None else ""
        rows.append(("GPU memory added (MB)", _fmt(gpu_b, 1), _fmt(gpu_a, 1), saved))
    acc = after["accuracy"]
    if acc["task_accuracy"] is not None:
        rows.append(
            ("task accuracy", _fmt(base["task_accuracy"], 4), _fmt(acc["task_accuracy"], 4),
             f"{acc['task_accuracy'] - base['task_accuracy']:+.4f}")
        )  # fmt: skip
    rows.append((acc["drop_metric"], "0", _fmt(acc["drop"], 4), ""))
    return rows


def candidate_rows(report: dict[str, Any]) -> list[list[str]]:
    small = report["batch_sizes"][0]
    rows = []
    for r in report["candidates"]:
        acc, prof = r["accuracy"], r["profile"]
        at = next((b for b in prof["batches"] if b["batch_size"] == small), None) if prof else None
        rows.append([
            r["name"], r["status"], _fmt(acc["drop"], 4) if acc else "-",
            _fmt(acc["max_abs_error"], 4) if acc else "-",
            _fmt(at["p50_ms"]) if at else "-", _fmt(at["p99_ms"]) if at else "-",
            _fmt(prof["file_size_mb"]) if prof else "-",
            _fmt(prof.get("gpu_mb"), 1) if prof else "-", _fmt(r["build_seconds"], 2),
            r["reason"],
        ])  # fmt: skip
    return rows


_HEAD = ["candidate", "status", "accuracy drop", "max abs err", "p50 ms (b{b})", "p99 ms (b{b})",
         "size MB", "GPU MB", "build s", "reason"]  # fmt: skip


def markdown(report: dict[str, Any]) -> str:
    head = [h.format(b=report["batch_sizes"][0]) for h in _HEAD]
    lines = [f"# kiln optimize: {report['name']}", "", f"Model: `{report['model']}`", ""]
    if report["chosen"]:
        lines += [f"**Chosen: `{report['chosen']}`** ({report['why']})", ""]
    else:
        lines += [f"**Nothing met the constraints**: {report['why']}.", ""]
        if report["closest"]:
            lines += [f"Closest: `{report['closest']}`", ""]
    c = report["constraints"]
    lines += [
        f"Constraints: max accuracy drop {c['max_accuracy_drop']}, latency budget "
        f"{c['latency_budget_ms']} ms, objective {c['objective']}.", "",
    ]  # fmt: skip
    rows = before_after(report)
    if rows:
        lines += ["## Before (FP32 baseline) / after", "", "| metric | before | after | change |",
                  "|---|---|---|---|"]  # fmt: skip
        lines += [f"| {' | '.join(r)} |" for r in rows] + [""]
    lines += ["## Candidates", "", "| " + " | ".join(head) + " |",
              "|" + "---|" * len(head)]  # fmt: skip
    lines += ["| " + " | ".join(cell.replace("|", "/") for cell in r) + " |"
              for r in candidate_rows(report)]  # fmt: skip
    return "\n".join(lines + serving_lines(report)) + "\n"


def serving_lines(report: dict[str, Any]) -> list[str]:
    """The serving-config search: the grid, each point's numbers, the one written."""
    serving = report.get("serving") or {}
    if not serving.get("grid"):
        why = serving.get("why", "not run")
        return ["", "## Serving config", "", f"Not tuned: {why}."]
    lines = ["", "## Serving config", "",
             f"Measured through kiln's scheduler in process: {serving['concurrency']} concurrent "
             f"callers, one sample per request, {serving['seconds_per_config']} s per config, "
             f"max_batch_size {serving['max_batch_size']}.", ""]  # fmt: skip
    chosen = serving["chosen"]["label"] if serving.get("chosen") else None
    if chosen:
        lines += [f"**Written to config.pbtxt: {chosen}** ({serving['why']})", ""]
    else:
        lines += [f"Nothing written: {serving['why']}", ""]
    lines += ["| config | requests/s | p50 ms | p99 ms | requests | errors |",
              "|---|---|---|---|---|---|"]  # fmt: skip
    for p in serving["grid"]:
        mark = " (chosen)" if p["label"] == chosen else ""
        lines.append(
            f"| {p['label']}{mark} | {p['throughput']:.0f} | {_fmt(p['p50_ms'])} | "
            f"{_fmt(p['p99_ms'])} | {p['requests']} | {p['errors']} |"
        )
    return lines


def plots(report: dict[str, Any]) -> dict[str, str]:
    """PNG plots as base64 strings; empty when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return {}
    out: dict[str, str] = {}
    profiled = [r for r in report["candidates"] if r["profile"] and r["accuracy"]]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for r in profiled:
        batches = r["profile"]["batches"]
        ax.plot([b["batch_size"] for b in batches], [b["p50_ms"] for b in batches], marker="o",
                label=r["name"], linewidth=2.5 if r["name"] == report["chosen"] else 1)  # fmt: skip
    ax.set(xscale="log", yscale="log", xlabel="batch size", ylabel="p50 latency (ms)")
    ax.legend(fontsize=6)
    out["latency_vs_batch"] = _png(fig, plt)
    fig, ax = plt.subplots(figsize=(7, 4.2))
    small = report["batch_sizes"][0]
    for r in profiled:
        p50 = next(b["p50_ms"] for b in r["profile"]["batches"] if b["batch_size"] == small)
        chosen = r["name"] == report["chosen"]
        ax.scatter(p50, r["accuracy"]["drop"], s=120 if chosen else 30,
                   marker="*" if chosen else "o", color="red" if chosen else "C0")  # fmt: skip
        ax.annotate(r["name"] + (" (chosen)" if chosen else ""), (p50, r["accuracy"]["drop"]),
                    fontsize=6)  # fmt: skip
    ax.axhline(report["constraints"]["max_accuracy_drop"], linestyle="--", color="grey")
    ax.set(xlabel=f"p50 latency at batch {small} (ms)", ylabel="accuracy drop")
    out["accuracy_vs_speed"] = _png(fig, plt)
    return out


def _png(fig: Any, plt: Any) -> str:
    buffer = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buffer, format="png", dpi=100)
    plt.close(fig)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def html_page(report: dict[str, Any], md_rows: str) -> str:
    images = plots(report)
    figures = (
        "".join(
            f'<figure><img alt="{k}" src="data:image/png;base64,{v}"><figcaption>{k}</figcaption>'
            "</figure>"
            for k, v in images.items()
        )
        or "<p>(plots need matplotlib: pip install kiln-serve[optimize])</p>"
    )
    return (
        "<!doctype html><html><head><meta charset='utf-8'><title>kiln optimize: "
        f"{html.escape(report['name'])}</title></head><body><pre>{html.escape(md_rows)}</pre>"
        f"{figures}</body></html>\n"
    )


def write_reports(folder: Path, report: dict[str, Any]) -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    md = markdown(report)
    paths = [folder / "report.json", folder / "report.md", folder / "report.html"]
    paths[0].write_text(json.dumps(report, indent=2) + "\n")
    paths[1].write_text(md)
    paths[2].write_text(html_page(report, md))
    return paths
