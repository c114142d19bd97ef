"""``kiln bench --openai URL``'s run on a terminal: the progress bar, the table, reports."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

from rich.progress import Progress, TaskID

from kiln.bench.llm_stats import LLMBenchResult, RequestResult

if TYPE_CHECKING:
    from kiln.bench.openai import OpenAIBenchOptions
    from kiln.bench.options import Reports


class _Bar:
    """The rich progress bar: requests done, output tokens so far, failures."""

    def __init__(self, bar: Progress) -> None:
        self.bar = bar
        self.task: TaskID | None = None
        self.tokens = 0
        self.failed = 0

    def start(self, total: int) -> None:
        self.task = self.bar.add_task("requests", total=total, status="")

    def done(self, result: RequestResult) -> None:
        self.tokens += result.output_tokens if result.ok else 0
        self.failed += 0 if result.ok else 1
        status = f"{self.tokens} output tokens, {self.failed} failed"
        assert self.task is not None
        self.bar.update(self.task, advance=1, status=status)


def run_and_report(options: OpenAIBenchOptions, reports: Reports) -> LLMBenchResult:
    """Run with a progress bar, print the table, write the reports; a BenchError propagates."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn

    from kiln.bench.llm_report import print_table, write_csv, write_json, write_plot
    from kiln.bench.openai import run

    console = Console() if sys.stdout.isatty() else Console(width=120)
    columns = (TextColumn("requests"), BarColumn(), MofNCompleteColumn(),
               TimeElapsedColumn(), TextColumn("{task.fields[status]}"))  # fmt: skip
    with Progress(*columns, console=Console(stderr=True), transient=True) as bar:
        result = run(options, progress=_Bar(bar))
    print_table(result, console)
    if reports.csv is not None:
        write_csv(result, reports.csv)
    if reports.json is not None:
        write_json(result, reports.json)
    if reports.plot is not None:
        write_plot(result, reports.plot)
    return result
