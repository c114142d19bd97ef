"""One Python-backend instance's worker process over its life: start (``initialize``),
restart after a death or an overrun, stop.

The ``WorkerProcess`` object, its arenas and its cancellation bytes live as long as the
backend; a restart replaces only the process and its pipe (``worker.conn``). A restart runs
on a thread of its own (killing with a grace, then a new ``initialize``), so the requests
that failed get their answers at once; the next batch waits for it (``await_restart``), but
no longer than its own requests' deadlines.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable

from kiln.backends.base import BackendRequest, RequestOutcome
from kiln.backends.python.cancel import FlagPool
from kiln.backends.python.deadline import fail_expired
from kiln.backends.python.process import WorkerDied, WorkerProcess, WorkerTimeout
from kiln.backends.python.wire import Wire
from kiln.core.errors import KilnError, Status

log = logging.getLogger(__name__)

# A worker that overran its deadline gets SIGTERM, then SIGKILL if still there after this.
KILL_GRACE_S = 0.5


class WorkerSession:
    """Starts, restarts and stops one worker; ``on_lost`` fails what the lost worker had
    open (a decoupled model's streams, its decoupled BLS calls) as its restart begins."""

    def __init__(
        self,
        model: str,
        worker: WorkerProcess,
        args: dict[str, str],
        decoupled: bool,
        initialize_timeout: float | None,
        on_lost: Callable[[KilnError], None],
    ) -> None:
        self.model = model
        self.worker = worker
        self.args = args  # ``initialize``'s arguments (``TritonPythonModel.initialize``)
        self.decoupled = decoupled
        self.initialize_timeout = initialize_timeout
        self.on_lost = on_lost
        self.flag_pool = FlagPool(worker.flags)
        #: The restart in progress, if any; None once the next batch has seen it end.
        self.restart_thread: threading.Thread | None = None
        self._restart_lock = threading.Lock()  # see begin_restart
        #: Held while a worker initializes and by each batch on the instance's thread.
        self.handshake = threading.Lock()
        self._restart_error: str | None = None

    @property
    def restarting(self) -> bool:
        """A restart is in progress or just failed: the loop sends the worker nothing (the
        instance's thread waits for it within its requests' deadlines)."""
        return self.restart_thread is not None

    def start(self) -> None:
        """Start the worker and run its ``initialize``; ``KilnError`` when it fails."""
        with self.handshake:  # the instance's thread does not use the worker meanwhile
            self._start_worker()

    def _start_worker(self) -> None:
        worker = self.worker
        self.flag_pool.reset()
        worker.start()
        deadline = (
            None if self.initialize_timeout is None else time.monotonic() + self.initialize_timeout
        )
        try:
            worker.send(("initialize", self.args, self.decoupled))
            message = worker.recv(deadline)
        except WorkerDied as exc:
            raise KilnError(f"model '{self.model}': initialize failed: {exc}") from None
        except WorkerTimeout:
            worker.kill()
            raise KilnError(
                f"model '{self.model}': initialize did not finish within "
                f"initialize_timeout_secs={self.initialize_timeout:g}"
            ) from None
        kind = message[0]
        if kind != "ready":
            worker.kill()
            if kind != "error":  # its first words must answer initialize
                raise KilnError(
                    f"model '{self.model}': initialize failed: the worker answered "
                    f"'{kind}' instead of 'ready'"
                )
            raise KilnError(f"model '{self.model}': initialize failed: {message[1]}")

    def begin_restart(self, cause: str, conn: Wire | None) -> None:
        """Restart the worker whose pipe is ``conn``, which failed (``cause``).

        Nothing happens when that worker was replaced already (another thread found it
        dead first and its restart is over or under way: killing again would kill the new
        worker, maybe in its ``initialize``) or while a restart runs. The check and the
        start of the restart are one step under ``_restart_lock``: the loop's reader and
        the instance's thread may find the same dead worker at the same moment.
        """
        with self._restart_lock:
            if self.worker.conn is not conn:
                return
            # Killing (with its grace) happens on the restart thread: the requests that
            # failed get their answers now, not after the worker is gone.
            self.on_lost(
                KilnError(
                    f"model '{self.model}': {cause} while the request was still streaming; "
                    "the worker is being restarted",
                    Status.INTERNAL,
                )
            )
            running = self.restart_thread
            if running is not None and running.is_alive():
                return  # its worker is the new one (the pipe above is the old one's)

            def restart() -> None:
                try:
                    self.worker.kill(KILL_GRACE_S)
                    self.start()
                    log.warning("model '%s': Python worker restarted", self.model)
                except Exception as exc:
                    self._restart_error = str(exc)
                    log.error("model '%s': Python worker restart failed: %s", self.model, exc)

            self._restart_error = None
            self.restart_thread = threading.Thread(
                target=restart, name=f"kiln-{self.model}-restart", daemon=True
            )
            self.restart_thread.start()

    def await_restart(
        self, requests: list[BackendRequest], outcomes: list[RequestOutcome | None]
    ) -> None:
        """Wait for a restart in progress; a request whose deadline passes meanwhile fails.

        When all of them have failed first, the restart goes on and the next call waits.
        """
        # Under the lock ``begin_restart`` publishes and starts its thread in: a thread
        # published but not started yet is not "alive", and this batch would run on the
        # dead worker (and begin a second restart)
        with self._restart_lock:
            thread = self.restart_thread
        while thread is not None and thread.is_alive():
            waiting = [r.deadline_ns for r, o in zip(requests, outcomes, strict=True) if o is None]
            if not waiting:
                return
            if 0 in waiting:  # one of them has no deadline: wait for the worker
                thread.join()
                break
            thread.join(max(0.0, min(waiting) / 1e9 - time.monotonic()))
            fail_expired(self.model, requests, outcomes)
        try:
            if self._restart_error is not None:
                self._restart_error = None
                # One more try: its error fails this request and names the cause. The
                # restart is not over meanwhile, so the loop sends the worker nothing
                # while it initializes (``PythonBackend.start_requests``).
                self.start()
        finally:
            # Not a restart begun since (its marker stays), nor this one while it runs:
            # when every request failed first (above) the loop must still send nothing
            # to a worker that may be in its initialize (``PythonBackend.start_requests``).
            if self.restart_thread is thread and (thread is None or not thread.is_alive()):
                self.restart_thread = None

    def join_restart(self) -> None:
        """Wait for a restart in progress to end (closing the backend)."""
        with self._restart_lock:  # started, if published (see ``await_restart``)
            thread = self.restart_thread
        if thread is not None:
            thread.join()

    def reclaim(self, inbound_too: bool, conn: Wire | None) -> None:
        """The worker asks to start its side arenas over: everything it sent before this
        was read (messages are handled in order, and what they name is copied out as they
        are), and with ``inbound_too`` it read every BLS answer written for it."""
        with contextlib.suppress(WorkerDied, OSError), self.worker.sending(conn):
            if inbound_too:
                self.worker.side_in.reset()
            self.worker.send(("reclaimed",))

    def died(self, exc: WorkerDied) -> KilnError:
        """What each request of the batch the worker was running gets when it died."""
        return KilnError(
            f"model '{self.model}': the Python worker stopped while executing ({exc}); "
            "it is being restarted",
            Status.INTERNAL,
        )
