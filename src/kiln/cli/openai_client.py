"""What ``kiln chat`` and ``kiln complete`` share (vLLM's ``vllm chat`` / ``vllm complete``):
their flags, the model's name, and a streamed request printed as it comes. Standard library
only (urllib reads the server-sent events): no ``openai`` package needed."""

from __future__ import annotations

import json
import os
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import click

F = TypeVar("F", bound=Callable[..., Any])


def query_options(func: F) -> F:
    """vLLM's ``--url``, ``--model-name``, ``--api-key`` and ``--stats``."""
    for option in reversed([
        click.option(
            "--url", default="http://localhost:8000/v1", show_default=True,
            help="The OpenAI-compatible server's base URL (kiln serve, vllm serve, ...).",
        ),
        click.option(
            "--model-name", default=None,
            help="The model [default: the first that GET /v1/models lists].",
        ),
        click.option(
            "--api-key", default=None,
            help="Sent as 'Authorization: Bearer KEY' [default: $OPENAI_API_KEY].",
        ),
        click.option("--stats", is_flag=True, help="Print TTFT and tokens/s after each answer."),
    ]):  # fmt: skip
        func = option(func)
    return func


class Client:
    """POSTs to an OpenAI-compatible server; errors as ``click.ClickException``."""

    def __init__(self, url: str, api_key: str | None) -> None:
        self.url = url.rstrip("/")
        self.key = api_key or os.environ.get("OPENAI_API_KEY", "EMPTY")

    def _open(self, path: str, body: dict[str, Any] | None = None) -> Any:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.url + path, data=data)
        request.add_header("Authorization", f"Bearer {self.key}")
        if data is not None:
            request.add_header("Content-Type", "application/json")
        try:
            return urllib.request.urlopen(request, timeout=600)
        except urllib.error.HTTPError as exc:
            raise click.ClickException(f"{self.url}{path}: {exc.code} {_message(exc)}") from None
        except (urllib.error.URLError, OSError) as exc:
            reason = getattr(exc, "reason", exc)
            raise click.ClickException(f"cannot reach {self.url}: {reason}") from None

    def model(self, name: str | None) -> str:
        """``name``, or the first model the server lists."""
        if name:
            return name
        with self._open("/models") as answer:
            models = json.load(answer).get("data") or []
        if not models:
            raise click.ClickException(f"{self.url}/models lists no model")
        return str(models[0]["id"])

    def stream(self, path: str, body: dict[str, Any]) -> Iterator[dict[str, Any]]:
        """The chunks of a streamed answer (``stream: true``), as they arrive."""
        with self._open(path, {**body, "stream": True}) as answer:
            for raw in answer:
                line = raw.decode("utf-8").strip()
                if not line.startswith("data:"):
                    continue  # blank separators and ": keep-alive" comments
                data = line[len("data:") :].strip()
                if data == "[DONE]":
                    return
                chunk = json.loads(data)
                if "error" in chunk and "choices" not in chunk:
                    raise click.ClickException(_error_text(chunk))
                yield chunk


def _message(exc: urllib.error.HTTPError) -> str:
    try:
        return _error_text(json.loads(exc.read()))
    except (ValueError, OSError):
        return str(exc.reason)


def _error_text(body: Any) -> str:
    error = body.get("error") if isinstance(body, dict) else None
    if isinstance(error, dict):
        return str(error.get("message", error))
    return str(error if error is not None else body)


class Printer:
    """Prints a streamed answer's text as it comes, reasoning between ``<think>`` tags (as
    vLLM's CLI); with ``stats``, TTFT and tokens/s at the end."""

    def __init__(self, stats: bool) -> None:
        self.stats = stats

    def run(self, chunks: Iterator[dict[str, Any]], text: Callable[[dict[str, Any]], str]) -> str:
        """``text``: a choice's new text; returns the whole answer's."""
        start = time.perf_counter()
        ttft: float | None = None
        tokens = 0
        thinking = False
        out: list[str] = []
        for chunk in chunks:
            usage = chunk.get("usage")
            if usage:
                tokens = int(usage.get("completion_tokens", 0))
            if not chunk.get("choices"):
                continue
            choice = chunk["choices"][0]
            delta = choice.get("delta") or {}
            reasoning = delta.get("reasoning") or delta.get("reasoning_content")
            new = text(choice)
            if ttft is None and (reasoning or new):
                ttft = time.perf_counter() - start
            if reasoning:
                if not thinking:
                    click.echo("<think>")
                    thinking = True
                click.echo(reasoning, nl=False)
            if new:
                if thinking:
                    click.echo("\n</think>")
                    thinking = False
                out.append(new)
                click.echo(new, nl=False)
        if thinking:
            click.echo("\n</think>", nl=False)
        click.echo()
        elapsed = time.perf_counter() - start
        if self.stats and ttft is not None and elapsed > 0:
            click.echo(f"{'TTFT:':<5} {ttft * 1000:.2f} ms")
            click.echo(
                f"{'TPS:':<5} {tokens / elapsed:.2f} tokens/s ({tokens} tokens in {elapsed:.2f}s)"
            )
        return "".join(out)


def prompts(quick: str | None, invite: str) -> Iterator[str]:
    """``--quick``'s one message, or lines read after ``> `` until end of input."""
    if quick is not None:
        yield quick
        return
    click.echo(invite)
    while True:
        try:
            yield input("> ")
        except (EOFError, KeyboardInterrupt):
            return
