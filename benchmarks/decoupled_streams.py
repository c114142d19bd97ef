"""Decoupled streams on one Python-model instance: kiln, an earlier kiln tree, and Triton's
python backend, against the engine driven in-process, in one run.

The model is ``peers/stepping_engine_model.py`` (the shape of Triton's vLLM backend):
``execute`` hands requests to the model's engine thread and returns; every ``STEP_S`` the
engine sends one token to each request it holds. ``--streams`` closed-loop clients each
keep one request of ``--max-tokens`` tokens open on a gRPC stream (tritonclient
``start_stream`` / ``async_stream_infer``), sending the next when the last token comes.
The physical limit is the same model object run in this process, its requests fed by
threads with no server between: ``streams / STEP_S`` tokens per second at best.

Reported per server and stream count: tokens/s, the ratio to the in-process engine, and
the median and p99 time to first token (ms). Usage::

    .venv/bin/python benchmarks/decoupled_streams.py [--streams 1,4,16] [--duration 4]
        [--trees /tmp/before/src]     # more kiln source trees, e.g. a git worktree

Triton's rows need ``bash benchmarks/setup_peers.sh pytriton``; without it they are
skipped with the reason printed.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import queue
import shutil
import statistics
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import tritonclient.grpc as grpcclient
from peer_servers import PEERS, ServerProcess, missing_reason, start_kiln, start_triton
from rich.console import Console
from rich.table import Table

MODEL = "stepping_engine"
MODEL_FILE = "stepping_engine_model.py"
CONFIG = f"""name: "{MODEL}"
backend: "python"
max_batch_size: 0
input [ {{ name: "MAX_TOKENS" data_type: TYPE_INT32 dims: [ 1 ] }} ]
output [ {{ name: "TOKEN" data_type: TYPE_INT32 dims: [ 1 ] }} ]
instance_group [ {{ count: 1 kind: KIND_CPU }} ]
model_transaction_policy {{ decoupled: true }}
"""


@dataclass
class Row:
    server: str
    streams: int
    tokens: int
    seconds: float
    first_token_s: list[float]

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds


def build_repository(repo: Path) -> None:
    (repo / MODEL / "1").mkdir(parents=True)
    (repo / MODEL / "config.pbtxt").write_text(CONFIG)
    shutil.copy(PEERS / MODEL_FILE, repo / MODEL / "1" / "model.py")


class _Stream:
    """One closed-loop client: a request of ``max_tokens`` at a time on its own stream."""

    def __init__(self, url: str, max_tokens: int, row: Row, lock: threading.Lock) -> None:
        self.max_tokens = max_tokens
        self.row, self.lock = row, lock
        self.window = (0.0, 0.0)
        self.sent_at = 0.0
        self.first = True
        self.done = threading.Event()
        self.errors: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.client = grpcclient.InferenceServerClient(url)
        self.client.start_stream(callback=self._on_response)
        self.tensor = grpcclient.InferInput("MAX_TOKENS", [1], "INT32")
        self.tensor.set_data_from_numpy(np.array([max_tokens], np.int32))

    def send(self) -> None:
        self.sent_at, self.first = time.perf_counter(), True
        self.client.async_stream_infer(MODEL, [self.tensor])

    def _on_response(self, result: Any, error: Any) -> None:
        now = time.perf_counter()
        if error is not None:
            self.errors.put(error)
            self.done.set()
            return
        token = int(result.as_numpy("TOKEN")[0])
        start, stop = self.window
        if start <= now < stop:
            with self.lock:
                self.row.tokens += 1
                if self.first:
                    self.row.first_token_s.append(now - self.sent_at)
        self.first = False
        if token + 1 < self.max_tokens:
            return
        if now < stop:
            self.send()
        else:
            self.done.set()

    def close(self) -> None:
        self.client.stop_stream()
        self.client.close()


def drive(server: ServerProcess, streams: int, max_tokens: int, duration: float) -> Row:
    row = Row(server.name, streams, 0, duration, [])
    lock = threading.Lock()
    url = f"127.0.0.1:{server.grpc_port}"
    clients = [_Stream(url, max_tokens, row, lock) for _ in range(streams)]
    try:
        warmup = 0.5
        start = time.perf_counter() + warmup
        for client in clients:
            client.window = (start, start + duration)
            client.send()
        for client in clients:
            if not client.done.wait(duration + warmup + 60):
                raise RuntimeError(f"{server.name}: a stream did not finish")
            if not client.errors.empty():
                raise RuntimeError(f"{server.name}: {client.errors.get()}")
    finally:
        for client in clients:
            client.close()
    return row


class _Sender:
    """The in-process stand-in for a response sender: counts tokens, ends with FINAL."""

    def __init__(self, feed: _Feed) -> None:
        self.feed = feed
        self.first = True

    def is_cancelled(self) -> bool:
        return False

    def send(self, response: Any = None, flags: int = 0) -> None:
        self.feed.token(self, flags != 0)


class _Feed:
    """``streams`` closed-loop feeders of the model object, in this process."""

    def __init__(self, model: Any, pb: Any, max_tokens: int, row: Row) -> None:
        self.model, self.pb, self.max_tokens, self.row = model, pb, max_tokens, row
        self.window = (0.0, 0.0)
        self.sent_at: dict[int, float] = {}
        self.open = 0
        self.idle = threading.Event()

    def submit(self) -> None:
        sender = _Sender(self)
        tensor = self.pb.Tensor("MAX_TOKENS", np.array([self.max_tokens], np.int32))
        request = self.pb.InferenceRequest(inputs=[tensor])
        request._sender = sender
        self.sent_at[id(sender)] = time.perf_counter()
        self.open += 1
        self.model.execute([request])

    def token(self, sender: _Sender, final: bool) -> None:  # on the engine thread
        now = time.perf_counter()
        start, stop = self.window
        if start <= now < stop:
            self.row.tokens += 1
            if sender.first:
                self.row.first_token_s.append(now - self.sent_at[id(sender)])
        sender.first = False
        if not final:
            return
        del self.sent_at[id(sender)]
        self.open -= 1
        if now < stop:
            self.submit()
        elif not self.open:
            self.idle.set()


def run_in_process(streams: int, max_tokens: int, duration: float) -> Row:
    from kiln.backends.python import pb_utils

    pb_utils.install()
    spec = importlib.util.spec_from_file_location("stepping_engine_model", PEERS / MODEL_FILE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    model = module.TritonPythonModel()
    model.initialize({})
    row = Row("engine in-process", streams, 0, duration, [])
    feed = _Feed(model, pb_utils, max_tokens, row)
    start = time.perf_counter() + 0.5
    feed.window = (start, start + duration)
    try:
        for _ in range(streams):
            feed.submit()
        if not feed.idle.wait(duration + 60):
            raise RuntimeError("the in-process engine did not finish")
    finally:
        model.finalize()
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--streams", default="1,4,16")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--duration", type=float, default=4.0)
    parser.add_argument("--trees", default="", help="more kiln src folders (comma-separated)")
    parser.add_argument("--no-triton", action="store_true")
    args = parser.parse_args()
    counts = [int(s) for s in args.streams.split(",")]
    console = Console(width=120)
    kilns: list[tuple[str, str | None]] = [("kiln", None)]
    kilns += [(f"kiln {t}", str(Path(t).resolve())) for t in args.trees.split(",") if t]
    rows: list[Row] = []
    with tempfile.TemporaryDirectory() as tmp:
        repo = Path(tmp) / "models"
        build_repository(repo)
        for streams in counts:
            rows.append(run_in_process(streams, args.max_tokens, args.duration))
        servers: list[tuple[str, Any]] = [
            (name, lambda work, tree=tree: _kiln(repo, work, tree)) for name, tree in kilns
        ]
        reason = missing_reason("pytriton") if not args.no_triton else "--no-triton"
        if reason is None:
            servers.append(("Triton", lambda work: start_triton(repo, (MODEL,), work, MODEL_FILE)))
        else:
            console.print(f"[yellow]Triton skipped: {reason}[/]")
        for name, start in servers:
            work = Path(tmp) / name.replace(" ", "_").replace("/", "_")
            work.mkdir()
            server = start(work)
            server.name = name
            try:
                server.wait_ready((MODEL,))
                for streams in counts:
                    row = drive(server, streams, args.max_tokens, args.duration)
                    rows.append(row)
                    console.print(f"{name} streams={streams}: {row.rate:,.0f} tokens/s")
            finally:
                server.close()
    _report(console, rows, counts)


def _kiln(repo: Path, work: Path, tree: str | None) -> ServerProcess:
    previous = os.environ.get("PYTHONPATH")
    if tree is not None:
        os.environ["PYTHONPATH"] = tree  # the workers inherit it
    try:
        return start_kiln(repo, work)
    finally:
        if previous is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = previous


def _report(console: Console, rows: list[Row], counts: list[int]) -> None:
    limit = {r.streams: r.rate for r in rows if r.server == "engine in-process"}
    table = Table(title="Decoupled streams on one instance (gRPC, tokens/s)")
    for column in ("server", "streams", "tokens/s", "of engine", "TTFT p50 ms", "TTFT p99 ms"):
        table.add_column(column, justify="left" if column == "server" else "right")
    for row in rows:
        first = sorted(row.first_token_s) or [float("nan")]
        p99 = first[min(len(first) - 1, int(0.99 * len(first)))]
        table.add_row(
            row.server,
            str(row.streams),
            f"{row.rate:,.0f}",
            f"{row.rate / limit[row.streams]:.2f}",
            f"{statistics.median(first) * 1e3:.1f}",
            f"{p99 * 1e3:.1f}",
        )
    console.print(table)


if __name__ == "__main__":
    main()
