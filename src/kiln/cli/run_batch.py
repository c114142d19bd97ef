"""``kiln run-batch``: vLLM's ``vllm run-batch``, an OpenAI batch file answered offline."""

from __future__ import annotations

import asyncio
import logging
import sys
from pathlib import Path
from typing import Any

import click

from kiln.cli.llm_options import ENGINE_FLAGS, llm_options, served_aliases, served_models
from kiln.cli.vllm_command import ServeCommand
from kiln.cli.vllm_flags import vllm_flags


@click.command("run-batch", cls=ServeCommand)
@click.argument(
    "model_paths", metavar="[MODEL]", nargs=-1, type=click.Path(exists=True, path_type=Path)
)
@click.option(
    "-i", "--input-file", "input_file", required=True,
    help="The batch: a JSON Lines file of {custom_id, method, url, body}, a path or an "
    "http(s) URL read with GET.",
)  # fmt: skip
@click.option(
    "-o", "--output-file", "output_file", required=True,
    help="Where the answers go, one line each in the input's order: a path, or an http(s) "
    "URL written with PUT.",
)  # fmt: skip
@click.option(
    "--output-tmp-dir",
    type=click.Path(file_okay=False, exists=True),
    default=None,
    help="With an http(s) --output-file: the folder its content is written to before the "
    "upload [default: the system's].",
)
@click.option(
    "--enable-metrics", is_flag=True, default=False, help="Serve /metrics while the batch runs."
)
@click.option(
    "--host", "--url", "host", default="127.0.0.1", show_default=True,
    help="With --enable-metrics: the address /metrics listens on (--url: vLLM's older name).",
)  # fmt: skip
@click.option(
    "--port",
    type=click.IntRange(1, 65535),
    default=8000,
    show_default=True,
    help="With --enable-metrics: the port /metrics listens on.",
)
@click.option(
    "--log-level",
    type=click.Choice(["critical", "error", "warning", "info", "debug", "trace"]),
    default="info",
    show_default=True,
)
@llm_options
@vllm_flags
def run_batch(
    model_paths: tuple[Path, ...],
    models: tuple[Path, ...],
    served_model_names: tuple[str, ...],
    input_file: str,
    output_file: str,
    output_tmp_dir: str | None,
    enable_metrics: bool,
    host: str,
    port: int,
    log_level: str,
    **llm_settings: Any,
) -> None:
    """Answer an OpenAI batch file with MODEL, offline: ``kiln run-batch -i in.jsonl -o
    out.jsonl MODEL`` reads as ``vllm run-batch -i in.jsonl -o out.jsonl --model MODEL``.

    Each line's url is one of kiln's OpenAI routes (chat and text completions, responses,
    embeddings, score, rerank, ...); its body is answered as the server answers it, and
    the output line carries its status and body, or its error (docs/llm.md, Batch files)."""
    from kiln.run_batch import BatchFileError, batch, is_url, parse_lines, read_input
    from kiln.server.server import ServerOptions

    level = "DEBUG" if log_level == "trace" else log_level.upper()
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    paths = (*model_paths, *models)
    if not paths:
        raise click.UsageError("give the model: MODEL or --model")
    if not is_url(output_file) and not Path(output_file).resolve().parent.is_dir():
        raise click.BadParameter(
            f"'{Path(output_file).parent}' is not a folder", param_hint="--output-file"
        )
    # the file is read and checked before any model loads: a bad line costs no load
    try:
        lines = parse_lines(read_input(input_file), input_file)
    except (OSError, BatchFileError) as exc:
        raise click.ClickException(f"--input-file: {exc}") from None
    settings = {k: llm_settings.pop(k) for k in ENGINE_FLAGS}
    options = ServerOptions(
        model_repositories=[],
        served_models=served_models(paths, served_model_names, settings),
        llm_aliases=served_aliases(paths, served_model_names),
        exit_on_error=True,
    )
    metrics = (host, port) if enable_metrics else None
    try:
        code = asyncio.run(batch(options, lines, output_file, output_tmp_dir, metrics))
    except OSError as exc:
        raise click.ClickException(str(exc)) from None
    sys.exit(code)
