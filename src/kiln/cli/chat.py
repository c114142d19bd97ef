"""``kiln chat``: vLLM's ``vllm chat``, a conversation with a running server's model."""

from __future__ import annotations

from typing import Any

import click

from kiln.cli.openai_client import Client, Printer, prompts, query_options


@click.command()
@query_options
@click.option(
    "--system-prompt", default=None, help="A system message first, for models that take one."
)
@click.option(
    "-q", "--quick", metavar="MESSAGE", default=None,
    help="Send MESSAGE, print the answer and exit.",
)  # fmt: skip
def chat(
    url: str,
    model_name: str | None,
    api_key: str | None,
    stats: bool,
    system_prompt: str | None,
    quick: str | None,
) -> None:
    """Chat with a model of a running OpenAI-compatible server (kiln serve, vllm serve):
    each answer streams as it is generated; the conversation is kept until end of input
    (Ctrl-D)."""
    client = Client(url, api_key)
    model = client.model(model_name)
    click.echo(f"Using model: {model}")
    conversation: list[dict[str, Any]] = []
    if system_prompt is not None:
        conversation.append({"role": "system", "content": system_prompt})
    body: dict[str, Any] = {"model": model}
    if stats:
        body["stream_options"] = {"include_usage": True}
    printer = Printer(stats)
    for message in prompts(quick, "Please enter a message for the chat model:"):
        conversation.append({"role": "user", "content": message})
        chunks = client.stream("/chat/completions", {**body, "messages": conversation})
        try:
            answer = printer.run(chunks, lambda c: (c.get("delta") or {}).get("content") or "")
        except click.ClickException as exc:
            if quick is not None:
                raise
            # a conversation goes on past a refused message (the context is full, ...)
            click.echo(f"Error: {exc.message}", err=True)
            conversation.pop()
            continue
        conversation.append({"role": "assistant", "content": answer})
