"""``kiln bench MODEL``: options (perf_analyzer's spellings as aliases), progress, reports."""

from __future__ import annotations

import sys
from pathlib import Path

import click
from rich.console import Console
from rich.markup import escape
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
)

from kiln.bench.options import (
    BenchError,
    BenchOptions,
    Distribution,
    Protocol,
    parse_range,
    require_plotting,
)
from kiln.bench.options import parse_shape as _parse_shape
from kiln.bench.report import print_table, write_csv, write_json, write_plot
from kiln.bench.runner import run
from kiln.bench.stats import Window


class BarProgress:
    """A rich progress bar per level, advanced at every measurement window."""

    def __init__(self, bar: Progress) -> None:
        self.bar = bar
        self.task: TaskID | None = None

    def level(self, label: str, trials: int) -> None:
        if self.task is not None:
            self.bar.update(self.task, visible=False)
        self.task = self.bar.add_task(label, total=trials, status="")

    def window(self, trial: int, window: Window) -> None:
        assert self.task is not None
        status = f"{window.throughput:,.0f} req/s, avg {window.latency(None) * 1e3:.2f} ms"
        if window.errors:
            status += f", {window.errors} errors"
        self.bar.update(self.task, completed=trial + 1, status=status)


def _levels(text: str, what: str, integer: bool) -> list[float]:
    try:
        return parse_range(text, what, integer)
    except BenchError as exc:
        raise click.BadParameter(str(exc)) from None


def execute(params: dict[str, object]) -> None:
    """Build the options from the parsed flags, run, report; exit 2 on a BenchError."""
    # Piped output would wrap the table at 80 columns; a file or pipe has room.
    console = Console() if sys.stdout.isatty() else Console(width=160)
    err = Console(stderr=True)
    try:
        concurrency = params["concurrency"]
        rate = params["request_rate"]
        if concurrency and rate:
            raise BenchError("give either --concurrency-range or --request-rate-range, not both")
        options = BenchOptions(
            model=str(params["model"]),
            url=str(params["url"] or ""),
            protocol=Protocol(params["protocol"]),
            binary=bool(params["binary"]),
            model_version=str(params["model_version"] or ""),
            concurrency=[int(c) for c in _levels(str(concurrency or "1"), "--concurrency", True)],
            request_rates=_levels(str(rate), "--request-rate", False) if rate else [],
            distribution=Distribution(params["distribution"]),
            max_outstanding=int(str(params["max_outstanding"])),
            batch_size=int(str(params["batch_size"])),
            input_data=str(params["input_data"]),
            shapes=dict(_parse_shape(s) for s in params["shape"]),  # type: ignore[attr-defined]
            shared_memory=str(params["shared_memory"]),
            sequence_length=int(str(params.get("sequence_length", 20))),
            sequence_id_start=int(str(params.get("sequence_id_start", 1))),
            streaming=bool(params.get("streaming", False)),
            measurement_interval_ms=int(str(params["measurement_interval"])),
            duration_s=params["duration"],  # type: ignore[arg-type]
            stability_percentage=float(str(params["stability_percentage"])),
            max_trials=int(str(params["max_trials"])),
            percentile=params["percentile"],  # type: ignore[arg-type]
            api_key=str(params["api_key"]) if params.get("api_key") else None,
        )
        plot = params["plot"]
        require_plotting(plot)
        columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                   TimeElapsedColumn(), TextColumn("{task.fields[status]}"))  # fmt: skip
        with Progress(*columns, console=err, transient=True) as bar:
            result = run(options, progress=BarProgress(bar))
        print_table(result, console)
        if params["csv"] is not None:
            write_csv(result, Path(str(params["csv"])))
        if params["json"] is not None:
            write_json(result, Path(str(params["json"])))
        if plot is not None:
            write_plot(result, Path(str(plot)))
    except BenchError as exc:
        err.print(f"[red]error:[/red] {escape(str(exc))}", highlight=False, soft_wrap=True)
        sys.exit(2)
    if result.total_errors:
        sys.exit(1)  # the report is written; a failing request must still fail scripts
