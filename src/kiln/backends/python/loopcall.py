"""Python-worker batches driven by the event loop, with no instance thread, pipelined.

Why not the instance thread: docs/design/python-backend-loop.md. The loop writes the batch
into the arena and the pipe itself, watches the pipe with ``add_reader`` and decodes the
worker's answer when it comes, so the only wake-ups are the worker's and the loop's own.

**Pipelining.** A worker runs one ``execute`` at a time, but the next batch need not wait
for the previous answer to be sent: ``WorkerPipe`` keeps up to the model's
``pipeline_depth`` batches in the pipe (``PIPELINE_DEPTH`` unless its config says), oldest
first, each with its own pair of arenas (``slot``). The worker finds the next batch
waiting when it finishes one, so under load it neither sleeps between batches nor waits
for the loop to hand the next one over; the model still sees its batches one at a time, in
order. Every ``executed`` (or ``error``) answer belongs to the oldest batch; responses of
decoupled requests find their stream by key, and BLS calls may come from any batch or from
a model's own thread between batches.

What blocks stays off the loop: a decoupled BLS call (its parts queue up for a thread) and
model control go to a thread of the loop's default executor, and so does the handling of a
worker that died (waiting for its exit status). A plain BLS call runs as a task of the loop:
the callee is served by this same loop, and its answer goes back to the worker when done.
When a worker dies or overruns a deadline, the oldest batch fails and the batches queued
behind it, which never started, fail with ``NotStarted``: the instance runs them again on
its thread, after the restart.

**Large BYTES tensors off the loop.** Each BYTES element costs Python work to serialize
into the arena and to decode out of it (16 M elements: ~6 s each way). A batch with more
than ``OFF_LOOP_ENCODE_ELEMENTS`` BYTES inputs is written into its slot's arena on a
worker thread (``BatchCodec.write_inputs``) before it is sent; batches submitted
meanwhile wait behind it (``_queued``), so the worker still gets them in the order they
came. An answer with more than that many BYTES outputs is copied out of its arena on the
loop (one copy: the slot is free again) and decoded on a thread (``BatchCodec.decoded``);
answers after it resolve behind it (``_answers``), in order. Every small batch stays on
the loop with no thread hop.

The pipe is the worker's ``wire.Wire``: the loop reads into the same buffer the thread path
uses, so the two paths can take turns on one worker.

**Detached requests.** A decoupled model's batch is answered when its ``execute`` returns
(``detach``); requests still without their FINAL flag stay in ``BatchCodec.streams``, and
the loop keeps reading the pipe while any does, between batches too. Only the loop path
detaches: the thread path (warm-up, the first batch after a restart) waits for every FINAL
flag, so no stream is open when it reads the pipe in the loop's turn.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import threading
import time
from collections import deque
from typing import TYPE_CHECKING, Any, cast

from kiln.backends.base import BackendRequest, NotStarted, RequestOutcome
from kiln.backends.python.deadline import BatchDeadline, batch_deadline
from kiln.backends.python.process import ARENA_SLOTS, WorkerDied
from kiln.backends.python.wire import Wire
from kiln.core.errors import KilnError, Status
from kiln.core.offloop import OFF_LOOP_ENCODE_ELEMENTS

if TYPE_CHECKING:
    from kiln.backends.python.backend import PythonBackend
    from kiln.backends.python.batch_codec import Written
    from kiln.backends.python.cancel import BatchWatch

log = logging.getLogger(__name__)

#: Batches one worker may have in its pipe at once by default (config parameter
#: ``pipeline_depth``): the running one and those behind it, each with its own pair of
#: arenas.
PIPELINE_DEPTH = ARENA_SLOTS


class LoopCall:
    """One batch for the worker; ``future`` resolves with one outcome per request."""

    def __init__(
        self,
        backend: PythonBackend,
        loop: asyncio.AbstractEventLoop,
        requests: list[BackendRequest],
        outcomes: list[RequestOutcome | None],
    ) -> None:
        """``outcomes``: one per request, None for those still to run (the others, e.g.
        expired in the queue, are answered as they are)."""
        self.backend = backend
        self.loop = loop
        self.outcomes = outcomes
        self.live = [i for i, o in enumerate(outcomes) if o is None]
        self.requests = [requests[i] for i in self.live]  # what the worker executes
        self.deadline = BatchDeadline()
        self.future: asyncio.Future[list[RequestOutcome]] = loop.create_future()
        self.slot = 0  # which pair of arenas carries its tensors
        self.watch: BatchWatch | None = None  # its requests' cancellation bytes, once sent
        self.began_ns = 0  # when the worker could start it (sent, or the one before ended)
        self.written: Written | None = None  # its inputs' headers, written off the loop
        self.busy_poll_ns = 0  # its busy-poll budget, kept while it waits its turn
        self.answered: list[RequestOutcome] | None = None  # outcomes waiting for their turn
        self.decoding = False  # its BYTES outputs are being decoded on a thread

    def resolve(self, done: list[RequestOutcome]) -> None:
        """Answer the batch: ``done`` has one outcome per executed request."""
        if self.watch is not None:
            self.watch.end()
        if self.future.done():
            return
        outcomes = self.outcomes
        for i, outcome in zip(self.live, done, strict=True):
            outcomes[i] = outcome
        self.future.set_result(cast(list[RequestOutcome], outcomes))

    def fail(self, error: BaseException) -> None:
        if self.watch is not None:
            self.watch.end()
        if not self.future.done():
            self.future.set_exception(error)

    def handle(self, message: tuple[Any, ...]) -> list[RequestOutcome] | None:
        """The worker's answer to this batch (``executed`` or ``error``): its outcomes, or
        None when its BYTES outputs were copied out to be decoded off the loop (into
        ``answered``, by ``decode``)."""
        codec = self.backend.codec
        if message[0] == "executed":
            if self.watch is not None:  # requests still open stream on after the batch
                self.watch.detach_open(message[3])
            answers, error = message[1], message[2]
            if error is None and codec.bytes_out(answers) > OFF_LOOP_ENCODE_ELEMENTS:
                self.answered = codec.outcomes(
                    self.requests, answers, None, self.slot, message[3], raw_bytes=True
                )
                return None
            return codec.outcomes(self.requests, answers, error, self.slot, message[3])
        return codec.outcomes(self.requests, None, message[1], self.slot)

    def decode(self) -> None:
        """On a worker thread: the BYTES outputs ``handle`` copied out, decoded."""
        assert self.answered is not None
        self.answered = self.backend.codec.decoded(self.answered)


class WorkerPipe:
    """The batches sent to one worker process and not answered yet, oldest first."""

    def __init__(self, backend: PythonBackend, loop: asyncio.AbstractEventLoop, conn: Wire) -> None:
        self.backend = backend
        self.loop = loop
        self.conn = conn
        self.calls: deque[LoopCall] = deque()
        self.session = backend.session
        self.codec = backend.codec
        self.broker = backend.broker
        self.streams = backend.codec.streams  # a decoupled model's open requests, by key
        self.broken = False  # the worker was lost: nothing more is sent on this pipe
        self.diagnosing = False  # its exit status is being taken, the restart not begun
        self._held: list[LoopCall] = []  # arrived meanwhile
        self.depth = backend.pipeline_depth  # the worker has one pair of arenas per batch
        self._next_slot = 0
        # Batches not sent yet because one before them (the first) is being written into
        # its arena off the loop (``_writing``), oldest first.
        self._queued: deque[LoopCall] = deque()
        self._writing = False
        # Answered batches from the first one whose outputs are decoded off the loop on:
        # each is resolved once those before it are.
        self._answers: deque[LoopCall] = deque()
        self._fd = -1
        self._timer: asyncio.TimerHandle | None = None

    @property
    def waiting(self) -> int:
        """Requests in batches behind the running one: they wait for the worker as others
        wait for an instance (``nv_inference_pending_request_count``). ``list`` copies the
        deque without letting another thread in, so a scrape may read it from its own."""
        behind = list(self.calls)[1:] + list(self._queued)
        return sum(len(call.requests) for call in behind)

    def submit(self, call: LoopCall, busy_poll_ns: int) -> None:
        """Send the batch behind those in the pipe. With ``busy_poll_ns`` and an empty
        pipe, poll for the answer for up to that long before handing the wait to the loop
        (see ``_busy_poll``). A batch of many BYTES input elements is written into its
        arena on a thread first; it and the batches behind it wait in ``_queued``."""
        if not self._queued and not self._heavy(call):
            self._send(call, busy_poll_ns)
            return
        call.busy_poll_ns = busy_poll_ns
        self._queued.append(call)
        self._pump()

    def _heavy(self, call: LoopCall) -> bool:
        return bool(call.requests) and (
            self.codec.bytes_in(call.requests) > OFF_LOOP_ENCODE_ELEMENTS
        )

    def _pump(self) -> None:
        """Send the queued batches in order, up to the first that must be written off the
        loop: that one gets the next slot (no batch is sent meanwhile, so nothing else
        writes that arena, and the worker is done with it: ``len(calls) < depth``) and is
        written on a thread; ``_written`` sends it and pumps again."""
        queued = self._queued
        while queued and not self._writing:
            call = queued[0]
            usable = not self.broken and len(self.calls) < self.depth
            if not (usable and self._heavy(call)):
                queued.popleft()
                self._send(call, call.busy_poll_ns)  # (fails a batch with no room, as ever)
                continue
            self._writing = True
            call.slot = self._next_slot
            self._next_slot = (self._next_slot + 1) % self.depth
            written = self.loop.run_in_executor(
                None, self.codec.write_inputs, call.requests, call.slot
            )
            written.add_done_callback(functools.partial(self._written, call))

    def _written(self, call: LoopCall, done: asyncio.Future[Written]) -> None:
        """``call``'s inputs are in its arena: send it, then those behind it."""
        self._writing = False
        self._queued.popleft()
        error = done.exception() if not done.cancelled() else asyncio.CancelledError()
        if error is not None:
            self._next_slot = call.slot  # nothing was sent: the slot is the next one's
            log.error("model '%s': could not write a batch's inputs: %r",
                      self.backend.model, error)  # fmt: skip
            call.fail(
                KilnError(
                    f"model '{self.backend.model}': could not write the batch's inputs for "
                    f"the Python worker: {type(error).__name__}: {error}",
                    Status.INTERNAL,
                )
            )
        else:
            call.written = done.result()
            self._send(call, call.busy_poll_ns)
        self._pump()

    def _send(self, call: LoopCall, busy_poll_ns: int) -> None:
        if self.broken:
            if self.diagnosing:
                self._held.append(call)
            else:
                call.fail(NotStarted())
            return
        if not call.requests:
            call.resolve([])
            return
        if call.written is None and len(self.calls) >= self.depth:
            # Its arenas would overwrite a batch still in the pipe. Schedulers hand an
            # instance at most pipeline_depth batches at once; this guards the invariant.
            log.error("model '%s': Python worker pipe already full", self.backend.model)
            call.fail(
                KilnError(
                    f"model '{self.backend.model}': internal error: the Python worker "
                    f"already has {self.depth} batches in flight"
                )
            )
            return
        written, call.written = call.written, None
        if written is None:
            call.slot = self._next_slot
            self._next_slot = (self._next_slot + 1) % self.depth
        idle = not self.calls
        self.calls.append(call)
        backend = self.backend
        try:
            wire, call.watch = self.codec.encode(call.requests, call.slot, written)
            # A decoupled batch is answered when execute returns (``detach``): requests
            # still open stream on, and the pipe is read while any is.
            # On this pipe's worker only: a restart begun on another thread since the
            # pipe was chosen makes this WorkerDied, not a batch for the new worker.
            self.session.worker.send(("execute", wire, call.slot, backend.decoupled), self.conn)
        except WorkerDied as exc:
            # The worker is gone and never got this batch: it runs again after the
            # restart, like those queued behind a lost one.
            self.calls.pop()
            self._held.append(call)
            self._lost(exc)
            return
        except BaseException as exc:
            # Nothing reached the worker (a message is pickled whole before it is
            # written): undo the queueing, or every later answer would go to this batch
            # and the model would hang until a reload. Only this batch fails.
            self.calls.pop()
            self._next_slot = call.slot
            if not isinstance(exc, Exception):
                call.fail(KilnError(f"model '{backend.model}': the batch was not sent"))
                raise
            log.exception("model '%s': could not send a batch to the Python worker", backend.model)
            call.fail(
                exc
                if isinstance(exc, KilnError)
                else KilnError(
                    f"model '{backend.model}': could not send the batch to the Python worker: "
                    f"{type(exc).__name__}: {exc}",
                    Status.INTERNAL,
                )
            )
            return
        if idle:
            self._begin(call)
            if busy_poll_ns and self._busy_poll(call, call.began_ns + busy_poll_ns):
                backend.busy_polled_calls += 1
                return
        self._watch()

    # ---- the head of the pipe ----------------------------------------------------------
    def _begin(self, call: LoopCall) -> None:
        """``call`` is the oldest now: the worker runs it next; its deadline starts."""
        call.began_ns = now = time.monotonic_ns()
        call.deadline = batch_deadline(
            (r.deadline_ns for r in call.requests), now, self.backend.execute_timeout
        )
        if call.deadline.at_ns:
            delay = max(0.0, (call.deadline.at_ns - now) / 1e9)
            self._timer = self.loop.call_later(delay, self._overran)

    def _ended(self) -> None:
        """The oldest batch was answered."""
        call = self.calls.popleft()
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self.backend.observe_round_trip(time.monotonic_ns() - call.began_ns)
        if self.calls:
            self._begin(self.calls[0])

    # ---- reading -----------------------------------------------------------------------
    def _busy_poll(self, call: LoopCall, until_ns: int) -> bool:
        """Poll the pipe without sleeping until the worker's first message or ``until_ns``;
        True when that ended ``call``.

        Only a lone request busy-polls (``PythonBackend.start_requests``): the loop has
        nothing else to do meanwhile, and going to sleep costs it a wake-up when the answer
        comes, which on a VM's idle vCPU is tens of microseconds of latency and CPU
        (benchmarks/HISTORY.md, "Python-backend overhead"). Linux's ``busy_poll`` socket
        option makes the same trade for network receives."""
        clock = time.monotonic_ns
        conn = self.conn
        try:
            while not conn.fill(wait=False):
                if clock() >= until_ns:
                    return False
        except (EOFError, OSError):
            self._lost(WorkerDied(""))
            return True
        self._drain()
        return call.future.done() or self.broken

    def poll_after_answer(self, budget_ns: int) -> None:
        """The loop answered the worker for a lone request (a BLS call from the running
        batch): poll for the worker's next message for up to ``budget_ns`` instead of
        waiting for the loop to be woken (see ``_busy_poll``)."""
        if self.broken or not self.calls:
            return
        self._busy_poll(self.calls[0], time.monotonic_ns() + budget_ns)

    def _readable(self) -> None:
        try:
            # Not waiting: a busy poll (``poll_after_answer``) may have read what made the
            # socket readable since the loop saw it so.
            if not self.conn.fill(wait=False):
                return
        except (EOFError, OSError):
            self._lost(WorkerDied(""))
            return
        self._drain()

    def _drain(self) -> None:
        """Handle every whole message in order: a batch's answer goes to the oldest batch;
        responses, BLS calls and the rest may come in any batch or between batches."""
        conn = self.conn
        backend = self.backend
        broker = self.broker
        while (self.calls or self.streams) and not self.broken:
            ready, message = conn.take()
            if not ready:
                break
            kind = message[0]
            if kind in ("executed", "error"):
                if not self.calls:
                    self._stray(kind)
                    return
                self._answer(self.calls[0], message)
                self._ended()
            elif backend.side_message(message, conn):
                pass
            elif kind == "bls":
                # Its tensors are read now: the worker may reuse their space later.
                inputs = broker.received(message[1], conn)
                if message[1].get("stream") is None:  # the callee runs as a loop task
                    broker.answer_on_loop(message[1], inputs, self)
                else:
                    # A decoupled one's parts are written from a thread while the loop
                    # keeps reading the worker: a model relaying each part as a response
                    # fills its socket, and written from the loop (blocking writes) the
                    # two would wait on each other's full buffer.
                    self.loop.run_in_executor(None, broker.answer, message[1], inputs, conn)
            elif kind == "control":  # a load or unload waits for the repository: not either
                self.loop.run_in_executor(None, broker.control, message[1], conn)
        if self.broken:
            return
        if self.calls or self.streams:
            self._watch()  # e.g. streams left open by a batch answered while busy-polling
            return
        self._unwatch()
        if conn.pending:
            self._stray(f"{conn.pending} bytes")

    def _answer(self, call: LoopCall, message: tuple[Any, ...]) -> None:
        """Resolve the batch the answer belongs to, after the batches answered before it;
        its BYTES outputs, when many, are decoded on a thread first."""
        done = call.handle(message)
        if done is None:  # decoded on a thread: it and those answered after it wait
            call.decoding = True
            self._answers.append(call)
            decoded = self.loop.run_in_executor(None, call.decode)
            decoded.add_done_callback(functools.partial(self._decoded, call))
        elif self._answers:
            call.answered = done
            self._answers.append(call)
        else:
            call.resolve(done)

    def _decoded(self, call: LoopCall, done: asyncio.Future[None]) -> None:
        """``call``'s outputs are decoded: resolve the answered batches that are ready, in
        order."""
        call.decoding = False
        error = done.exception() if not done.cancelled() else asyncio.CancelledError()
        if error is not None:
            log.error("model '%s': could not decode a batch's BYTES outputs: %r",
                      self.backend.model, error)  # fmt: skip
            message = (
                f"model '{self.backend.model}': could not read the batch's BYTES outputs: "
                f"{type(error).__name__}: {error}"
            )
            call.answered = [KilnError(message, Status.INTERNAL) for _ in call.requests]
        answers = self._answers
        while answers and not answers[0].decoding:
            head = answers.popleft()
            outcomes, head.answered = head.answered, None
            assert outcomes is not None
            head.resolve(outcomes)

    def _stray(self, what: str) -> None:
        """Nothing may follow the last answer: the next batch would read it as its own."""
        log.error(
            "model '%s': the Python worker sent %s after its last answer; restarting it",
            self.backend.model,
            what,
        )
        self.broken = True
        self._unwatch()
        self.session.begin_restart(f"the Python worker sent {what} out of turn", self.conn)

    def retire(self) -> None:
        """On the loop: the backend is closing and reads the pipe itself from now on (the
        worker's last words); a stream still open is failed by the backend."""
        self.broken = True
        self._unwatch()

    def retire_threadsafe(self) -> None:
        """``retire`` from any thread (the backend's ``close``), before it reads the
        worker's pipe itself: the loop still reads it while a stream is open, and two
        readers would split the worker's messages between them."""
        if self.broken:
            return
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is self.loop or not self.loop.is_running():
            with contextlib.suppress(RuntimeError):  # a closed loop reads nothing anyway
                self.retire()
            return
        retired = threading.Event()

        def retire() -> None:
            self.retire()
            retired.set()

        try:
            self.loop.call_soon_threadsafe(retire)
        except RuntimeError:
            return  # the loop is closed: nobody reads there any more
        retired.wait(5.0)

    def _watch(self) -> None:
        if self._fd < 0:
            self._fd = self.conn.fileno()
            self.loop.add_reader(self._fd, self._readable)

    def _unwatch(self) -> None:
        if self._fd >= 0:
            self.loop.remove_reader(self._fd)
            self._fd = -1
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    # ---- losing the worker -------------------------------------------------------------
    def _take_all(self) -> tuple[LoopCall | None, list[LoopCall]]:
        """Stop using this pipe: (the batch the worker was running, those behind it)."""
        self.broken = True
        self._unwatch()
        head = self.calls.popleft() if self.calls else None
        rest = list(self.calls)
        self.calls.clear()
        return head, rest

    def _lost(self, exc: WorkerDied) -> None:
        """The pipe closed: the worker died. Its exit status (a wait) and the restart are
        taken on a thread; the batches are answered once the restart has begun."""
        head, rest = self._take_all()
        session = self.session
        self.diagnosing = True

        conn = self.conn

        def diagnose() -> KilnError:
            text = str(exc) or session.worker.exit_text()
            # Nothing happens if the instance's thread met the dead worker first and
            # restarted it: a second restart would kill the new worker.
            session.begin_restart(f"the Python worker stopped ({text})", conn)
            return session.died(WorkerDied(text))

        done = self.loop.run_in_executor(None, diagnose)

        def answer(done: asyncio.Future[KilnError]) -> None:
            self.diagnosing = False
            error = done.exception()
            if head is not None:
                if error is not None:
                    head.fail(error)
                else:
                    failure = done.result()
                    head.resolve(
                        [KilnError(failure.message, failure.status) for _ in head.requests]
                    )
            self._restart_the_rest(rest)

        done.add_done_callback(answer)

    def _overran(self) -> None:
        self._timer = None
        # The loop may run this late, after the worker answered in time: uvloop runs due
        # timers before it polls for I/O, so a loop held up past the deadline (a slow
        # callback) finds the answer unread. Take what has come before killing for it.
        head = self.calls[0] if self.calls else None
        with contextlib.suppress(EOFError, OSError):  # the reader handles the end
            while self.conn.fill(wait=False):
                pass
        self._drain()
        if self.broken or not self.calls or self.calls[0] is not head:
            return  # answered (a batch behind it began with its own timer) or lost
        head, rest = self._take_all()
        # kills (with its grace) on the restart thread
        self.session.begin_restart(
            "a batch overran its deadline and the Python worker was killed", self.conn
        )
        if head is not None:
            head.resolve(self.codec.overran(head.requests, head.deadline))
        self._restart_the_rest(rest)

    def _restart_the_rest(self, rest: list[LoopCall]) -> None:
        """The batches that never started run again once the restart has begun."""
        held, self._held = self._held, []
        for call in (*rest, *held):
            call.fail(NotStarted())
