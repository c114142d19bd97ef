"""The worker's side of the pipe to the server: ``Channel`` (the batches in, the responses
out, BLS calls and model control) and ``BlsStream`` (a decoupled BLS call's responses).

Messages on the pipe are small tuples; tensor bytes live in the arenas (see ``arena.py``).
Only one thread reads at a time; responses of decoupled models may be sent from any thread,
so sending takes a lock.
"""

from __future__ import annotations

import collections
import json
import threading
from collections.abc import Callable
from typing import Any, cast

from kiln.backends.python import pb_utils
from kiln.backends.python.arena import Arena, Header
from kiln.backends.python.wire import Wire

__all__ = ["RECLAIM_BYTES", "BlsStream", "Channel", "Encoded", "ErrorInfo", "bls_parameters"]

ErrorInfo = tuple[str, int]  # (message, TritonError code)
# One response as the server takes it: its tensors' headers, its error, and its
# parameters (JSON, None when it has none).
Encoded = tuple[list[Header], ErrorInfo | None, str | None]

#: How much the side arenas hold before the worker has the server confirm it read them,
#: and starts them over (``Channel._reclaim_if_due``).
RECLAIM_BYTES = 1 << 20


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
    """The worker's side of the pipe, as ``pb_utils`` uses it (BLS, decoupled sends).

    **Reading.** One thread at a time reads the pipe (``_await``): the main thread waiting
    for its next batch, or a thread of the model's waiting for a BLS answer, a grant or a
    reclaim. The reader hands every message to ``keep``, which files it where its waiter
    looks, and wakes the waiters; a waiter whose message came reads on if nobody else does.

    **Sending** takes ``lock``: a message and the arena bytes it names go out together.
    A decoupled model's responses and every BLS call use the *side* arenas, not the
    batch's slot: a model's threads may send after its ``execute`` returned, while the next
    batch has the slot. The server copies what a message names out of the side arena as it
    reads the message, so once it has answered a ``reclaim`` sent after them, their bytes
    are free (``_reclaim_if_due``).
    """

    def __init__(
        self,
        conn: Wire,
        arenas: list[tuple[Arena, Arena]],
        side: tuple[Arena, Arena] | None = None,
        flags: Arena | None = None,
    ) -> None:
        self.conn = conn
        self.arenas = arenas  # (inbound, outbound) per slot; a batch names its slot
        self.inbound, self.outbound = arenas[0]
        # (BLS answers, responses and BLS calls); a test may run without them
        self.side_in, self.side_out = side if side is not None else arenas[0]
        self.flags = flags if flags is not None else arenas[0][0]
        self.side_in_used = 0  # the end of the last BLS answer read from side_in
        self.lock = threading.Lock()
        self.cond = threading.Condition()  # guards what follows, and the senders' states
        self.reading = False  # a thread is in ``conn.recv`` for everyone
        self.backlog: collections.deque[Any] = collections.deque()  # the main thread's
        # Decoupled BLS calls (``exec(decoupled=True)``) in flight: their parts as read.
        self.streams: dict[int, collections.deque[Any]] = {}
        self._next_stream = 0
        # Open senders with a window, by stream key: grants from the server.
        self.flows: dict[int, pb_utils.InferenceResponseSender] = {}
        self.answers: collections.deque[Any] = collections.deque()  # see ``keep``

    # ---- reading ---------------------------------------------------------------------
    def _await(self, ready: Callable[[], bool]) -> None:
        """Return once ``ready()`` (called under ``cond``) holds, reading the pipe while
        no other thread does."""
        cond = self.cond
        with cond:
            while not ready():
                if self.reading:
                    cond.wait()
                    continue
                self.reading = True
                cond.release()
                try:
                    message = self.conn.recv()
                finally:
                    cond.acquire()
                    self.reading = False
                    cond.notify_all()  # a waiter reads on (or sees the pipe end)
                self.keep(message)

    def keep(self, message: tuple[Any, ...]) -> None:
        """File a message where its waiter looks (under ``cond``): a decoupled BLS call's
        part to its stream, an answer to ``answers``, a grant to its sender, anything
        else (the next batch) to the main thread's backlog."""
        kind = message[0]
        if kind == "bls_part":
            parts = self.streams.get(message[1])
            if parts is not None:
                parts.append(message)
        elif kind in ("bls_result", "control_result", "reclaimed"):
            self.answers.append(message)  # the one call out (under ``lock``) reads it
        elif kind == "grant":  # (grant, key, taken), -1 lifts the window
            sender = self.flows.get(message[1])
            if sender is not None:
                if message[2] < 0:
                    sender._window = 0
                else:
                    sender._granted = max(sender._granted, message[2])
        else:
            self.backlog.append(message)

    def next_message(self) -> Any:
        """The main thread's next message (a batch, finalize)."""
        self._await(lambda: bool(self.backlog))
        with self.cond:
            return self.backlog.popleft()

    def _answer(self, kind: str) -> tuple[Any, ...]:
        """The answer of ``kind`` to the call out (under ``lock``: one at a time)."""
        answers = self.answers
        self._await(lambda: any(m[0] == kind for m in answers))
        with self.cond:
            for message in answers:
                if message[0] == kind:
                    answers.remove(message)
                    return cast(tuple[Any, ...], message)
        raise AssertionError("unreachable")

    # ---- sending ---------------------------------------------------------------------
    def send(self, message: tuple[Any, ...]) -> None:
        with self.lock:
            self.conn.send(message)

    def encode(self, response: pb_utils.InferenceResponse, arena: Arena) -> Encoded:
        params = response.parameters()
        params_or_none = None if params in ("", "{}") else params
        error = response.error()
        if error is not None:
            return [], (error.message(), error.code()), params_or_none
        headers = [arena.write(t.name(), t.as_numpy()) for t in response.output_tensors()]
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
                self.encode(response, self.side_out) if response is not None else ([], None, None)
            )
            if final and sender._request is not None:
                # the server gives the byte to another request once it has this message
                sender._request._cancel_flag = None
            has_response = response is not None
            self.conn.send(("response", sender._key, headers, error, final, has_response, params))
            sender._sent += not final
            if final:
                self._close(sender)
            self._reclaim_if_due()

    def _close(self, sender: pb_utils.InferenceResponseSender) -> None:
        with self.cond:
            sender.closed = True
            self.flows.pop(sender._key, None)
            self.cond.notify_all()  # an execute waiting for its batch's FINAL flags

    def _wait_credit(self, sender: pb_utils.InferenceResponseSender) -> None:
        """Wait while the sender's window is full, reading the pipe for grants: the model
        pauses until downstream takes its responses."""
        self._await(
            lambda: (
                sender.closed
                or sender._window <= 0
                or sender._sent - sender._granted < sender._window
            )
        )

    def _reclaim_if_due(self) -> None:
        """Under ``lock``: once the side arenas hold ``RECLAIM_BYTES``, have the server
        confirm it read everything sent so far, and start them over. The server's answers
        in ``side_in`` are free once every BLS call is answered and read: none is out
        (this holds ``lock``) and no decoupled one is open."""
        out_due = self.side_out.cursor >= RECLAIM_BYTES
        in_due = self.side_in_used >= RECLAIM_BYTES and not self.streams
        if not (out_due or in_due):
            return
        self.conn.send(("reclaim", in_due))
        self._answer("reclaimed")
        self.side_out.reset()
        if in_due:
            self.side_in_used = 0

    def close_senders(self, senders: list[pb_utils.InferenceResponseSender], error: str) -> None:
        """End a failed decoupled batch: every request still open gets ``error`` as its
        final response, and a later send from one of the model's threads is refused (it
        would otherwise answer a request that has already failed)."""
        with self.lock:
            for sender in senders:
                if sender.closed:
                    continue
                sender.closed_reason = (
                    "Unable to send response: the request was already answered with an error "
                    f"because execute raised ({error})"
                )
                if sender._request is not None:
                    sender._request._cancel_flag = None
                code = pb_utils.TritonError.INTERNAL
                self.conn.send(("response", sender._key, [], (error, code), True, False, None))
                self._close(sender)

    def release_rescheduled(self, requests: list[pb_utils.InferenceRequest]) -> list[int] | None:
        """The indices of the requests that run again in a later batch, if any. This batch
        no longer waits for their FINAL flag, and a send on them now is refused (the next
        execute gets a sender of its own). A FINAL flag already sent wins over the
        reschedule."""
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
                sender.closed_reason = (
                    "Unable to send response: the request was rescheduled "
                    "(TRITONSERVER_REQUEST_RELEASE_RESCHEDULE); it sends again from the "
                    "execute that runs it next"
                )
                self._close(sender)
                again.append(index)
        return again or None

    def wait_final(self, senders: list[pb_utils.InferenceResponseSender]) -> None:
        with self.cond:
            self.cond.wait_for(lambda: all(s.closed for s in senders))

    # ---- BLS -------------------------------------------------------------------------
    def _send_bls(self, request: pb_utils.InferenceRequest, stream: int | None = None) -> None:
        """Send a BLS call (under ``lock``): its tensors into the arena, then the message."""
        headers = [self.side_out.write(t.name(), t.as_numpy()) for t in request.inputs()]
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
        trace_id = request.trace()._trace_id
        if trace_id:  # made with trace=request.trace() of a traced request
            call["trace"] = trace_id
        self.conn.send(("bls", call))

    def call(self, request: pb_utils.InferenceRequest) -> pb_utils.InferenceResponse:
        with self.lock:
            self._send_bls(request)
            _, out_headers, error, params = self._answer("bls_result")
            response = self.response(out_headers, error, params)
            self._reclaim_if_due()
        return response

    def control(self, call: dict[str, Any]) -> Any:
        """Model control from the model (``pb_utils.load_model`` ...): the server's answer,
        or ``TritonModelException`` with its error."""
        with self.lock:
            self.conn.send(("control", call))
            _, error, value = self._answer("control_result")
        if error is not None:
            raise pb_utils.TritonModelException(error)
        return value

    def response(
        self, headers: list[Header] | None, error: ErrorInfo | None, params: str | None
    ) -> pb_utils.InferenceResponse:
        """A BLS answer as the model sees it; its tensors copied out of the arena."""
        if error is not None:
            return pb_utils.InferenceResponse(
                error=pb_utils.TritonError(error[0], error[1]), parameters=params
            )
        tensors = []
        for h in headers or ():
            tensors.append(pb_utils.Tensor(h[0], self.side_in.read(h, copy=True)))
            self.side_in_used = max(self.side_in_used, h[3] + h[4])
        return pb_utils.InferenceResponse(output_tensors=tensors, parameters=params)

    def stream(self, request: pb_utils.InferenceRequest) -> BlsStream:
        """Start a decoupled BLS call: its responses come as the stream is iterated."""
        with self.lock:
            with self.cond:
                stream_id = self._next_stream
                self._next_stream += 1
                self.streams[stream_id] = collections.deque()
            self._send_bls(request, stream_id)
        return BlsStream(self, stream_id)

    def drain_streams(self) -> None:
        """Read what is left of decoupled BLS calls nobody iterated to their end."""
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

    def cancel(self) -> None:
        """Triton's ``ResponseIterator.cancel()``: the callee's request is cancelled (its
        ``is_cancelled()`` turns True); iterate on for the final response, a CANCELLED
        error unless the callee had finished first."""
        if not self.done:
            self.channel.send(("bls_cancel", self.stream_id))

    def __next__(self) -> pb_utils.InferenceResponse:
        channel = self.channel
        parts = channel.streams.get(self.stream_id)
        if self.done or parts is None:
            raise StopIteration
        channel._await(lambda: bool(parts))
        with channel.cond:
            _, _, headers, error, final, params = parts.popleft()
        # Copied out before the stream closes: with none open, side_in may be reclaimed.
        response = channel.response(headers, error, params)
        if final:
            self.done = True
            with channel.cond:
                channel.streams.pop(self.stream_id, None)
        return response
