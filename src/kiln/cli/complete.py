"""``kiln complete``: vLLM's ``vllm complete``, text completions from a running server."""

from __future__ import annotations

from typing import Any

import click

from kiln.cli.openai_client import Client, Printer, prompts, query_options


@click.command()
@query_options
@click.option(
    "--max-tokens", type=click.IntRange(min=1), default=None,
    help="The most tokens an answer may have [default: the server's].",
)  # fmt: skip
@click.option(
    "-q", "--quick", metavar="PROMPT", default=None,
    help="Complete PROMPT, print the completion and exit.",
)  # fmt: skip
def complete(
    url: str,
    model_name: str | None,
    api_key: str | None,
    stats: bool,
    max_tokens: int | None,
    quick: str | None,
) -> None:
    """Complete prompts with a model of a running OpenAI-compatible server (kiln serve,
    vllm serve): one prompt per line, each completion streamed as it is generated."""
    client = Client(url, api_key)
    model = client.model(model_name)
    click.echo(f"Using model: {model}")
    body: dict[str, Any] = {"model": model}
    if max_tokens is not None:
        body["max_tokens"] = max_tokens
    if stats:
        body["stream_options"] = {"include_usage": True}
    printer = Printer(stats)
    for prompt in prompts(quick, "Please enter prompt to complete:"):
        chunks = client.stream("/completions", {**body, "prompt": prompt})
        try:
            printer.run(chunks, lambda c: c.get("text") or "")
        except click.ClickException as exc:
            if quick is not None:
                raise
            click.echo(f"Error: {exc.message}", err=True)  # the next prompt may do
