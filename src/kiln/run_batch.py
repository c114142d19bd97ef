"""``kiln run-batch``: an OpenAI batch file (JSON Lines) answered by the models of one
``kiln serve`` run in this process, as ``vllm run-batch`` answers one.

Each input line is ``{"custom_id", "method": "POST", "url", "body"}``; each output line, in
the input's order, ``{"id", "custom_id", "response": {"status_code", "request_id",
"body"}, "error"}``. A request goes through the same OpenAI routes, checks and limits as
one sent over HTTP (it is handed to them as an ASGI request, no socket between), so a body
answers as the server would answer it; a failed request is an output line with its
status and error, never the end of the run. The file's own shape (JSON, the four fields,
unique ids) is checked line by line before any model loads.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import tempfile
import urllib.request
import uuid
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import orjson

if TYPE_CHECKING:
    from kiln.server.server import Server, ServerOptions

log = logging.getLogger(__name__)

#: the routes a batch line may name: kiln's inference routes that answer one JSON body
#: (vLLM's run-batch takes chat completions, embeddings, score and rerank; OpenAI's Batch
#: API completions and responses too)
URLS = frozenset({
    "/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages",
    "/v1/embeddings", "/v2/embed", "/pooling", "/classify", "/v1/classify",
    "/score", "/v1/score", "/rerank", "/v1/rerank", "/v2/rerank", "/generative_scoring",
})  # fmt: skip
#: requests handed to the routes at once: the engines' queues (max_num_seqs + 1024 each)
#: hold them all, and the scheduler keeps its batch full from them
WINDOW = 256
#: the most bytes one input line may hold (the server's default --http-max-input-size
#: bounds a body sent over HTTP the same way)
MAX_LINE_BYTES = 64 * 1024 * 1024
#: attempts, and seconds between them, at a PUT of the output to a URL (vLLM's)
UPLOAD_ATTEMPTS = 5
UPLOAD_DELAY = 5.0


class BatchFileError(ValueError):
    """The input file is not a batch file: its line and what is wrong there."""


@dataclass(slots=True)
class BatchLine:
    """One request of the input file."""

    number: int  # its line in the file, from 1
    custom_id: str
    method: str
    url: str
    body: dict[str, Any]


def is_url(text: str) -> bool:
    return text.startswith(("http://", "https://"))


def read_input(source: str) -> bytes:
    """The input file: a local path, or an http(s) URL read with GET."""
    if is_url(source):
        with urllib.request.urlopen(source, timeout=300) as answer:
            return bytes(answer.read())
    return Path(source).read_bytes()


def parse_lines(data: bytes, name: str) -> list[BatchLine]:
    """Every request of a batch file, checked: a line that is not a JSON object with a
    string ``custom_id``, ``method`` and ``url`` and an object ``body``, or a ``custom_id``
    given twice, raises ``BatchFileError`` naming the line (blank lines are skipped)."""
    out: list[BatchLine] = []
    seen: dict[str, int] = {}
    for number, raw in enumerate(data.split(b"\n"), start=1):
        line = raw.strip()
        if not line:
            continue
        where = f"{name} line {number}"
        if len(line) > MAX_LINE_BYTES:
            raise BatchFileError(f"{where}: {len(line)} bytes, more than {MAX_LINE_BYTES}")
        try:
            item = orjson.loads(line)
        except orjson.JSONDecodeError as exc:
            raise BatchFileError(f"{where}: not JSON ({exc})") from None
        if not isinstance(item, dict):
            raise BatchFileError(f"{where}: a JSON object is expected, not {_kind(item)}")
        for key in ("custom_id", "method", "url"):
            if not isinstance(item.get(key), str):
                found = "missing" if key not in item else f"{_kind(item[key])}, not a string"
                raise BatchFileError(f"{where}: field '{key}' is {found}")
        if not isinstance(item.get("body"), dict):
            found = "missing" if "body" not in item else f"{_kind(item['body'])}, not an object"
            raise BatchFileError(f"{where}: field 'body' is {found}")
        custom_id = item["custom_id"]
        if custom_id in seen:
            raise BatchFileError(
                f"{where}: custom_id {custom_id!r} is also the id of line {seen[custom_id]} "
                "(each request's must be unique)"
            )
        seen[custom_id] = number
        out.append(BatchLine(number, custom_id, item["method"], item["url"], item["body"]))
    return out


def _kind(value: Any) -> str:
    return {dict: "an object", list: "an array", str: "a string", bool: "a boolean",
            type(None): "null"}.get(type(value), "a number")  # fmt: skip


App = Callable[[dict[str, Any], Any, Any], Awaitable[None]]


async def call(app: App, path: str, body: bytes) -> tuple[int, bytes]:
    """POST ``body`` (JSON) to ``path`` of the ASGI ``app``: the answer's status and body.
    The client stays connected until the answer is complete."""
    sent = False
    done = asyncio.Event()
    status = 500
    chunks: list[bytes] = []

    async def receive() -> dict[str, Any]:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        await done.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        nonlocal status
        if message["type"] == "http.response.start":
            status = int(message["status"])
        elif message["type"] == "http.response.body":
            chunks.append(bytes(message.get("body", b"")))
            if not message.get("more_body", False):
                done.set()

    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
        "scheme": "http", "path": path, "raw_path": path.encode(), "root_path": "",
        "query_string": b"", "client": ("run-batch", 0), "server": ("run-batch", 0),
        "headers": [(b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode())],
    }  # fmt: skip
    try:
        await app(scope, receive, send)
    finally:
        done.set()
    return status, b"".join(chunks)


def _error(message: str, status: int, kind: str = "BadRequestError") -> dict[str, Any]:
    """OpenAI's error object (``{"error": {...}}``), as the routes write it."""
    return {"error": {"message": message, "type": kind, "param": None, "code": status}}


async def answer(app: App, line: BatchLine) -> dict[str, Any]:
    """The output line of one request."""
    status, body, error = 400, None, None
    if line.method.upper() != "POST":
        error = _error(f"method {line.method!r}: a batch request is a POST", 400)
    elif line.url not in URLS:
        error = _error(
            f"URL {line.url} was used. Supported endpoints: {', '.join(sorted(URLS))}.", 400
        )
    elif line.body.get("stream") is True:
        error = _error("Request must not be sent in stream mode", 400)
    else:
        try:
            status, raw = await call(app, line.url, orjson.dumps(line.body))
            parsed = orjson.loads(raw) if raw else None
        except Exception as exc:  # one request's failure never ends the others'
            log.exception("run-batch: line %d (%s) failed", line.number, line.custom_id)
            status, parsed = 500, _error(f"{type(exc).__name__}: {exc}", 500, "InternalError")
        if status == 200:
            body = parsed
        else:
            error = parsed if isinstance(parsed, dict) else _error(str(parsed), status)
    return {
        "id": f"batch_req_{uuid.uuid4().hex}",
        "custom_id": line.custom_id,
        "response": {
            "status_code": status,
            "request_id": f"kiln-batch-{uuid.uuid4().hex}",
            "body": body,
        },
        "error": error,
    }


async def run(
    app: App,
    lines: list[BatchLine],
    out: Any,
    advance: Callable[[], None] = lambda: None,
    window: int = WINDOW,
) -> dict[int, int]:
    """Answer every line, at most ``window`` at once, writing the output lines to ``out``
    (a binary file) in the input's order as soon as those before them are written. The
    count of answers per status code."""
    gate = asyncio.Semaphore(window)
    ready: dict[int, bytes] = {}
    statuses: dict[int, int] = {}
    written = 0

    async def one(index: int, line: BatchLine) -> None:
        nonlocal written
        async with gate:
            result = await answer(app, line)
        status = result["response"]["status_code"]
        statuses[status] = statuses.get(status, 0) + 1
        ready[index] = orjson.dumps(result) + b"\n"
        while written in ready:
            out.write(ready.pop(written))
            written += 1
        advance()

    await asyncio.gather(*(one(i, line) for i, line in enumerate(lines)))
    return statuses


@contextlib.contextmanager
def output_file(target: str, tmp_dir: str | None) -> Iterator[tuple[Any, Path]]:
    """A file to write the output to, and its path: beside ``target`` and renamed onto it
    once complete (a half-written output never has its name), or, for an http(s) URL, in
    ``tmp_dir`` (the system's by default), for the caller to upload. Removed on leaving."""
    folder = tmp_dir if is_url(target) else str(Path(target).resolve().parent)
    fd, path = tempfile.mkstemp(prefix="kiln_batch_output_", suffix=".jsonl", dir=folder)
    try:
        with os.fdopen(fd, "wb") as f:
            yield f, Path(path)
        if not is_url(target):
            os.replace(path, target)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def upload(url: str, path: Path, attempts: int = UPLOAD_ATTEMPTS) -> None:
    """PUT the file at ``url``; a failed attempt is retried (vLLM's five, 5 s apart)."""
    import time

    for attempt in range(1, attempts + 1):
        try:
            with path.open("rb") as f:
                request = urllib.request.Request(url, data=f, method="PUT")
                request.add_header("Content-Length", str(path.stat().st_size))
                request.add_header("Content-Type", "application/jsonl")
                with urllib.request.urlopen(request, timeout=1000) as answer:
                    answer.read()
            return
        except OSError as exc:
            if attempt == attempts:
                why = f"uploading the output to {url} failed {attempts} times: {exc}"
                raise OSError(why) from None
            log.error("uploading the output to %s failed (attempt %d): %s", url, attempt, exc)
            time.sleep(UPLOAD_DELAY)


async def batch(
    options: ServerOptions,
    lines: list[BatchLine],
    target: str,
    tmp_dir: str | None = None,
    metrics_address: tuple[str, int] | None = None,
    window: int = WINDOW,
) -> int:
    """Load the models of ``options``, answer ``lines`` into ``target`` (a path or an
    http(s) URL), unload: the exit status (1: a model did not load)."""
    from kiln.core.progress import progress
    from kiln.frontends.http.app import HttpFrontend
    from kiln.frontends.openai.routes import openai_routes
    from kiln.server.server import Server

    server = Server(options)
    await server.open()
    stop_metrics = await _serve_metrics(server, metrics_address)
    try:
        await server.start()
        if server.failed_at_start:
            for name, why in server.failed_at_start.items():
                log.error("model '%s' did not load: %s", name, why)
            return 1
        frontend = HttpFrontend(server)
        app = frontend.app(openai_routes(server, frontend))
        with output_file(target, tmp_dir) as (out, path):
            with progress(len(lines), "Running batch") as advance:
                statuses = await run(app, lines, out, advance, window)
            out.flush()
            if is_url(target):
                await asyncio.to_thread(upload, target, path)
        summary = ", ".join(f"{n} with status {code}" for code, n in sorted(statuses.items()))
        log.info("run-batch: %d requests answered (%s) into %s", len(lines), summary, target)
        return 0
    finally:
        await server.stop()
        await stop_metrics()


async def _serve_metrics(
    server: Server, address: tuple[str, int] | None
) -> Callable[[], Awaitable[None]]:
    """vLLM's ``--enable-metrics``: /metrics on ``address`` while the batch runs; the
    function that stops it."""

    async def nothing() -> None:
        return None

    if address is None:
        return nothing
    import uvicorn

    from kiln.metrics.app import MetricsOptions, MetricsService, metrics_app

    metrics = MetricsService(server, MetricsOptions())
    metrics.start()
    config = uvicorn.Config(
        metrics_app(metrics), host=address[0], port=address[1], log_level="warning"
    )
    http = uvicorn.Server(config)
    task = asyncio.create_task(http.serve())
    while not http.started and not task.done():
        await asyncio.sleep(0.01)
    if task.done():
        metrics.stop()
        task.result()  # its error: the port is taken
        raise OSError(f"--enable-metrics: cannot listen on {address[0]}:{address[1]}")

    async def stop() -> None:
        http.should_exit = True
        await task
        metrics.stop()

    return stop
