"""``kiln bench --openai URL``: options from the parsed flags, the progress bar, reports."""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Any

import click
from rich.progress import Progress, TaskID

from kiln.bench.llm_stats import RequestResult


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


def _rate(text: str | None) -> float:
    if text is None or text.strip().lower() == "inf":
        return math.inf
    try:
        return float(text)
    except ValueError:
        raise click.BadParameter(
            f"'{text}' is not a number or 'inf'", param_hint="--request-rate"
        ) from None


def _extra_body(text: str | None) -> dict[str, Any]:
    import orjson

    if not text:
        return {}
    try:
        value = orjson.loads(text)
    except orjson.JSONDecodeError as exc:
        raise click.BadParameter(f"not valid JSON ({exc})", param_hint="--extra-body") from None
    if not isinstance(value, dict):
        raise click.BadParameter("must be a JSON object", param_hint="--extra-body")
    return value


def execute(params: dict[str, Any]) -> None:
    """Run the OpenAI benchmark from parsed flags; exit 2 on a BenchError, 1 on failures."""
    from rich.console import Console
    from rich.markup import escape
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from kiln.bench.llm_dataset import Endpoint
    from kiln.bench.llm_report import print_table, write_csv, write_json, write_plot
    from kiln.bench.openai import OpenAIBenchOptions, run
    from kiln.bench.options import BenchError, require_plotting

    console = Console() if sys.stdout.isatty() else Console(width=120)
    err = Console(stderr=True)
    try:
        options = OpenAIBenchOptions(
            url=str(params["openai_url"]),
            model=str(params.get("model") or ""),
            endpoint=Endpoint(params["endpoint"]),
            dataset=str(params["dataset"]),
            num_prompts=int(params["num_prompts"]),
            input_len=int(params["input_len"]),
            output_len=int(params["output_len"]),
            range_ratio=float(params["range_ratio"]),
            vocab_size=int(params["vocab_size"]),
            request_rate=_rate(params.get("request_rate")),
            burstiness=float(params["burstiness"]),
            max_concurrency=params.get("max_concurrency"),
            ignore_eos=bool(params["ignore_eos"]),
            temperature=float(params["temperature"]),
            seed=int(params["seed"]),
            api_key=str(params.get("api_key") or ""),
            extra_body=_extra_body(params.get("extra_body")),
        )
        plot = params.get("plot")
        require_plotting(plot)
        columns = (TextColumn("requests"), BarColumn(), MofNCompleteColumn(),
                   TimeElapsedColumn(), TextColumn("{task.fields[status]}"))  # fmt: skip
        with Progress(*columns, console=err, transient=True) as bar:
            result = run(options, progress=_Bar(bar))
        print_table(result, console)
        if params.get("csv") is not None:
            write_csv(result, Path(str(params["csv"])))
        if params.get("json_path") is not None:
            write_json(result, Path(str(params["json_path"])))
        if plot is not None:
            write_plot(result, Path(str(plot)))
    except BenchError as exc:
        err.print(f"[red]error:[/red] {escape(str(exc))}", highlight=False, soft_wrap=True)
        sys.exit(2)
    if result.failed:
        sys.exit(1)  # the report is written; a failing request must still fail scripts
