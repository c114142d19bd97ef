"""The Python backend as the scheduler sees it: a thin proxy to one worker process.

A batch writes the requests' tensors into the worker's inbound arena, sends their headers,
and serves what the worker sends back until its ``executed`` answer (decoupled responses,
BLS calls). Normally the event loop does this itself (``start_requests``, ``loopcall.py``):
no instance thread sits between the loop and the worker. ``execute_requests`` does the same
on the instance's thread, for warm-up and the first batch after a restart. A worker that
dies, or overruns its batch's deadline (the earliest request ``timeout``, or
``execute_timeout_secs``: see ``deadline.py``), fails the requests in flight and is
restarted (and re-initialized) on a separate thread; the next execute waits for that
restart, but no longer than its own requests' deadlines.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import itertools
import json
import logging
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, cast

import numpy as np

from kiln.backends.base import (
    Backend,
    BackendRequest,
    InstanceSpec,
    RequestOutcome,
    Rescheduled,
    ResponseSink,
    count_parameter,
    parameter,
)
from kiln.backends.gpus import visible_gpu_count
from kiln.backends.python import bls
from kiln.backends.python.arena import Arena
from kiln.backends.python.cancel import BatchWatch, FlagPool, OpenStream
from kiln.backends.python.custom_metrics import FamilySnapshot, read_store
from kiln.backends.python.deadline import (
    BatchDeadline,
    batch_deadline,
    expired,
    not_started,
    timed_out,
)
from kiln.backends.python.env import resolve as execution_env
from kiln.backends.python.loopcall import PIPELINE_DEPTH, LoopCall, WorkerPipe
from kiln.backends.python.process import WorkerDied, WorkerProcess, WorkerTimeout
from kiln.backends.python.wire import Wire
from kiln.config.loader import ConfigError, config_from_json, config_to_json
from kiln.config.model_config_pb2 import ModelConfig
from kiln.core.errors import KilnError, Status
from kiln.core.types import InferenceRequest

log = logging.getLogger(__name__)

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

AUTO_COMPLETE_TIMEOUT_S = 60.0
# A worker that overran its deadline gets SIGTERM, then SIGKILL if still there after this.
KILL_GRACE_S = 0.5
#: ``busy_poll_us`` default: how long a lone request's event loop polls for the worker's
#: answer before it sleeps (``loopcall.LoopCall._busy_poll``).
BUSY_POLL_US = 200
#: ``pipeline_depth`` ceiling: each batch in the pipe has its own pair of arena files.
MAX_PIPELINE_DEPTH = 64


@dataclass(slots=True)
class _OpenBls:
    """A decoupled BLS call of the worker's, from when its message is read until its last
    part is sent: the worker may cancel it (``BlsStream.cancel``) meanwhile."""

    cancelled: bool = False
    call: bls.StreamCall | None = None


def _seconds(config: ModelConfig, key: str, default: float | None) -> float | None:
    raw = parameter(config, key)
    if raw is None:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise KilnError(
            f"model '{config.name}': parameter {key} must be a number of seconds, got '{raw}'"
        ) from None
    return value if value > 0 else None


def _params_json(params: dict[str, Any]) -> str | None:
    """A callee's response parameters for the BLS caller (``InferenceResponse.parameters()``),
    without those the server adds to every streamed response."""
    own = {k: v for k, v in params.items() if k != "triton_final_response"}
    return json.dumps(own, default=str) if own else None


class _Single:
    """``execute(inputs, names)`` (warm-up, sequence batcher) as a one-request list."""

    def __init__(self, inputs: dict[str, np.ndarray], output_names: list[str]) -> None:
        self.inputs = inputs
        self.output_names = output_names
        self.parameters: dict[str, Any] = {}
        self.request_id = ""
        self.sink: ResponseSink | None = None
        self.deadline_ns = 0
        self.response_parameters: dict[str, Any] | None = None
        self.correlation_id: int | str = 0
        self.flags = 0


class PythonBackend(Backend):
    name: ClassVar[str] = "python"
    default_model_filename: ClassVar[str] = "model.py"
    wants_requests: ClassVar[bool] = True

    @classmethod
    def gpu_count(cls) -> int:
        """The model's own code uses the GPU (it gets ``model_instance_kind`` GPU and its
        ``model_instance_device_id``), so ``KIND_GPU`` needs only a GPU to be there."""
        return visible_gpu_count()

    @classmethod
    def auto_complete_config(cls, config: ModelConfig, version_dir: Path) -> None:
        path = version_dir / (config.default_model_filename or cls.default_model_filename)
        if not path.is_file():
            raise KilnError(f"model '{config.name}': {path} does not exist")
        # Starting a worker costs an interpreter start: only for models that define the hook.
        if "auto_complete_config" not in path.read_text(errors="replace"):
            return
        env = execution_env(config, version_dir.parent)  # module-level imports may need it
        worker = WorkerProcess(path, f"{config.name}-autocomplete", env=env)
        try:
            worker.start()
            worker.send(("auto_complete", json.dumps(config_to_json(config))))
            kind, payload = worker.recv(time.monotonic() + AUTO_COMPLETE_TIMEOUT_S)
        except (WorkerDied, WorkerTimeout) as exc:
            raise KilnError(
                f"model '{config.name}': auto_complete_config did not answer ({exc or 'timeout'})"
            ) from None
        finally:
            worker.close(timeout=0)
        if kind != "config":
            raise KilnError(f"model '{config.name}': auto_complete_config failed: {payload}")
        try:
            config.CopyFrom(config_from_json(payload))
        except ConfigError as exc:
            raise KilnError(
                f"model '{config.name}': auto_complete_config made an invalid config: {exc}"
            ) from None

    def __init__(self, config: ModelConfig, version_dir: Path, instance: InstanceSpec) -> None:
        super().__init__(config, version_dir, instance)
        self.model = config.name
        if config.batch_input or config.batch_output:
            # Requests reach the model one by one: nothing to describe a merged batch.
            raise KilnError(
                f"model '{config.name}': the python backend hands execute its requests one "
                "by one, so batch_input and batch_output do not apply (allow_ragged_batch "
                "does: requests of any shape share an execute)",
                Status.INVALID_ARG,
            )
        self.decoupled = config.model_transaction_policy.decoupled
        # A decoupled model's requests the worker may still send responses for, by key
        # (``cancel.BatchWatch``): responses find their stream by it, in any batch or none.
        self.streams: dict[int, OpenStream] = {}
        self._keys = itertools.count()
        # Decoupled BLS calls in flight, by (the pipe they came on, the worker's stream id).
        self._bls_open: dict[tuple[Wire | None, int], _OpenBls] = {}
        self._bls_lock = threading.Lock()
        self._bls_tasks: set[asyncio.Task[None]] = set()  # BLS calls run on the loop
        self.execute_timeout = _seconds(config, "execute_timeout_secs", None)
        self.initialize_timeout = _seconds(config, "initialize_timeout_secs", 300.0)
        busy_poll_us = count_parameter(config, "busy_poll_us", "microseconds, 0 = off")
        self.busy_poll_ns = (BUSY_POLL_US if busy_poll_us is None else busy_poll_us) * 1000
        # Batches the worker's pipe holds at once (loopcall.py), each with its own arenas.
        depth = count_parameter(config, "pipeline_depth", "batches in the worker's pipe")
        if depth is not None and not 1 <= depth <= MAX_PIPELINE_DEPTH:
            raise KilnError(
                f"model '{config.name}': parameter pipeline_depth must be between 1 and "
                f"{MAX_PIPELINE_DEPTH}, got '{depth}'",
                Status.INVALID_ARG,
            )
        self.pipeline_depth = PIPELINE_DEPTH if depth is None else depth
        self.round_trip_ns: float | None = None  # moving average, send to answer
        self.busy_polled_calls = 0  # batches answered while the loop polled (tests, diagnostics)
        self.args = {
            "model_config": json.dumps(config_to_json(config)),
            "model_instance_kind": instance.kind.upper(),
            "model_instance_name": f"{instance.name}_{instance.index}",
            "model_instance_device_id": str(instance.device_id),
            "model_repository": str(version_dir.parent),
            "model_version": version_dir.name,
            "model_name": config.name,
        }
        self.worker = WorkerProcess(
            self.model_path(),
            f"{config.name}-{instance.index}",
            self.pipeline_depth,
            execution_env(config, version_dir.parent),
        )
        self.flag_pool = FlagPool(self.worker.flags)
        self._restarting: threading.Thread | None = None
        self._restart_lock = threading.Lock()  # see _begin_restart
        # Held while a worker initializes and by each batch on the instance's thread
        self._handshake = threading.Lock()
        self._pipe: WorkerPipe | None = None  # the loop's batches in the worker's pipe
        self._restart_error: str | None = None
        try:
            self._start()
        except BaseException:
            self.worker.close(timeout=0)
            raise

    # ---- worker lifecycle ------------------------------------------------------------
    def _start(self) -> None:
        with self._handshake:  # the instance's thread does not use the worker meanwhile
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

    def _begin_restart(self, cause: str, conn: Wire | None) -> None:
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
            self._fail_open(
                KilnError(
                    f"model '{self.model}': {cause} while the request was still streaming; "
                    "the worker is being restarted",
                    Status.INTERNAL,
                )
            )
            self._cancel_bls_streams()
            running = self._restarting
            if running is not None and running.is_alive():
                return  # its worker is the new one (the pipe above is the old one's)

            def restart() -> None:
                try:
                    self.worker.kill(KILL_GRACE_S)
                    self._start()
                    log.warning("model '%s': Python worker restarted", self.model)
                except Exception as exc:
                    self._restart_error = str(exc)
                    log.error("model '%s': Python worker restart failed: %s", self.model, exc)

            self._restart_error = None
            self._restarting = threading.Thread(
                target=restart, name=f"kiln-{self.model}-restart", daemon=True
            )
            self._restarting.start()

    def _await_restart(
        self, requests: list[BackendRequest], outcomes: list[RequestOutcome | None]
    ) -> None:
        """Wait for a restart in progress; a request whose deadline passes meanwhile fails.

        When all of them have failed first, the restart goes on and the next call waits.
        """
        thread = self._restarting
        while thread is not None and thread.is_alive():
            waiting = [r.deadline_ns for r, o in zip(requests, outcomes, strict=True) if o is None]
            if not waiting:
                return
            if 0 in waiting:  # one of them has no deadline: wait for the worker
                thread.join()
                break
            thread.join(max(0.0, min(waiting) / 1e9 - time.monotonic()))
            self._fail_expired(requests, outcomes)
        try:
            if self._restart_error is not None:
                self._restart_error = None
                # One more try: its error fails this request and names the cause. The
                # restart is not over meanwhile, so the loop sends the worker nothing
                # while it initializes (``start_requests``).
                self._start()
        finally:
            # Not a restart begun since (its marker stays), nor this one while it runs:
            # when every request failed first (above) the loop must still send nothing
            # to a worker that may be in its initialize (``start_requests``).
            if self._restarting is thread and (thread is None or not thread.is_alive()):
                self._restarting = None

    def _fail_expired(
        self, requests: list[BackendRequest], outcomes: list[RequestOutcome | None]
    ) -> None:
        now = time.monotonic_ns()
        for i, request in enumerate(requests):
            if outcomes[i] is None and expired(request.deadline_ns, now):
                outcomes[i] = not_started(self.model)

    # ---- execution -------------------------------------------------------------------
    def execute(
        self, inputs: dict[str, np.ndarray], output_names: list[str]
    ) -> dict[str, np.ndarray]:
        (outcome,) = self.execute_requests([_Single(inputs, output_names)])
        if isinstance(outcome, KilnError):
            raise outcome
        return outcome

    def execute_requests(self, requests: list[BackendRequest]) -> list[RequestOutcome]:
        outcomes: list[RequestOutcome | None] = [None] * len(requests)
        try:
            self._await_restart(requests, outcomes)
        except KilnError as exc:  # the worker could not be started again
            return [o if o is not None else KilnError(exc.message, exc.status) for o in outcomes]
        self._fail_expired(requests, outcomes)  # e.g. they waited out a restart
        live = [i for i, o in enumerate(outcomes) if o is None]
        if live:
            try:
                done = self._run([requests[i] for i in live])
            except KilnError as exc:
                done = [KilnError(exc.message, exc.status) for _ in live]
            for i, outcome in zip(live, done, strict=True):
                outcomes[i] = outcome
        return cast(list[RequestOutcome], outcomes)  # every entry is set by now

    def start_requests(
        self, requests: list[BackendRequest]
    ) -> asyncio.Future[list[RequestOutcome]] | None:
        """Run the batch from the event loop's thread (see ``loopcall.py``), behind any
        already in the worker's pipe; None when it must go through the instance thread: a
        restart is in progress or just failed, which that path waits for within the
        requests' deadlines."""
        conn = self.worker.conn
        if self._restarting is not None or conn is None:
            return None
        loop = asyncio.get_running_loop()
        pipe = self._pipe
        if pipe is None or (pipe.broken and not pipe.diagnosing) or pipe.conn is not conn:
            pipe = self._pipe = WorkerPipe(self, loop, conn)
        outcomes: list[RequestOutcome | None] = [None] * len(requests)
        self._fail_expired(requests, outcomes)
        call = LoopCall(self, loop, requests, outcomes)
        pipe.submit(call, self._busy_poll_budget())
        return call.future

    @property
    def queued_requests(self) -> int:
        pipe = self._pipe
        return pipe.waiting if pipe is not None and not pipe.broken else 0

    def _busy_poll_budget(self) -> int:
        """How long the loop may busy-poll for this batch's answer, ns: ``busy_poll_us``
        when this is the only request in flight in the server and the worker's recent
        round trips fit in it, else 0 (wait for the pipe on the loop)."""
        budget = self.busy_poll_ns
        if not budget or not self.activity.alone():
            return 0
        recent = self.round_trip_ns
        return budget if recent is None or recent < budget else 0

    def _observe_round_trip(self, ns: int) -> None:
        previous = self.round_trip_ns
        self.round_trip_ns = float(ns) if previous is None else 0.8 * previous + 0.2 * ns

    def _wire(
        self, requests: list[BackendRequest], slot: int = 0
    ) -> tuple[list[dict[str, Any]], BatchWatch]:
        """The requests as the worker takes them: tensors into the slot's inbound arena,
        their cancellation bytes, and a decoupled model's streams (``end()`` the watch
        when the batch ends)."""
        inbound = self.worker.arenas[slot][0]
        inbound.reset()
        streams = self.streams if self.decoupled else None
        watch = BatchWatch.start(self.flag_pool, requests, streams, self._keys)
        try:
            return self._messages(requests, inbound, watch), watch
        except BaseException:
            watch.end()  # its flags and stream keys go back: the batch is never sent
            raise

    def _messages(
        self, requests: list[BackendRequest], inbound: Arena, watch: BatchWatch
    ) -> list[dict[str, Any]]:
        wire = [
            {
                "inputs": [inbound.write(n, a) for n, a in r.inputs.items()],
                "outputs": list(r.output_names),
                "request_id": r.request_id,
                "correlation_id": r.correlation_id,
                "flags": r.flags,
                "parameters": json.dumps(r.parameters, default=str) if r.parameters else "{}",
                "cancel_at": flag.offset,
            }
            for r, flag in zip(requests, watch.flags, strict=True)
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

    def _reclaim(self, inbound_too: bool, conn: Wire | None) -> None:
        """The worker asks to start its side arenas over: everything it sent before this
        was read (messages are handled in order, and what they name is copied out as they
        are), and with ``inbound_too`` it read every BLS answer written for it."""
        with contextlib.suppress(WorkerDied, OSError), self.worker.sending(conn):
            if inbound_too:
                self.worker.side_in.reset()
            self.worker.send(("reclaimed",))

    def _fail_open(self, error: KilnError) -> None:
        """The worker is gone: streams still open after their batch ended get ``error``
        (those of a batch in flight fail with their batch)."""
        for key, entry in list(self.streams.items()):
            if not entry.detached:
                continue
            self.streams.pop(key, None)
            entry.flag.end()
            if entry.request.sink is not None:
                entry.request.sink.send(None, True, KilnError(error.message, error.status))

    def _side_message(self, message: tuple[Any, ...], conn: Wire | None) -> bool:
        """Handle a message that belongs to no batch in particular (a response finds its
        stream by key); False for a batch's answer."""
        kind = message[0]
        if kind == "response":
            self._stream(*message[1:])
        elif kind == "reclaim":
            self._reclaim(message[1], conn)
        elif kind == "bls_cancel":
            self._bls_cancel(message[1], conn)
        else:
            return False
        return True

    def _bls_received(self, call: dict[str, Any], conn: Wire | None) -> dict[str, np.ndarray]:
        """On the thread that reads the worker, as a BLS call's message is read: its tensors
        (``_bls_inputs``); a decoupled call is registered now, so that a cancel the worker
        sends later finds it even before a helper thread has started it."""
        if call.get("stream") is not None:
            with self._bls_lock:
                self._bls_open[(conn, call["stream"])] = _OpenBls()
        return self._bls_inputs(call)

    def _bls_cancel(self, stream: int, conn: Wire | None) -> None:
        """The worker's ``BlsStream.cancel()``: cancel the callee's request (a call that
        has already ended is left alone)."""
        with self._bls_lock:
            entry = self._bls_open.get((conn, stream))
            if entry is None:
                return
            entry.cancelled = True
            running = entry.call
        if running is not None:
            running.cancel()

    def _cancel_bls_streams(self) -> None:
        """The worker is gone: nobody reads its decoupled BLS calls any more."""
        with self._bls_lock:
            entries = list(self._bls_open.values())
            for entry in entries:
                entry.cancelled = True
        for entry in entries:
            if entry.call is not None:
                entry.call.cancel()

    def _died(self, exc: WorkerDied) -> KilnError:
        return KilnError(
            f"model '{self.model}': the Python worker stopped while executing ({exc}); "
            "it is being restarted",
            Status.INTERNAL,
        )

    def _overran(
        self, requests: list[BackendRequest], deadline: BatchDeadline
    ) -> list[RequestOutcome]:
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

    def _run(self, requests: list[BackendRequest]) -> list[RequestOutcome]:
        """One ``execute`` of the worker; a lost worker raises for the whole batch. Holds
        ``_handshake``: a restart begun meanwhile (the loop found the worker dead) starts
        the new worker once this batch is over, rather than in the middle of its reads."""
        with self._handshake:
            return self._run_batch(requests)

    def _run_batch(self, requests: list[BackendRequest]) -> list[RequestOutcome]:
        worker = self.worker
        conn = worker.conn
        wire, watch = self._wire(requests)
        deadline = batch_deadline(
            (r.deadline_ns for r in requests), time.monotonic_ns(), self.execute_timeout
        )
        try:
            # On this path the answer waits for every FINAL flag (``detach`` False).
            # Sent and read on the pipe taken above: if a restart began meanwhile (the loop
            # found the worker dead), this batch is lost with the old worker rather than
            # sent to the new one before its initialize.
            worker.send(("execute", wire, 0, False), conn)
            while True:
                message = worker.recv(deadline.seconds, conn)
                kind = message[0]
                if kind == "executed":
                    watch.detach_open(message[3])
                    return self._outcomes(requests, message[1], message[2], 0, message[3])
                if self._side_message(message, conn):
                    continue
                if kind == "bls" and message[1].get("stream") is not None:
                    # A stream's parts go out while this thread keeps reading the worker:
                    # a model relaying them as responses would otherwise fill its socket
                    # and wait on this thread, which would wait on it (loopcall.py does the
                    # same on the loop's executor).
                    inputs = self._bls_received(message[1], conn)
                    self._bls_helper(message[1], inputs, conn)
                elif kind == "bls":
                    self._bls(message[1], self._bls_received(message[1], conn))
                elif kind == "control":
                    self._control(message[1])
                elif kind == "error":
                    return self._outcomes(requests, None, message[1])
        except WorkerDied as exc:
            # (nothing happens if the loop found it dead first and restarts it)
            self._begin_restart(f"the Python worker stopped ({exc})", conn)
            raise self._died(exc) from None
        except WorkerTimeout:
            self._begin_restart(
                "a batch overran its deadline and the Python worker was killed", conn
            )
            return self._overran(requests, deadline)
        finally:
            watch.end()

    def _outcomes(
        self,
        requests: list[BackendRequest],
        answers: Any,
        batch_error: str | None,
        slot: int = 0,
        rescheduled: list[int] | None = None,
    ) -> list[RequestOutcome]:
        """One outcome per request from the worker's answer; ``rescheduled``: the indices of
        the requests the model released with ``TRITONSERVER_REQUEST_RELEASE_RESCHEDULE``
        (``Rescheduled``: the sequence batcher runs them again)."""
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
                    outcomes.append(KilnError(error[0], _CODES.get(error[1], Status.INTERNAL)))
                else:
                    outbound = self.worker.arenas[slot][1]
                    outcomes.append({h[0]: outbound.read(h) for h in headers})
        for index in rescheduled or ():
            outcomes[index] = Rescheduled(self.model)
        return outcomes

    def _stream(
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
            sink.send(None, final, KilnError(error[0], _CODES.get(error[1], Status.INTERNAL)))
            return
        side_out = self.worker.side_out
        outputs = {h[0]: side_out.read(h) for h in headers} if has_response else None
        sink.send(outputs, final, None, json.loads(params) if params is not None else None)

    def _bls_inputs(self, call: dict[str, Any]) -> dict[str, np.ndarray]:
        """A BLS call's tensors, copied out of the side arena as the call is read (the
        worker may reuse the space once a later message is answered)."""
        side_out = self.worker.side_out
        return {h[0]: side_out.read(h) for h in call["inputs"]}

    def _bls_request(self, call: dict[str, Any], inputs: dict[str, np.ndarray]) -> InferenceRequest:
        """The request a worker's BLS call describes."""
        return bls.request(
            call["model_name"],
            int(call["model_version"]),
            inputs,
            call["outputs"],
            call["request_id"],
            json.loads(call["parameters"] or "{}"),
            call.get("trace", 0),
        )

    def _bls(
        self, call: dict[str, Any], inputs: dict[str, np.ndarray], conn: Wire | None = None
    ) -> None:
        """Answer a BLS call of the worker's. ``conn``: the pipe the call came on (the loop
        answers from a helper thread); when the worker was restarted meanwhile, the answer
        is dropped: the new worker would take it as the answer to a call of its own."""
        if call.get("stream") is not None:
            self._bls_stream(call, inputs, conn)
            return
        outputs: dict[str, np.ndarray] | None = None
        error: tuple[str, int] | None = None
        params: dict[str, Any] = {}
        try:
            outputs, params = bls.call(self._bls_request(call, inputs))
        except KilnError as exc:
            error = (exc.message, _STATUS_CODES.get(exc.status, 1))
        except Exception as exc:
            error = (f"{type(exc).__name__}: {exc}", 1)
        self._bls_result(outputs, error, params, conn)

    def bls_on_loop(
        self, call: dict[str, Any], inputs: dict[str, np.ndarray], conn: Wire | None
    ) -> None:
        """Answer a (not decoupled) BLS call that the loop read from the worker: the callee
        runs as a task of the loop, and the answer goes to the worker when it is done,
        with no thread between (``_bls`` from a thread cost two thread hand-offs each way:
        benchmarks/HISTORY.md, "BLS calls on the event loop")."""
        # In a context of its own: the pipe's reader runs in the context of the request
        # that registered it, whose trace the call must not take for its parent (the
        # worker names the caller's trace itself, ``call["trace"]``).
        coro = self._bls_async(call, inputs, conn)
        task = asyncio.get_running_loop().create_task(coro, context=contextvars.Context())
        self._bls_tasks.add(task)
        task.add_done_callback(self._bls_tasks.discard)

    async def _bls_async(
        self, call: dict[str, Any], inputs: dict[str, np.ndarray], conn: Wire | None
    ) -> None:
        outputs: dict[str, np.ndarray] | None = None
        error: tuple[str, int] | None = None
        params: dict[str, Any] = {}
        # A call made from an ``execute`` in progress: that batch's requests, counted in
        # flight, wait for this call, so one of them does not count meanwhile. A lone
        # request's BLS call is then a lone request too, and the callee's worker is
        # busy-polled for as the caller's is (``_busy_poll_budget``).
        pipe = self._pipe
        nested = pipe is not None and pipe.conn is conn and bool(pipe.calls)
        if nested:
            self.activity.inflight -= 1
        try:
            outputs, params = await bls.call_async(self._bls_request(call, inputs))
        except KilnError as exc:
            error = (exc.message, _STATUS_CODES.get(exc.status, 1))
        except Exception as exc:
            error = (f"{type(exc).__name__}: {exc}", 1)
        finally:
            if nested:
                self.activity.inflight += 1
        # The worker may have gone away meanwhile: the reader sees its pipe close, and
        # the answer goes to nobody (not to the worker restarted in its place).
        with contextlib.suppress(WorkerDied):
            self._bls_result(outputs, error, params, conn)
            if nested and pipe is not None and self.busy_poll_ns and self.activity.alone():
                # The worker goes on with the answer: its next message (the batch's
                # answer, or another call) usually follows soon.
                pipe.poll_after_answer(self.busy_poll_ns)

    def _bls_result(
        self,
        outputs: dict[str, np.ndarray] | None,
        error: tuple[str, int] | None,
        params: dict[str, Any],
        conn: Wire | None,
    ) -> None:
        """Send a BLS call's answer: its tensors into the side arena, then the message."""
        worker = self.worker
        # Under the send lock: a restart's first message (initialize) waits for it, so the
        # arena is not written while a new worker uses it.
        with worker.sending(conn):
            headers = None
            if outputs is not None:
                try:
                    headers = [worker.side_in.write(n, a) for n, a in outputs.items()]
                except Exception as exc:
                    error = (f"{type(exc).__name__}: {exc}", 1)
            worker.send(
                ("bls_result", headers if error is None else None, error, _params_json(params))
            )

    def _answer_bls(
        self, call: dict[str, Any], inputs: dict[str, np.ndarray], conn: Wire | None
    ) -> None:
        """``_bls`` off the thread that reads the worker (a helper or executor thread). The
        worker may go away meanwhile: the reader then sees the pipe close, and the answer
        goes to nobody (``conn``: not to the worker restarted in its place)."""
        with contextlib.suppress(WorkerDied):
            self._bls(call, inputs, conn)

    def _bls_helper(
        self, call: dict[str, Any], inputs: dict[str, np.ndarray], conn: Wire | None
    ) -> None:
        """Answer a BLS call on a thread of its own."""
        name = f"kiln-bls-{self.model}"
        threading.Thread(
            target=self._answer_bls, args=(call, inputs, conn), name=name, daemon=True
        ).start()

    def _control(self, call: dict[str, Any], conn: Wire | None = None) -> None:
        """Answer a model's ``load_model`` / ``unload_model`` / ``is_model_ready``; ``conn``
        as in ``_bls``."""
        value: Any = None
        error: str | None = None
        name = call.get("name")
        if call.get("action") == "unload" and name == self.model:
            # Unloading waits for the model's requests to end, this one among them.
            error = (
                f"model '{self.model}' cannot unload itself from its own execute (the unload "
                "would wait for this request to end)"
            )
        else:
            try:
                value = bls.control(call)
            except KilnError as exc:
                error = exc.message
            except Exception as exc:
                error = f"{type(exc).__name__}: {exc}"
        with contextlib.suppress(WorkerDied), self.worker.sending(conn):
            self.worker.send(("control_result", error, value))

    def _bls_stream(
        self, call: dict[str, Any], inputs: dict[str, np.ndarray], conn: Wire | None
    ) -> None:
        """Answer a decoupled BLS call (``exec(decoupled=True)``): one ``bls_part`` message
        per response as the callee sends it, the last one final; ``conn`` as in ``_bls``."""
        key = (conn, call["stream"])
        with self._bls_lock:
            entry = self._bls_open.setdefault(key, _OpenBls())
            early = entry.cancelled  # the worker cancelled it before it began
        running: bls.StreamCall | None = None
        try:
            try:
                if early:
                    parts: Iterable[bls.Part] = [bls.cancelled(call["model_name"])]
                else:
                    running = bls.call_stream(self._bls_request(call, inputs))
                    parts = running
            except KilnError as exc:
                parts = [(None, True, exc, {})]
            except Exception as exc:  # the worker waits for a final part: it must get one
                parts = [(None, True, KilnError(f"{type(exc).__name__}: {exc}"), {})]
            with self._bls_lock:
                entry.call = running
                cancelled = entry.cancelled
            if cancelled and running is not None:
                running.cancel()  # the worker cancelled it as it began
            self._send_parts(call["stream"], parts, conn)
        finally:
            with self._bls_lock:
                self._bls_open.pop(key, None)
            if running is not None:
                # A no-op once its stream ended; else the worker went away mid-stream
                # and nobody reads it.
                running.cancel()

    def _send_parts(self, stream: int, parts: Iterable[bls.Part], conn: Wire | None) -> None:
        """A decoupled BLS call's responses to the worker, one ``bls_part`` each, until the
        final one."""
        worker = self.worker
        for outputs, final, failure, params in parts:
            error = None
            if failure is not None:
                error = (failure.message, _STATUS_CODES.get(failure.status, 1))
            with worker.sending(conn):  # see _bls: not into a restarted worker's arena
                headers = None
                if outputs is not None and error is None:
                    try:
                        headers = [worker.side_in.write(n, a) for n, a in outputs.items()]
                    except Exception as exc:
                        error, final = (f"{type(exc).__name__}: {exc}", 1), True
                message = ("bls_part", stream, headers, error, final, _params_json(params))
                worker.send(message)
            if final:
                return

    def _retire_pipe(self) -> None:
        """Before ``close`` reads the worker's pipe: the loop stops reading it. It still
        does while a stream is open (``loopcall.WorkerPipe``), and two readers would split
        the worker's messages between them."""
        pipe = self._pipe
        if pipe is None or pipe.broken:
            return
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is pipe.loop or not pipe.loop.is_running():
            with contextlib.suppress(RuntimeError):  # a closed loop reads nothing anyway
                pipe.retire()
            return
        retired = threading.Event()

        def retire() -> None:
            pipe.retire()
            retired.set()

        try:
            pipe.loop.call_soon_threadsafe(retire)
        except RuntimeError:
            return  # the loop is closed: nobody reads there any more
        retired.wait(5.0)

    def custom_metrics(self) -> list[FamilySnapshot]:
        """The model's own metric families (``pb_utils.MetricFamily``), as they are now."""
        return read_store(self.worker.metrics_dir)

    def close(self) -> None:
        if self._restarting is not None:
            self._restarting.join()
        self._retire_pipe()
        self.worker.close(timeout=10.0)
        # The server waits for streaming requests before it unloads a model; one still
        # open now (a forced unload, shutdown past --exit-timeout-secs) would never end.
        self._fail_open(
            KilnError(
                f"model '{self.model}' was unloaded while the request was still streaming",
                Status.UNAVAILABLE,
            )
        )
