"""The worker process: imports the user's model.py and runs it for one instance.

Started by the server as ``python -m kiln.backends.python.worker --fd N --inbound PATH
--outbound PATH``. Messages on the pipe are small tuples; tensor bytes live in the two
arenas (see ``arena.py``). Only the main thread receives; responses of decoupled models may
be sent from any thread, so sending takes a lock.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
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
from kiln.backends.python.arena import Arena, Header
from kiln.backends.python.custom_metrics import MetricStore
from kiln.backends.python.wire import Wire

ErrorInfo = tuple[str, int]  # (message, TritonError code)
# One response as the server takes it: its tensors' headers, its error, and its
# parameters (JSON, None when it has none).
Encoded = tuple[list[Header], ErrorInfo | None, str | None]


def last_line(exc: BaseException) -> str:
    """What Triton reports for a failed model function: the traceback's last line."""
    return traceback.format_exception_only(type(exc), exc)[-1].strip()


def bls_parameters(request: pb_utils.InferenceRequest) -> str:
    """A BLS request's parameters as the server reads them (JSON), with what Triton's BLS
    carries in its own fields: ``timeout`` (µs, for the callee's queue policy), and
    ``correlation_id`` and the START/END ``flags`` for a sequence model."""
    params = json.loads(request.parameters() or "{}")
    if request.timeout():
        params.setdefault("timeout", int(request.timeout()))
    correlation_id = request.correlation_id()
    if correlation_id not in (0, ""):
        params.setdefault("sequence_id", correlation_id)
    flags = request.flags()
    if flags & pb_utils.TRITONSERVER_REQUEST_FLAG_SEQUENCE_START:
        params.setdefault("sequence_start", True)
    if flags & pb_utils.TRITONSERVER_REQUEST_FLAG_SEQUENCE_END:
        params.setdefault("sequence_end", True)
    return json.dumps(params)


class Channel:
    """The worker's side of the pipe, as ``pb_utils`` uses it (BLS, decoupled sends)."""

    def __init__(self, conn: Wire, arenas: list[tuple[Arena, Arena]]) -> None:
        self.conn = conn
        self.arenas = arenas  # (inbound, outbound) per slot; a batch names its slot
        self.inbound, self.outbound = arenas[0]
        self.lock = threading.Lock()
        self.open_senders = 0
        self.finals = threading.Condition()
        self.backlog: collections.deque[Any] = collections.deque()  # read early, run later
        # Decoupled BLS calls (``exec(decoupled=True)``) in flight: their parts as read.
        # Whoever reads the pipe outside the main loop holds ``reader``.
        self.reader = threading.RLock()
        self.streams: dict[int, collections.deque[Any]] = {}
        self._next_stream = 0
        # The batch's senders with a window, by flow key: grants from the server.
        self.flows: dict[int, pb_utils.InferenceResponseSender] = {}
        self.answers: collections.deque[Any] = collections.deque()  # see ``keep``

    def next_message(self) -> Any:
        """The next message to handle: one read while waiting for a BLS answer first.
        Under ``reader``: a thread of the model's may still read (a sender waiting for
        a grant after its batch failed, until the server's last grant comes)."""
        with self.reader:
            return self.backlog.popleft() if self.backlog else self.conn.recv()

    def send(self, message: tuple[Any, ...]) -> None:
        with self.lock:
            self.conn.send(message)

    def encode(self, response: pb_utils.InferenceResponse) -> Encoded:
        params = response.parameters()
        params_or_none = None if params in ("", "{}") else params
        error = response.error()
        if error is not None:
            return [], (error.message(), error.code()), params_or_none
        headers = [self.outbound.write(t.name(), t.as_numpy()) for t in response.output_tensors()]
        return headers, None, params_or_none

    def send_response(
        self,
        sender: pb_utils.InferenceResponseSender,
        response: pb_utils.InferenceResponse | None,
        final: bool,
    ) -> None:
        if not final:
            self._wait_credit(sender)
        with self.lock:  # the arena's cursor is shared by every sending thread
            if sender.closed:
                raise pb_utils.TritonModelException(sender.closed_reason)
            headers, error, params = (
                self.encode(response) if response is not None else ([], None, None)
            )
            has_response = response is not None
            self.conn.send(("response", sender._index, headers, error, final, has_response, params))
            sender.closed = final
            sender._sent += not final
        if final:
            with self.finals:
                self.open_senders -= 1
                self.finals.notify_all()

    def _wait_credit(self, sender: pb_utils.InferenceResponseSender) -> None:
        """Wait while the sender's window is full, reading the pipe for grants (what else
        comes meanwhile is kept): the model pauses until downstream takes its responses."""

        def blocked() -> bool:
            return (
                not sender.closed
                and sender._window > 0
                and sender._sent - sender._granted >= sender._window
            )

        while blocked():
            with self.reader:
                if blocked():  # another reader may have read our grant meanwhile
                    self.keep(self.conn.recv())

    def close_senders(self, senders: list[pb_utils.InferenceResponseSender], error: str) -> None:
        """End a failed decoupled batch: every request still open gets ``error`` as its
        final response, and a later send from one of the model's threads is refused (it
        would otherwise reach the request at the same index of the next batch)."""
        with self.lock:
            for sender in senders:
                if sender.closed:
                    continue
                sender.closed = True
                sender.closed_reason = (
                    "Unable to send response: the request was already answered with an error "
                    f"because execute raised ({error})"
                )
                code = pb_utils.TritonError.INTERNAL
                self.conn.send(("response", sender._index, [], (error, code), True, False, None))
        with self.finals:
            self.open_senders = 0

    def release_rescheduled(self, requests: list[pb_utils.InferenceRequest]) -> list[int] | None:
        """The indices of the requests that run again in a later batch, if any. This batch
        no longer waits for their FINAL flag, and a send on them now is refused (the index
        would reach the request in that place of the next batch; the next execute gets a
        sender of its own). A FINAL flag already sent wins over the reschedule."""
        again = []
        with self.lock:
            for index, request in enumerate(requests):
                sender = request._sender
                if (
                    request._release_flags != pb_utils.TRITONSERVER_REQUEST_RELEASE_RESCHEDULE
                    or sender is None
                    or sender.closed
                ):
                    continue
                sender.closed = True
                sender.closed_reason = (
                    "Unable to send response: the request was rescheduled "
                    "(TRITONSERVER_REQUEST_RELEASE_RESCHEDULE); it sends again from the "
                    "execute that runs it next"
                )
                again.append(index)
        if not again:
            return None
        with self.finals:
            self.open_senders -= len(again)
            self.finals.notify_all()
        return again

    def _send_bls(self, request: pb_utils.InferenceRequest, stream: int | None = None) -> None:
        """Send a BLS call (under ``lock``): its tensors into the arena, then the message."""
        headers = [self.outbound.write(t.name(), t.as_numpy()) for t in request.inputs()]
        call = {
            "model_name": request.model_name(),
            "model_version": request.model_version(),
            "request_id": request.request_id(),
            "outputs": request.requested_output_names(),
            "parameters": bls_parameters(request),
            "inputs": headers,
        }
        if stream is not None:
            call["stream"] = stream
        self.conn.send(("bls", call))

    def call(self, request: pb_utils.InferenceRequest) -> pb_utils.InferenceResponse:
        with self.lock:
            self._send_bls(request)
            message = self._answer("bls_result")
        _, out_headers, error, params = message
        return self.response(out_headers, error, params)

    def control(self, call: dict[str, Any]) -> Any:
        """Model control from the model (``pb_utils.load_model`` ...): the server's answer,
        or ``TritonModelException`` with its error."""
        with self.lock:
            self.conn.send(("control", call))
            _, error, value = self._answer("control_result")
        if error is not None:
            raise pb_utils.TritonModelException(error)
        return value

    def _answer(self, kind: str) -> tuple[Any, ...]:
        """Read until the message of ``kind`` (under ``lock``: one call out at a time),
        keeping what else comes meanwhile."""
        with self.reader:
            while True:
                # another reader (a stream's, a sender waiting for a grant) may have read
                # it; one call is out at a time, so an answer there is this call's
                message: tuple[Any, ...] = (
                    self.answers.popleft() if self.answers else self.conn.recv()
                )
                if message[0] == kind:
                    return message
                if message[0] not in ("bls_result", "control_result"):
                    self.keep(message)

    def response(
        self, headers: list[Header] | None, error: ErrorInfo | None, params: str | None
    ) -> pb_utils.InferenceResponse:
        """A BLS answer as the model sees it; its tensors copied out of the arena."""
        if error is not None:
            return pb_utils.InferenceResponse(
                error=pb_utils.TritonError(error[0], error[1]), parameters=params
            )
        tensors = [pb_utils.Tensor(h[0], self.inbound.read(h, copy=True)) for h in headers or ()]
        return pb_utils.InferenceResponse(output_tensors=tensors, parameters=params)

    def keep(self, message: tuple[Any, ...]) -> None:
        """A message read while waiting for another: a decoupled BLS call's part goes to
        its stream; anything else (the server may already have sent the next batch:
        loopcall's pipelining) runs after this batch."""
        if message[0] == "bls_part":
            parts = self.streams.get(message[1])
            if parts is not None:
                parts.append(message)
            return
        if message[0] in ("bls_result", "control_result"):
            self.answers.append(message)  # the one call out (under ``lock``) reads it
            return
        if message[0] == "grant":  # (grant, flow, taken), -1 lifts the window
            sender = self.flows.get(message[1])
            if sender is not None:
                if message[2] < 0:
                    sender._window = 0
                else:
                    sender._granted = max(sender._granted, message[2])
            return
        self.backlog.append(message)

    def stream(self, request: pb_utils.InferenceRequest) -> BlsStream:
        """Start a decoupled BLS call: its responses come as the stream is iterated."""
        with self.lock:
            stream_id = self._next_stream
            self._next_stream += 1
            self.streams[stream_id] = collections.deque()
            self._send_bls(request, stream_id)
        return BlsStream(self, stream_id)

    def drain_streams(self) -> None:
        """Read what is left of the batch's decoupled BLS calls: the server writes their
        parts into this batch's arena, so they must end before the batch does."""
        for stream_id in list(self.streams):
            for _ in BlsStream(self, stream_id):
                pass


class BlsStream:
    """The responses of one decoupled BLS call, in order; the last may have no outputs
    (the callee's FINAL flag alone), as in Triton."""

    def __init__(self, channel: Channel, stream_id: int) -> None:
        self.channel = channel
        self.stream_id = stream_id
        self.done = False

    def __iter__(self) -> BlsStream:
        return self

    def __next__(self) -> pb_utils.InferenceResponse:
        channel = self.channel
        parts = channel.streams.get(self.stream_id)
        if self.done or parts is None:
            raise StopIteration
        while not parts:
            with channel.reader:
                if not parts:  # another reader may have read ours meanwhile
                    channel.keep(channel.conn.recv())
        _, _, headers, error, final, params = parts.popleft()
        if final:
            self.done = True
            channel.streams.pop(self.stream_id, None)
        return channel.response(headers, error, params)


class Worker:
    def __init__(self, channel: Channel) -> None:
        self.channel = channel
        self.model: Any = None
        self.decoupled = False
        self.model_name = ""
        self.loop = asyncio.new_event_loop()  # for `async def execute` and async_exec

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
        if inspect.isawaitable(result):
            return self.loop.run_until_complete(result)
        return result

    def execute(self, wire_requests: list[dict[str, Any]], slot: int = 0) -> tuple[Any, ...]:
        requests: list[pb_utils.InferenceRequest] = []
        try:
            return self._execute(wire_requests, slot, requests)
        finally:
            self.channel.drain_streams()
            self.channel.flows.clear()
            for request in requests:  # the slot's arena is the next batch's now
                request._cancel_flag = None

    def _execute(
        self,
        wire_requests: list[dict[str, Any]],
        slot: int,
        requests: list[pb_utils.InferenceRequest],
    ) -> tuple[Any, ...]:
        channel = self.channel
        # This batch's tensors, its responses and its BLS calls use the slot's arenas.
        channel.inbound, channel.outbound = channel.arenas[slot]
        channel.outbound.reset()
        for index, wire in enumerate(wire_requests):
            inputs = [
                pb_utils.Tensor(h[0], channel.inbound.read(h, copy=False)) for h in wire["inputs"]
            ]
            request = pb_utils.InferenceRequest(
                inputs=inputs,
                requested_output_names=wire["outputs"],
                request_id=wire["request_id"],
                correlation_id=wire["correlation_id"],
                flags=wire["flags"],
                parameters=wire["parameters"],
            )
            request._cancel_flag = (channel.inbound, wire["cancel_at"])
            if self.decoupled:
                request._sender = sender = pb_utils.InferenceResponseSender(index, request)
                if wire.get("window"):
                    sender._window = wire["window"]
                    channel.flows[wire["flow"]] = sender
            requests.append(request)
        if self.decoupled:
            with channel.finals:
                channel.open_senders = len(requests)
        try:
            result = self.run(self.model.execute(requests))
        except Exception as exc:
            traceback.print_exc()
            if not self.decoupled:
                return ("executed", None, last_line(exc), None)
            result = exc
        if self.decoupled:
            if result is not None:
                reason = (
                    last_line(result)
                    if isinstance(result, BaseException)
                    else "a decoupled model's execute must return None"
                )
                senders = [r._sender for r in requests if r._sender is not None]
                channel.close_senders(
                    senders, f"model '{self.model_name}' failed to execute: {reason}"
                )
                # The server fails only the requests nobody streams to (a warm-up's).
                return ("executed", None, reason, None)
            rescheduled = channel.release_rescheduled(requests)
            # Responses may still come from the model's own threads: answer when all are final.
            with channel.finals:
                channel.finals.wait_for(lambda: channel.open_senders <= 0)
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
            answers.append(channel.encode(response))
        return ("executed", answers, None, again or None)

    def finalize(self) -> None:
        if self.model is not None and hasattr(self.model, "finalize"):
            self.run(self.model.finalize())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kiln.backends.python.worker")
    parser.add_argument("--fd", type=int, required=True)
    parser.add_argument("--inbound", action="append", required=True)
    parser.add_argument("--outbound", action="append", required=True)
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
    channel = Channel(conn, arenas)
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
