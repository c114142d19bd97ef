"""``kiln bench``: perf_analyzer's flags (KServe v2), or vLLM's ``bench serve`` flags with
``--openai URL``."""

from __future__ import annotations

import click

from kiln.cli.bench_openai_options import OPENAI_ONLY, check_flags, openai_options


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
def bench(model: str | None, model_opt: str | None, json_path: str | None,
          **params: object) -> None:  # fmt: skip
    """Load-test MODEL on a KServe v2 server (kiln, Triton, ...), like perf_analyzer.

    With --openai URL: a serving benchmark of an OpenAI-compatible LLM server (kiln, vLLM,
    ...), like vllm bench serve.
    """
    ctx = click.get_current_context()
    openai_url = params.pop("openai_url")
    check_flags(ctx, openai=openai_url is not None)
    if openai_url is not None:
        from kiln.bench.openai_console import execute as execute_openai

        execute_openai({**params, "openai_url": openai_url, "model": model or model_opt,
                        "json_path": json_path})  # fmt: skip
        return
    for key in OPENAI_ONLY:
        params.pop(key)
    from kiln.bench.console import execute

    name = model or model_opt
    if not name:
        raise click.UsageError("give the model: kiln bench MODEL (or -m MODEL)")
    execute({**params, "model": name, "json": json_path})
