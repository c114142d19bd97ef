"""The worker process: imports the user's model.py and runs it for one instance.

Started by the server as ``python -m kiln.backends.python.worker --fd N --inbound PATH
--outbound PATH``. Messages on the pipe are small tuples; tensor bytes live in the two
arenas (see ``arena.py``). Only the main thread receives; responses of decoupled models may
be sent from any thread, so sending takes a lock. ``main`` answers the server's messages
with ``Worker`` (the model: load, initialize, execute, finalize); the pipe's worker side is
``worker_channel.Channel``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import inspect
import json
import signal
import socket
import sys
import threading
import traceback
from pathlib import Path
from typing import Any

from kiln.backends.python import pb_utils
from kiln.backends.python.arena import Arena
from kiln.backends.python.custom_metrics import MetricStore
from kiln.backends.python.wire import Wire
from kiln.backends.python.worker_channel import Channel, Encoded


async def _awaited(awaitable: Any) -> Any:
    return await awaitable


def last_line(exc: BaseException) -> str:
    """What Triton reports for a failed model function: the traceback's last line."""
    return traceback.format_exception_only(type(exc), exc)[-1].strip()


class Worker:
    def __init__(self, channel: Channel) -> None:
        self.channel = channel
        self.model: Any = None
        self.decoupled = False
        self.model_name = ""
        self.loop = asyncio.new_event_loop()  # for `async def execute` and async_exec
        self._loop_thread: threading.Thread | None = None

    def load_module(self, path: Path) -> Any:
        # Sibling modules of model.py import as Triton allows (the version folder on the path).
        sys.path.insert(0, str(path.parent))
        spec = importlib.util.spec_from_file_location("model", path)
        if spec is None or spec.loader is None:
            raise ImportError(f"cannot import {path}")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        if not hasattr(module, "TritonPythonModel"):
            raise AttributeError(f"{path} defines no class TritonPythonModel")
        return module

    def auto_complete(self, path: Path, config_json: str) -> tuple[Any, ...]:
        model_cls = self.load_module(path).TritonPythonModel
        config = pb_utils.ModelConfig(config_json)
        hook = getattr(model_cls, "auto_complete_config", None)
        if hook is not None:
            result = hook(config)
            if isinstance(result, pb_utils.ModelConfig):
                config = result
        return ("config", json.dumps(config.as_dict()))

    def initialize(self, path: Path, args: dict[str, str], decoupled: bool) -> tuple[Any, ...]:
        self.decoupled = decoupled
        self.model_name = args.get("model_name", "")
        self.model = self.load_module(path).TritonPythonModel()
        if hasattr(self.model, "initialize"):
            self.run(self.model.initialize(args))
        return ("ready", None)

    def run(self, result: Any) -> Any:
        if not inspect.isawaitable(result):
            return result
        if self._loop_thread is not None:  # the loop runs a decoupled model's executes
            return asyncio.run_coroutine_threadsafe(_awaited(result), self.loop).result()
        return self.loop.run_until_complete(result)

    def _start_loop(self) -> None:
        """Run ``self.loop`` on a thread of its own, for decoupled ``async def execute``:
        Triton runs those coroutines concurrently, each batch's next to the others'."""
        if self._loop_thread is None:
            self._loop_thread = threading.Thread(
                target=self.loop.run_forever, name="kiln-async-execute", daemon=True
            )
            self._loop_thread.start()

    def execute(
        self, wire_requests: list[dict[str, Any]], slot: int = 0, detach: bool = False
    ) -> tuple[Any, ...]:
        """One batch. ``detach`` (decoupled models): answer as soon as ``execute``
        returns, with requests still open; the model's threads (or its coroutine) send
        the rest, as in Triton. Without it, the answer waits for every FINAL flag."""
        requests: list[pb_utils.InferenceRequest] = []
        try:
            return self._execute(wire_requests, slot, requests, detach)
        finally:
            # The slot's arena is the next batch's now, and the flag of a request that
            # is over belongs to the server again.
            open_ = False
            for request in requests:
                sender = request._sender
                if sender is None or sender.closed:
                    request._cancel_flag = None
                else:
                    open_ = True
            if not open_:
                self.channel.drain_streams()

    def _execute(
        self,
        wire_requests: list[dict[str, Any]],
        slot: int,
        requests: list[pb_utils.InferenceRequest],
        detach: bool,
    ) -> tuple[Any, ...]:
        channel = self.channel
        # This batch's tensors and its responses use the slot's arenas.
        channel.inbound, channel.outbound = channel.arenas[slot]
        channel.outbound.reset()
        # A decoupled request may outlive the batch, and its slot: its inputs are copied.
        copy = self.decoupled
        for wire in wire_requests:
            inputs = [
                pb_utils.Tensor(h[0], channel.inbound.read(h, copy=copy)) for h in wire["inputs"]
            ]
            request = pb_utils.InferenceRequest(
                inputs=inputs,
                requested_output_names=wire["outputs"],
                request_id=wire["request_id"],
                correlation_id=wire["correlation_id"],
                flags=wire["flags"],
                parameters=wire["parameters"],
                trace=(
                    pb_utils.InferenceTrace(wire["trace"], wire.get("trace_context"))
                    if "trace" in wire
                    else None
                ),
            )
            request._cancel_flag = (channel.flags, wire["cancel_at"])
            if self.decoupled:
                request._sender = sender = pb_utils.InferenceResponseSender(wire["key"], request)
                if wire.get("window"):
                    sender._window = wire["window"]
                    with channel.cond:
                        channel.flows[wire["key"]] = sender
            requests.append(request)
        senders = [r._sender for r in requests if r._sender is not None]
        try:
            result = self.model.execute(requests)
            if type(result) is not list and inspect.isawaitable(result):
                if self.decoupled and detach:
                    return self._execute_async(result, requests, senders)
                result = self.run(result)
        except Exception as exc:
            traceback.print_exc()
            if not self.decoupled:
                return ("executed", None, last_line(exc), None)
            result = exc
        if self.decoupled:
            if result is not None:
                return self._fail_decoupled(result, senders)
            rescheduled = channel.release_rescheduled(requests)
            if not detach:
                # Responses may still come from the model's own threads: answer when all
                # are final.
                channel.wait_final(senders)
            return ("executed", [], None, rescheduled)
        if not isinstance(result, list | tuple) or len(result) != len(requests):
            got = len(result) if isinstance(result, list | tuple) else type(result).__name__
            return (
                "executed",
                None,
                f"execute returned {got} responses for {len(requests)} requests "
                "(it must return one InferenceResponse per request, in order)",
                None,
            )
        answers: list[Encoded | None] = []
        again: list[int] = []  # rescheduled: None in their place (what the model put is unused)
        for index, (request, response) in enumerate(zip(requests, result, strict=True)):
            if request._release_flags == pb_utils.TRITONSERVER_REQUEST_RELEASE_RESCHEDULE:
                again.append(index)
                answers.append(None)
                continue
            if not isinstance(response, pb_utils.InferenceResponse):
                return (
                    "executed",
                    None,
                    f"execute returned a {type(response).__name__} where an "
                    "InferenceResponse was expected",
                    None,
                )
            answers.append(channel.encode(response, channel.outbound))
        return ("executed", answers, None, again or None)

    def _fail_decoupled(
        self, result: Any, senders: list[pb_utils.InferenceResponseSender]
    ) -> tuple[Any, ...]:
        """A decoupled execute that raised or returned something: each request without
        its FINAL flag gets the error as its final response."""
        reason = (
            last_line(result)
            if isinstance(result, BaseException)
            else "a decoupled model's execute must return None"
        )
        self.channel.close_senders(
            senders, f"model '{self.model_name}' failed to execute: {reason}"
        )
        # The server fails only the requests nobody streams to (a warm-up's).
        return ("executed", None, reason, None)

    def _execute_async(
        self,
        coroutine: Any,
        requests: list[pb_utils.InferenceRequest],
        senders: list[pb_utils.InferenceResponseSender],
    ) -> tuple[Any, ...]:
        """A decoupled ``async def execute``: the coroutine runs on the worker's loop
        thread, next to earlier batches' that have not ended, and the batch is answered
        now. If it raises (or returns something), its open requests get the error."""
        self._start_loop()
        done = asyncio.run_coroutine_threadsafe(_awaited(coroutine), self.loop)

        def ended(future: Any) -> None:
            try:
                result = future.result()
            except BaseException as exc:
                traceback.print_exception(exc)
                result = exc
            if result is not None:
                with contextlib.suppress(Exception):  # the server may be gone
                    self._fail_decoupled(result, senders)

        done.add_done_callback(ended)
        return ("executed", [], None, self.channel.release_rescheduled(requests))

    def finalize(self) -> None:
        if self.model is not None and hasattr(self.model, "finalize"):
            self.run(self.model.finalize())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kiln.backends.python.worker")
    parser.add_argument("--fd", type=int, required=True)
    parser.add_argument("--inbound", action="append", required=True)
    parser.add_argument("--outbound", action="append", required=True)
    parser.add_argument("--side-in", required=True)
    parser.add_argument("--side-out", required=True)
    parser.add_argument("--flags", required=True)
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--metrics-dir", type=Path)
    opts = parser.parse_args(argv)
    # Ctrl-C reaches the whole process group: the server shuts its workers down itself
    # (finalize first), so the worker must not die of the same SIGINT mid-request.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    pb_utils.install()
    conn = Wire(socket.socket(fileno=opts.fd))
    arenas = [
        (Arena.attach(i), Arena.attach(o)) for i, o in zip(opts.inbound, opts.outbound, strict=True)
    ]
    side = (Arena.attach(opts.side_in), Arena.attach(opts.side_out))
    channel = Channel(conn, arenas, side, Arena.attach(opts.flags))
    pb_utils._channel = channel
    if opts.metrics_dir is not None:
        pb_utils._metrics = MetricStore(opts.metrics_dir)  # empty again after a restart
    worker = Worker(channel)
    while True:
        try:
            message = channel.next_message()
        except EOFError:
            return 0  # the server went away
        kind = message[0]
        try:
            if kind == "auto_complete":
                channel.send(worker.auto_complete(opts.model, message[1]))
                return 0
            if kind == "initialize":
                channel.send(worker.initialize(opts.model, message[1], message[2]))
            elif kind == "execute":
                channel.send(worker.execute(*message[1:]))
            elif kind == "finalize":
                worker.finalize()
                channel.send(("finalized", None))
                return 0
        except Exception as exc:
            traceback.print_exc()
            channel.send(("error", last_line(exc)))
            if kind in ("auto_complete", "initialize"):
                return 1


if __name__ == "__main__":
    sys.exit(main())
