"""A batch as the worker takes it, and the worker's answers as the scheduler takes them.

``encode`` writes the requests' tensors into one slot's inbound arena and describes them
(names, arena headers, parameters, the offset of each request's cancellation byte and, for
a decoupled model, its stream key); ``outcomes`` turns the worker's ``executed`` or
``error`` answer into one outcome per request, reading tensors out of the slot's outbound
arena; ``response`` hands a decoupled request's response to its stream. The framing of the
messages themselves is ``wire.Wire``'s.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import json
import math
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from kiln.backends.base import BackendRequest, RequestOutcome, Rescheduled, ResponseSink
from kiln.backends.python.arena import BYTES, Arena, Header
from kiln.backends.python.bytes_tensors import deserialize_bytes
from kiln.backends.python.cancel import BatchWatch, FlagPool, OpenStream
from kiln.backends.python.deadline import BatchDeadline, timed_out
from kiln.backends.python.process import WorkerDied, WorkerProcess
from kiln.backends.python.wire import Wire
from kiln.core.errors import KilnError, Status

# pb_utils.TritonError codes -> the status a client sees
_CODES = {
    0: Status.UNKNOWN,
    1: Status.INTERNAL,
    2: Status.NOT_FOUND,
    3: Status.INVALID_ARG,
    4: Status.UNAVAILABLE,
    5: Status.UNSUPPORTED,
    6: Status.ALREADY_EXISTS,
    7: Status.CANCELLED,
}
_STATUS_CODES = {status: code for code, status in _CODES.items()}


#: NumPy kinds a BYTES input may come as (``Arena.write`` serializes them)
_BYTES_KINDS = ("O", "S", "U")
#: a batch's inputs written into its arena off the event loop: per request, their headers
Written = list[list[Header]]


@dataclass(slots=True)
class RawBytes:
    """A BYTES output copied out of the arena as it lies there, not decoded yet."""

    shape: tuple[int, ...]
    data: bytes


def _read_raw(arena: Arena, header: Header) -> Any:
    """A BYTES output copied out undecoded (one copy: the arena is free once it returns);
    any other one read as usual."""
    if header[1] != BYTES:
        return arena.read(header)
    return RawBytes(tuple(header[2]), arena.raw(header))


def status_of(code: int) -> Status:
    """The status a client sees for a ``pb_utils.TritonError`` code."""
    return _CODES.get(code, Status.INTERNAL)


def code_of(status: Status) -> int:
    """The ``pb_utils.TritonError`` code a model sees for a status (INTERNAL if none)."""
    return _STATUS_CODES.get(status, 1)


class BatchCodec:
    """Encodes batches for one worker and decodes its answers; holds a decoupled model's
    open streams (``streams``), which its responses find by key in any batch or none."""

    def __init__(
        self,
        model: str,
        decoupled: bool,
        execute_timeout: float | None,
        worker: WorkerProcess,
        flag_pool: FlagPool,
    ) -> None:
        self.model = model
        self.decoupled = decoupled
        self.execute_timeout = execute_timeout
        self.worker = worker
        self.flag_pool = flag_pool
        # A decoupled model's requests the worker may still send responses for, by key
        # (``cancel.BatchWatch``): responses find their stream by it, in any batch or none.
        self.streams: dict[int, OpenStream] = {}
        self._keys = itertools.count()

    # ---- to the worker -----------------------------------------------------------------
    def encode(
        self, requests: list[BackendRequest], slot: int = 0, written: Written | None = None
    ) -> tuple[list[dict[str, Any]], BatchWatch]:
        """The requests as the worker takes them: tensors into the slot's inbound arena,
        their cancellation bytes, and a decoupled model's streams (``end()`` the watch
        when the batch ends). ``written``: the tensors are in the arena already
        (``write_inputs``), these are their headers."""
        inbound = self.worker.arenas[slot][0]
        if written is None:
            inbound.reset()
        streams = self.streams if self.decoupled else None
        watch = BatchWatch.start(self.flag_pool, requests, streams, self._keys)
        try:
            return self._messages(requests, inbound, watch, written), watch
        except BaseException:
            watch.end()  # its flags and stream keys go back: the batch is never sent
            raise

    @staticmethod
    def bytes_in(requests: list[BackendRequest]) -> int:
        """The BYTES input elements of a batch: each costs Python work to serialize."""
        return sum(
            int(a.size)
            for r in requests
            for a in r.inputs.values()
            if isinstance(a, np.ndarray) and a.dtype.kind in _BYTES_KINDS
        )

    def write_inputs(self, requests: list[BackendRequest], slot: int) -> Written:
        """The batch's inputs written into the slot's inbound arena (for a worker thread,
        while nothing else writes that arena); ``encode`` takes their headers."""
        inbound = self.worker.arenas[slot][0]
        inbound.reset()
        return [[inbound.write(n, a) for n, a in r.inputs.items()] for r in requests]

    def _messages(
        self,
        requests: list[BackendRequest],
        inbound: Arena,
        watch: BatchWatch,
        written: Written | None,
    ) -> list[dict[str, Any]]:
        headers = written or [[inbound.write(n, a) for n, a in r.inputs.items()] for r in requests]
        wire = [
            {
                "inputs": inputs,
                "outputs": list(r.output_names),
                "request_id": r.request_id,
                "correlation_id": r.correlation_id,
                "flags": r.flags,
                "parameters": json.dumps(r.parameters, default=str) if r.parameters else "{}",
                "cancel_at": flag.offset,
            }
            for r, flag, inputs in zip(requests, watch.flags, headers, strict=True)
        ]
        for message, request in zip(wire, requests, strict=True):
            trace_id = getattr(request, "trace_id", 0)
            if trace_id:  # traced: the model's BLS calls can name it (request.trace())
                message["trace"] = trace_id
                context = getattr(request, "trace_context", None)
                if context:  # opentelemetry mode: request.trace().get_context()
                    message["trace_context"] = context
        if self.decoupled:
            for message, request, key in zip(wire, requests, watch.keys, strict=True):
                message["key"] = key
                self._flow(message, request.sink, key)
        return wire

    def _flow(self, message: dict[str, Any], sink: ResponseSink | None, key: int) -> None:
        """A stream with a window (an ensemble's ``max_inflight_requests``): the worker's
        sender pauses while a window of its responses is untaken, and the stream's grants
        reach it as ``("grant", key, taken)`` messages (``core/stream.py``)."""
        if sink is None or sink.window <= 0:
            return
        message["window"] = sink.window
        sink.on_credit(functools.partial(self._grant, self.worker.conn, key))

    def _grant(self, conn: Wire | None, key: int, taken: int) -> None:
        """On the loop; dropped when the worker that runs the stream is gone (a restarted
        one never heard of it)."""
        if conn is None:
            return
        with contextlib.suppress(WorkerDied, OSError), self.worker.sending(conn):
            conn.send(("grant", key, taken))

    # ---- from the worker ---------------------------------------------------------------
    def outcomes(
        self,
        requests: list[BackendRequest],
        answers: Any,
        batch_error: str | None,
        slot: int = 0,
        rescheduled: list[int] | None = None,
        raw_bytes: bool = False,
    ) -> list[RequestOutcome]:
        """One outcome per request from the worker's answer; ``rescheduled``: the indices of
        the requests the model released with ``TRITONSERVER_REQUEST_RELEASE_RESCHEDULE``
        (``Rescheduled``: the sequence batcher runs them again). ``raw_bytes``: BYTES
        outputs are copied out of the arena undecoded (``RawBytes``), for ``decoded``
        to finish on a worker thread."""
        if batch_error is not None:
            message = f"model '{self.model}' failed to execute: {batch_error}"
            if self.decoupled:  # a streamed request got the error as its final response
                return [{} if r.sink is not None else KilnError(message, Status.INTERNAL)
                        for r in requests]  # fmt: skip
            return [KilnError(message, Status.INTERNAL) for _ in requests]
        outcomes: list[RequestOutcome] = []
        if self.decoupled:
            outcomes = [{} for _ in requests]  # everything went out through the sinks
        else:
            for request, answer in zip(requests, answers, strict=True):
                if answer is None:  # rescheduled
                    outcomes.append({})
                    continue
                headers, error, params = answer
                if params is not None:  # the response's parameters, for the client
                    request.response_parameters = json.loads(params)
                if error is not None:
                    outcomes.append(KilnError(error[0], status_of(error[1])))
                else:
                    outbound = self.worker.arenas[slot][1]
                    if raw_bytes:
                        outcomes.append({h[0]: _read_raw(outbound, h) for h in headers})
                    else:
                        outcomes.append({h[0]: outbound.read(h) for h in headers})
        for index in rescheduled or ():
            outcomes[index] = Rescheduled(self.model)
        return outcomes

    @staticmethod
    def bytes_out(answers: Any) -> int:
        """The BYTES output elements of an ``executed`` answer (by its headers' shapes;
        a negative dimension counts as none, and fails where the tensor is read)."""
        count = 0
        for answer in answers or ():
            if answer is None or answer[1] is not None:
                continue
            for header in answer[0]:
                if header[1] == BYTES:
                    count += max(0, math.prod(header[2]))
        return count

    @staticmethod
    def decoded(outcomes: list[RequestOutcome]) -> list[RequestOutcome]:
        """``outcomes(raw_bytes=True)``'s BYTES outputs decoded, a slice at a time (for a
        worker thread)."""
        for outcome in outcomes:
            if isinstance(outcome, dict):
                for name, value in outcome.items():
                    if isinstance(value, RawBytes):
                        outcome[name] = deserialize_bytes(value.data, value.shape)
        return outcomes

    def overran(
        self, requests: list[BackendRequest], deadline: BatchDeadline
    ) -> list[RequestOutcome]:
        """The outcomes of a batch that overran ``deadline`` (its worker is being killed)."""
        if deadline.from_request:
            # The loop's timer may fire a little before the deadline by this clock (libuv
            # keeps millisecond time): the request that set the deadline has expired.
            now = max(time.monotonic_ns(), deadline.at_ns)
            return [*timed_out(self.model, [r.deadline_ns for r in requests], now)]
        error = KilnError(
            f"model '{self.model}': execute did not finish within execute_timeout_secs="
            f"{self.execute_timeout:g}; the Python worker was killed and is being restarted",
            Status.UNAVAILABLE,
        )
        return [KilnError(error.message, error.status) for _ in requests]

    def response(
        self,
        key: int,
        headers: list[Any],
        error: tuple[str, int] | None,
        final: bool,
        has_response: bool,
        params: str | None = None,
    ) -> None:
        """One response of a decoupled request, from its batch or after it (the stream's
        key names it); its tensors are copied out of the side arena now."""
        entry = self.streams.get(key)
        if entry is None:
            return  # run without a stream (a warm-up), or already failed: nobody listens
        if final:
            del self.streams[key]
            if entry.detached:  # else its batch ends its flag
                entry.flag.end()
        sink = entry.request.sink
        assert sink is not None
        if error is not None:
            sink.send(None, final, KilnError(error[0], status_of(error[1])))
            return
        side_out = self.worker.side_out
        outputs = {h[0]: side_out.read(h) for h in headers} if has_response else None
        sink.send(outputs, final, None, json.loads(params) if params is not None else None)

    def fail_open(self, error: KilnError) -> None:
        """The worker is gone: streams still open after their batch ended get ``error``
        (those of a batch in flight fail with their batch)."""
        for key, entry in list(self.streams.items()):
            if not entry.detached:
                continue
            self.streams.pop(key, None)
            entry.flag.end()
            if entry.request.sink is not None:
                entry.request.sink.send(None, True, KilnError(error.message, error.status))
