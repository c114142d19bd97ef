"""One ``execute`` of a Python worker driven by the event loop, with no instance thread.

The thread path (``PythonBackend.execute_requests`` on the instance's thread) costs, per
batch, two thread wake-ups and two GIL hand-offs on top of the worker's own round trip:
the loop hands the batch to the instance thread, which sends it and blocks in ``recv``,
then hands the answer back with ``call_soon_threadsafe``. Measured on a 2-core VM, that hop
was most of what kiln's Python backend cost over its ONNX Runtime backend
(benchmarks/README.md, "Python-backend overhead"). Here the loop writes the batch into the
arena and the pipe itself, watches the pipe with ``add_reader`` and decodes the worker's
answer when it comes, so the only wake-ups are the worker's and the loop's own.

What blocks stays off the loop: a BLS call (it waits for another model, which runs on this
same loop) goes to a thread of the loop's default executor, and so does the handling of a
worker that died or overran its deadline (waiting for its exit status, killing it).

The pipe is the worker's ``wire.Wire``: the loop reads into the same buffer the thread path
uses, so the two paths can take turns on one worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import TYPE_CHECKING, Any, cast

from kiln.backends.base import BackendRequest, RequestOutcome
from kiln.backends.python.deadline import BatchDeadline, batch_deadline
from kiln.backends.python.process import WorkerDied
from kiln.backends.python.wire import Wire
from kiln.core.errors import KilnError

if TYPE_CHECKING:
    from kiln.backends.python.backend import PythonBackend

log = logging.getLogger(__name__)


class LoopCall:
    """Sends one batch to the worker and resolves ``future`` with one outcome per request."""

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
        self._fd = -1
        self._timer: asyncio.TimerHandle | None = None
        self._over = False
        self._sent_ns = 0

    def start(self, execute_timeout: float | None, busy_poll_ns: int = 0) -> None:
        """Send the batch; with ``busy_poll_ns``, first poll the pipe for the answer for up
        to that long before handing the wait to the loop (see ``_busy_poll``)."""
        if not self.requests:
            self._resolve([])
            return
        backend = self.backend
        worker = backend.worker
        assert worker.conn is not None
        self.deadline = batch_deadline(
            (r.deadline_ns for r in self.requests), time.monotonic_ns(), execute_timeout
        )
        try:
            worker.send(("execute", backend._wire(self.requests)))
        except WorkerDied as exc:
            self._lost(exc)
            return
        self._sent_ns = time.monotonic_ns()
        if busy_poll_ns and self._busy_poll(worker.conn, self._sent_ns + busy_poll_ns):
            backend.busy_polled_calls += 1
            return
        self._fd = worker.conn.fileno()
        self.loop.add_reader(self._fd, self._readable, worker.conn)
        if self.deadline.at_ns:
            delay = max(0.0, (self.deadline.at_ns - time.monotonic_ns()) / 1e9)
            self._timer = self.loop.call_later(delay, self._overran)

    def _resolve(self, done: list[RequestOutcome]) -> None:
        """Answer the batch: ``done`` has one outcome per executed request."""
        if self.future.done():
            return
        outcomes = self.outcomes
        for i, outcome in zip(self.live, done, strict=True):
            outcomes[i] = outcome
        self.future.set_result(cast(list[RequestOutcome], outcomes))

    # ---- the pipe --------------------------------------------------------------------
    def _busy_poll(self, conn: Wire, until_ns: int) -> bool:
        """Poll the pipe without sleeping until the worker's first message or ``until_ns``;
        True when that ended the call.

        Only a lone request busy-polls (``PythonBackend.start_requests``): the loop has
        nothing else to do meanwhile, and going to sleep costs it a wake-up when the answer
        comes, which on a VM's idle vCPU is tens of microseconds of latency and CPU
        (benchmarks/README.md, "Python-backend overhead"). Linux's ``busy_poll`` socket
        option makes the same trade for network receives."""
        clock = time.monotonic_ns
        try:
            while not conn.fill(wait=False):
                if clock() >= until_ns:
                    return False
        except (EOFError, OSError):
            self._lost(WorkerDied(""))
            return True
        while not self._over:
            ready, message = conn.take()
            if not ready:
                break
            self._handle(message)
        return self._over

    def _readable(self, conn: Wire) -> None:
        try:
            conn.fill()  # the loop said it is readable: this does not block
        except (EOFError, OSError):
            self._lost(WorkerDied(""))
            return
        while not self._over:
            ready, message = conn.take()
            if not ready:
                return
            self._handle(message)

    def _handle(self, message: tuple[Any, ...]) -> None:
        backend = self.backend
        kind = message[0]
        if kind == "executed":
            self._finish(backend._outcomes(self.requests, message[1], message[2]))
        elif kind == "error":
            self._finish(backend._outcomes(self.requests, None, message[1]))
        elif kind == "response":
            backend._stream(self.requests, *message[1:])
        elif kind == "bls":
            # The call waits for another model served by this loop: not on the loop.
            self.loop.run_in_executor(None, self._bls, message[1])

    def _bls(self, call: dict[str, Any]) -> None:
        # The worker may go away meanwhile: the reader then sees the pipe close.
        with contextlib.suppress(WorkerDied):
            self.backend._bls(call)

    # ---- ending ----------------------------------------------------------------------
    def _stop_watching(self) -> None:
        self._over = True
        if self._fd >= 0:
            self.loop.remove_reader(self._fd)
            self._fd = -1
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _finish(self, outcomes: list[RequestOutcome]) -> None:
        self._stop_watching()
        self.backend._observe_round_trip(time.monotonic_ns() - self._sent_ns)
        conn = self.backend.worker.conn
        pending = conn.pending if conn is not None else 0
        if pending:
            # Nothing may follow "executed": the next batch would read it as its own.
            log.error(
                "model '%s': the Python worker sent %d bytes after its answer; restarting it",
                self.backend.model,
                pending,
            )
            self.backend._begin_restart()
        self._resolve(outcomes)

    def _lost(self, exc: WorkerDied) -> None:
        """The pipe closed: the worker died. Its exit status (a wait) and the restart are
        taken on a thread; the batch is answered when the status is known."""
        self._stop_watching()
        backend = self.backend

        def diagnose() -> KilnError:
            text = str(exc) or backend.worker._exit_text()
            backend._begin_restart()
            return backend._died(WorkerDied(text))

        done = self.loop.run_in_executor(None, diagnose)
        done.add_done_callback(self._answer_lost)

    def _answer_lost(self, done: asyncio.Future[KilnError]) -> None:
        error = done.exception()
        if error is not None:
            if not self.future.done():
                self.future.set_exception(error)
            return
        failure = done.result()
        self._resolve([KilnError(failure.message, failure.status) for _ in self.requests])

    def _overran(self) -> None:
        self._timer = None
        self._stop_watching()
        self.backend._begin_restart()  # kills (with its grace) on the restart thread
        self._resolve(self.backend._overran(self.requests, self.deadline))
