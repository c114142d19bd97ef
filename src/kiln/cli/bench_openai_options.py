"""The flags of ``kiln bench --openai URL`` (vLLM's ``bench serve`` names).

Kept apart from ``kiln.bench`` so that ``kiln``'s command line loads without the load
generator's imports (grpc, numpy); the run itself is
``kiln.bench.openai_console.run_and_report``.
"""

from __future__ import annotations

from typing import Any

import click

# Flags only the OpenAI mode reads: given without --openai they are an error, and the
# KServe-only flags are an error with it.
OPENAI_ONLY = (
    "endpoint", "dataset", "num_prompts", "input_len", "output_len", "range_ratio",
    "vocab_size", "burstiness", "max_concurrency", "ignore_eos", "temperature", "seed",
    "extra_body", "profile",
)  # fmt: skip
SHARED = (
    "model", "model_opt", "request_rate", "csv", "json_path", "plot", "openai_url", "api_key",
)  # fmt: skip


def openai_options(f: Any) -> Any:
    options = [
        click.option("--openai", "openai_url", default=None, metavar="URL",
                     help="Benchmark an OpenAI-compatible server at this base URL "
                          "(http://host:port) instead of a KServe v2 model."),
        click.option("--endpoint", type=click.Choice(["completions", "chat"]),
                     default="completions", help="--openai: /v1/completions or "
                                                 "/v1/chat/completions."),
        click.option("--dataset", default="random", metavar="random|FILE.jsonl",
                     help='--openai: random prompts, or lines {"prompt": ..., '
                          '"max_tokens": N}.'),
        click.option("--num-prompts", default=100, type=click.IntRange(min=1),
                     help="--openai: requests to send."),
        click.option("--input-len", default=128, type=click.IntRange(min=1),
                     help="--openai: random prompt length (tokens)."),
        click.option("--output-len", default=64, type=click.IntRange(min=1),
                     help="--openai: max_tokens of random prompts (and JSONL lines "
                          "without one)."),
        click.option("--range-ratio", default=0.0, type=click.FloatRange(0, 1, max_open=True),
                     help="--openai: lengths uniform in [L(1-r), L(1+r)]."),
        click.option("--vocab-size", default=256, type=click.IntRange(min=1),
                     help="--openai: random completion prompts are token ids below this."),
        click.option("--burstiness", default=1.0, type=click.FloatRange(min=0, min_open=True),
                     help="--openai: gamma shape of the arrival gaps (1: Poisson)."),
        click.option("--max-concurrency", default=None, type=click.IntRange(min=1),
                     help="--openai: at most this many requests in flight."),
        click.option("--ignore-eos", is_flag=True, default=False,
                     help="--openai: ask the server to ignore EOS (exact output lengths)."),
        click.option("--temperature", default=0.0, type=click.FloatRange(min=0),
                     help="--openai: sampling temperature (0: greedy)."),
        click.option("--seed", default=0, type=int, help="--openai: seed of prompts and "
                                                         "arrivals."),
        click.option("--extra-body", default=None, metavar="JSON",
                     help="--openai: a JSON object merged into every request's body, e.g. "
                          "'{\"response_format\": {\"type\": \"json_object\"}}'."),
        click.option("--profile", is_flag=True, default=False,
                     help="--openai: POST /start_profile before the timed requests and "
                     "/stop_profile after them (vLLM's; the server needs --profiler-config)."),
        click.option("--api-key", default=None, envvar=["KILN_API_KEY", "OPENAI_API_KEY"],
                     help="API key of a server started with --api-key, sent as a Bearer "
                     "token [env: KILN_API_KEY, or OPENAI_API_KEY]."),
    ]  # fmt: skip
    for option in reversed(options):
        f = option(f)
    return f


def check_flags(ctx: click.Context, openai: bool) -> None:
    """Refuse flags the chosen mode would silently ignore."""
    from click.core import ParameterSource

    given = {
        p.name
        for p in ctx.command.params
        if p.name
        and ctx.get_parameter_source(p.name)
        in (ParameterSource.COMMANDLINE, ParameterSource.ENVIRONMENT)
    }
    if openai:
        wrong = sorted(given - set(OPENAI_ONLY) - set(SHARED))
        hint = " (use --max-concurrency)" if "concurrency" in wrong else ""
    else:
        wrong = sorted(given & set(OPENAI_ONLY))
        hint = " (they need --openai URL)"
    if wrong:
        names = ", ".join("--" + n.replace("_", "-") for n in wrong)
        mode = "with --openai" if openai else "without --openai"
        raise click.UsageError(f"{names}: not used {mode}{hint}")
