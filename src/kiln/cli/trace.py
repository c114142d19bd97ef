"""``kiln trace``: read request traces."""

from __future__ import annotations

import json
from pathlib import Path

import click


@click.group()
def trace() -> None:
    """Read request traces (kiln serve --trace-config; docs/tracing.md)."""


@trace.command("summary")
@click.argument("files", nargs=-1, required=True, type=click.Path(path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON.")
def trace_summary(files: tuple[Path, ...], as_json: bool) -> None:
    """Mean time per phase of the traced requests in FILES (Triton's trace format; several
    files, e.g. trace.json.0 trace.json.1, are read as one), per model and protocol:
    request (first to last stamp), receive, handler (REQUEST_START to REQUEST_END),
    queue, compute and its input / infer / output parts, send."""
    from rich.console import Console
    from rich.table import Table

    from kiln.trace_summary import PHASES, TraceFileError, read_entries, summarize, to_json

    try:
        groups = summarize(read_entries(list(files)))
    except TraceFileError as exc:
        raise click.ClickException(str(exc)) from None
    if as_json:
        click.echo(json.dumps(to_json(groups), indent=2))
        return
    if not groups:
        click.echo("no traces in " + ", ".join(map(str, files)))
        return
    table = Table(title="Traced requests: mean µs per phase")
    table.add_column("phase")
    for g in groups:
        version = f" v{g.version}" if g.version >= 0 else ""
        table.add_column(f"{g.model}{version}\n{g.protocol}", justify="right")
    table.add_row("traces", *(str(g.count) for g in groups))
    for phase, _, _ in PHASES:
        means = [g.mean_us(phase) for g in groups]
        table.add_row(phase, *("" if m is None else f"{m:,.0f}" for m in means))
    Console().print(table)
