"""``kiln bench``: perf_analyzer's flags (KServe v2), or vLLM's ``bench serve`` flags with
``--openai URL``; the flags become ``BenchOptions`` or ``OpenAIBenchOptions``."""

from __future__ import annotations

import math
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from kiln.cli.bench_openai_options import check_flags, openai_options

if TYPE_CHECKING:
    from kiln.bench.openai import OpenAIBenchOptions
    from kiln.bench.options import BenchOptions, Reports


@dataclass(frozen=True)
class BenchFlags:
    """Every flag of ``kiln bench``, as click parsed it (one field per flag)."""

    model: str | None
    model_opt: str | None
    url: str | None
    protocol: str
    binary: bool
    model_version: str
    concurrency: str | None
    request_rate: str | None
    distribution: str
    max_outstanding: int
    batch_size: int
    input_data: str
    shape: tuple[str, ...]
    shared_memory: str
    sequence_length: int
    streaming: bool
    sequence_id_start: int
    measurement_interval: int
    duration: float | None
    stability_percentage: float
    max_trials: int
    percentile: int | None
    csv: str | None
    json_path: str | None
    plot: str | None
    openai_url: str | None
    endpoint: str
    dataset: str
    num_prompts: int
    input_len: int
    output_len: int
    range_ratio: float
    vocab_size: int
    burstiness: float
    max_concurrency: int | None
    ignore_eos: bool
    temperature: float
    seed: int
    extra_body: str | None
    profile: bool
    api_key: str | None

    def reports(self) -> Reports:
        from kiln.bench.options import Reports

        def path(text: str | None) -> Path | None:
            return None if text is None else Path(text)

        return Reports(csv=path(self.csv), json=path(self.json_path), plot=path(self.plot))

    def kserve_options(self, model: str) -> BenchOptions:
        """Raises BenchError (exit 2) or click.BadParameter for a bad range."""
        from kiln.bench.options import BenchError, BenchOptions, Distribution, Protocol, parse_shape

        if self.concurrency and self.request_rate:
            raise BenchError("give either --concurrency-range or --request-rate-range, not both")
        concurrency = _levels(self.concurrency or "1", "--concurrency", True)
        rate = self.request_rate
        return BenchOptions(
            model=model,
            url=self.url or "",
            protocol=Protocol(self.protocol),
            binary=self.binary,
            model_version=self.model_version or "",
            concurrency=[int(c) for c in concurrency],
            request_rates=_levels(rate, "--request-rate", False) if rate else [],
            distribution=Distribution(self.distribution),
            max_outstanding=self.max_outstanding,
            batch_size=self.batch_size,
            input_data=self.input_data,
            shapes=dict(parse_shape(s) for s in self.shape),
            shared_memory=self.shared_memory,
            sequence_length=self.sequence_length,
            sequence_id_start=self.sequence_id_start,
            streaming=self.streaming,
            measurement_interval_ms=self.measurement_interval,
            duration_s=self.duration,
            stability_percentage=self.stability_percentage,
            max_trials=self.max_trials,
            percentile=self.percentile,
            api_key=self.api_key or None,
        )

    def openai_options(self, url: str) -> OpenAIBenchOptions:
        """Raises BenchError (exit 2) or click.BadParameter for a bad rate or body."""
        from kiln.bench.llm_dataset import Endpoint
        from kiln.bench.openai import OpenAIBenchOptions

        return OpenAIBenchOptions(
            url=url,
            model=self.model or self.model_opt or "",
            endpoint=Endpoint(self.endpoint),
            dataset=self.dataset,
            num_prompts=self.num_prompts,
            input_len=self.input_len,
            output_len=self.output_len,
            range_ratio=self.range_ratio,
            vocab_size=self.vocab_size,
            request_rate=_rate(self.request_rate),
            burstiness=self.burstiness,
            max_concurrency=self.max_concurrency,
            ignore_eos=self.ignore_eos,
            temperature=self.temperature,
            seed=self.seed,
            api_key=self.api_key or "",
            extra_body=_extra_body(self.extra_body),
            profile=self.profile,
        )


def _levels(text: str, what: str, integer: bool) -> list[float]:
    from kiln.bench.options import BenchError, parse_range

    try:
        return parse_range(text, what, integer)
    except BenchError as exc:
        raise click.BadParameter(str(exc)) from None


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


@contextmanager
def _exit_2_on_bench_error() -> Iterator[None]:
    """A BenchError stops the run before or outside measuring: one red line, exit status 2."""
    from rich.console import Console
    from rich.markup import escape

    from kiln.bench.options import BenchError

    try:
        yield
    except BenchError as exc:
        err = Console(stderr=True)
        err.print(f"[red]error:[/red] {escape(str(exc))}", highlight=False, soft_wrap=True)
        sys.exit(2)


@click.command(context_settings={"show_default": True})
@click.argument("model", required=False)
@click.option("-m", "--model", "model_opt", default=None, help="The model (perf_analyzer's -m).")
@click.option("-u", "--url", default=None, help="Server host:port [8000 HTTP / 8001 gRPC].")
@click.option("-i", "--protocol", type=click.Choice(["http", "grpc"]), default="http")
@click.option("--binary/--json-data", default=True, help="HTTP: binary tensor extension or JSON.")
@click.option("--model-version", "-x", default="", help="Model version (default: the server's).")
@click.option(
    "--concurrency",
    "--concurrency-range",
    "concurrency",
    default=None,
    help="Closed loop levels 'start[:end[:step]]', e.g. 1:64:2 or 8 [1].",
)
@click.option(
    "--request-rate",
    "--request-rate-range",
    "request_rate",
    default=None,
    help="Open loop: requests/s 'start[:end[:step]]' instead of concurrency "
    "(--openai: one rate, or inf [default] to send every request at once).",
)
@click.option(
    "--request-distribution",
    "distribution",
    type=click.Choice(["constant", "poisson"]),
    default="constant",
)
@click.option(
    "--max-outstanding",
    default=64,
    type=click.IntRange(min=1),
    help="Open loop: sends beyond this many in flight are dropped (and reported).",
)
@click.option("-b", "--batch-size", default=1, type=click.IntRange(min=1))
@click.option("--input-data", default="random", help="random | zero | FILE.json | FILE.npz")
@click.option(
    "--shape",
    multiple=True,
    metavar="NAME:D1,D2",
    help="Dims of a variable-shape input (batch dim excluded); may repeat.",
)
@click.option("--shared-memory", type=click.Choice(["none", "system"]), default="none")
@click.option(
    "--sequence-length",
    default=20,
    show_default=True,
    type=click.IntRange(min=1),
    help="A model with sequence_batching: requests per sequence (START on the first, END on "
    "the last), each concurrent client its own sequence.",
)
@click.option(
    "--streaming",
    is_flag=True,
    help="gRPC: send over a ModelStreamInfer stream, a request done at its final response "
    "(always for a decoupled model).",
)
@click.option(
    "--sequence-id-start",
    default=1,
    show_default=True,
    type=click.IntRange(min=1),
    help="A model with sequence_batching: client N sends sequence id START+N.",
)
@click.option(
    "--measurement-interval-ms",
    "--measurement-interval",
    "-p",
    "measurement_interval",
    default=2000,
    type=click.IntRange(min=1),
    help="Length of one measurement window (ms).",
)
@click.option(
    "--duration",
    type=click.FloatRange(min=0, min_open=True),
    default=None,
    help="Measure one window of this many seconds instead of windows until stable.",
)
@click.option("--stability-percentage", "-s", default=10.0, type=float)
@click.option("--max-trials", "-r", default=10, type=click.IntRange(min=1))
@click.option(
    "--percentile",
    default=None,
    type=click.IntRange(1, 99),
    help="Judge stability on this latency percentile instead of the average.",
)
@click.option("--csv", "-f", "csv", default=None, type=click.Path(dir_okay=False))
@click.option("--json", "json_path", default=None, type=click.Path(dir_okay=False))
@click.option(
    "--plot",
    default=None,
    type=click.Path(dir_okay=False),
    help="PNG of latency against throughput (--openai: latency histograms); "
    "needs kiln-serve[bench].",
)
@openai_options
def bench(**params: Any) -> None:
    """Load-test MODEL on a KServe v2 server (kiln, Triton, ...), like perf_analyzer.

    With --openai URL: a serving benchmark of an OpenAI-compatible LLM server (kiln, vLLM,
    ...), like vllm bench serve.
    """
    flags = BenchFlags(**params)
    check_flags(click.get_current_context(), openai=flags.openai_url is not None)
    if flags.openai_url is not None:
        from kiln.bench.openai_console import run_and_report as run_openai
        from kiln.bench.options import require_plotting

        with _exit_2_on_bench_error():
            openai = flags.openai_options(flags.openai_url)
            require_plotting(flags.plot)
            failed = run_openai(openai, flags.reports()).failed
        if failed:
            sys.exit(1)  # the report is written; a failing request must still fail scripts
        return
    name = flags.model or flags.model_opt
    if not name:
        raise click.UsageError("give the model: kiln bench MODEL (or -m MODEL)")
    from kiln.bench.console import run_and_report
    from kiln.bench.options import require_plotting

    with _exit_2_on_bench_error():
        options = flags.kserve_options(name)
        require_plotting(flags.plot)
        errors = run_and_report(options, flags.reports()).total_errors
    if errors:
        sys.exit(1)  # the report is written; a failing request must still fail scripts
