"""``kiln bench MODEL``'s run on a terminal: the progress bar, the table, the report files."""

from __future__ import annotations

import sys

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
)

from kiln.bench.options import BenchOptions, Reports
from kiln.bench.report import print_table, write_csv, write_json, write_plot
from kiln.bench.runner import BenchResult, run
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


def run_and_report(options: BenchOptions, reports: Reports) -> BenchResult:
    """Run with a progress bar per level, print the table, write the reports; a BenchError
    (before or outside measuring) propagates."""
    # Piped output would wrap the table at 80 columns; a file or pipe has room.
    console = Console() if sys.stdout.isatty() else Console(width=160)
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
               TimeElapsedColumn(), TextColumn("{task.fields[status]}"))  # fmt: skip
    with Progress(*columns, console=Console(stderr=True), transient=True) as bar:
        result = run(options, progress=BarProgress(bar))
    print_table(result, console)
    if reports.csv is not None:
        write_csv(result, reports.csv)
    if reports.json is not None:
        write_json(result, reports.json)
    if reports.plot is not None:
        write_plot(result, reports.plot)
    return result
