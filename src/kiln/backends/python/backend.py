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

The work is shared by three collaborators, each used by both paths:
``worker_session.py`` (``WorkerSession``: start, restart and stop of the worker),
``batch_codec.py`` (``BatchCodec``: a batch into the arenas, the worker's answers and
responses out of them) and ``broker.py`` (``BlsBroker``: the worker's BLS and
model-control calls to the server).
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any, ClassVar, cast

import numpy as np

from kiln.backends.base import (
    Backend,
    BackendRequest,
    InstanceSpec,
    RequestOutcome,
    ResponseSink,
    count_parameter,
    parameter,
)
from kiln.backends.gpus import visible_gpu_count
from kiln.backends.python.batch_codec import BatchCodec
from kiln.backends.python.broker import BlsBroker
from kiln.backends.python.custom_metrics import FamilySnapshot, read_store
from kiln.backends.python.deadline import batch_deadline, fail_expired
from kiln.backends.python.env import resolve as execution_env
from kiln.backends.python.loopcall import PIPELINE_DEPTH, LoopCall, WorkerPipe
from kiln.backends.python.process import WorkerDied, WorkerProcess, WorkerTimeout
from kiln.backends.python.wire import Wire
from kiln.backends.python.worker_session import WorkerSession
from kiln.config.loader import ConfigError, config_from_json, config_to_json
from kiln.config.model_config_pb2 import ModelConfig
from kiln.core.errors import KilnError, Status

AUTO_COMPLETE_TIMEOUT_S = 60.0
#: ``busy_poll_us`` default: how long a lone request's event loop polls for the worker's
#: answer before it sleeps (``loopcall.WorkerPipe.submit``).
BUSY_POLL_US = 200
#: ``pipeline_depth`` ceiling: each batch in the pipe has its own pair of arena files.
MAX_PIPELINE_DEPTH = 64


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
        self.execute_timeout = _seconds(config, "execute_timeout_secs", None)
        initialize_timeout = _seconds(config, "initialize_timeout_secs", 300.0)
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
        args = {
            "model_config": json.dumps(config_to_json(config)),
            "model_instance_kind": instance.kind.upper(),
            "model_instance_name": f"{instance.name}_{instance.index}",
            "model_instance_device_id": str(instance.device_id),
            "model_repository": str(version_dir.parent),
            "model_version": version_dir.name,
            "model_name": config.name,
        }
        worker = WorkerProcess(
            self.model_path(),
            f"{config.name}-{instance.index}",
            self.pipeline_depth,
            execution_env(config, version_dir.parent),
        )
        self.session = WorkerSession(
            self.model, worker, args, self.decoupled, initialize_timeout, self._lost
        )
        self.codec = BatchCodec(
            self.model, self.decoupled, self.execute_timeout, worker, self.session.flag_pool
        )
        self.broker = BlsBroker(self.model, worker, self.busy_poll_ns, lambda: self.activity)
        self.pipe: WorkerPipe | None = None  # the loop's batches in the worker's pipe
        try:
            self.session.start()
        except BaseException:
            worker.close(timeout=0)
            raise

    @property
    def worker(self) -> WorkerProcess:
        """The worker process (the same object across restarts; its pipe changes)."""
        return self.session.worker

    def _lost(self, error: KilnError) -> None:
        """The worker is gone (its restart begins): what it had open fails with ``error``."""
        self.codec.fail_open(error)
        self.broker.cancel_all()

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
            self.session.await_restart(requests, outcomes)
        except KilnError as exc:  # the worker could not be started again
            return [o if o is not None else KilnError(exc.message, exc.status) for o in outcomes]
        fail_expired(self.model, requests, outcomes)  # e.g. they waited out a restart
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
        conn = self.session.worker.conn
        if self.session.restarting or conn is None:
            return None
        loop = asyncio.get_running_loop()
        pipe = self.pipe
        if pipe is None or (pipe.broken and not pipe.diagnosing) or pipe.conn is not conn:
            pipe = self.pipe = WorkerPipe(self, loop, conn)
        outcomes: list[RequestOutcome | None] = [None] * len(requests)
        fail_expired(self.model, requests, outcomes)
        call = LoopCall(self, loop, requests, outcomes)
        pipe.submit(call, self.busy_poll_budget())
        return call.future

    @property
    def queued_requests(self) -> int:
        pipe = self.pipe
        return pipe.waiting if pipe is not None and not pipe.broken else 0

    def busy_poll_budget(self) -> int:
        """How long the loop may busy-poll for this batch's answer, ns: ``busy_poll_us``
        when this is the only request in flight in the server and the worker's recent
        round trips fit in it, else 0 (wait for the pipe on the loop)."""
        budget = self.busy_poll_ns
        if not budget or not self.activity.alone():
            return 0
        recent = self.round_trip_ns
        return budget if recent is None or recent < budget else 0

    def observe_round_trip(self, ns: int) -> None:
        """A batch of the loop's took ``ns`` from send (or its turn) to answer."""
        previous = self.round_trip_ns
        self.round_trip_ns = float(ns) if previous is None else 0.8 * previous + 0.2 * ns

    def side_message(self, message: tuple[Any, ...], conn: Wire | None) -> bool:
        """Handle a message that belongs to no batch in particular (a response finds its
        stream by key); False for a batch's answer."""
        kind = message[0]
        if kind == "response":
            self.codec.response(*message[1:])
        elif kind == "reclaim":
            self.session.reclaim(message[1], conn)
        elif kind == "bls_cancel":
            self.broker.cancel(message[1], conn)
        else:
            return False
        return True

    def _run(self, requests: list[BackendRequest]) -> list[RequestOutcome]:
        """One ``execute`` of the worker; a lost worker raises for the whole batch. Holds
        the session's ``handshake``: a restart begun meanwhile (the loop found the worker
        dead) starts the new worker once this batch is over, rather than in the middle of
        its reads."""
        with self.session.handshake:
            return self._run_batch(requests)

    def _run_batch(self, requests: list[BackendRequest]) -> list[RequestOutcome]:
        session, codec, broker = self.session, self.codec, self.broker
        worker = session.worker
        conn = worker.conn
        wire, watch = codec.encode(requests)
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
                    return codec.outcomes(requests, message[1], message[2], 0, message[3])
                if self.side_message(message, conn):
                    continue
                if kind == "bls" and message[1].get("stream") is not None:
                    # A stream's parts go out while this thread keeps reading the worker:
                    # a model relaying them as responses would otherwise fill its socket
                    # and wait on this thread, which would wait on it (loopcall.py does the
                    # same on the loop's executor).
                    inputs = broker.received(message[1], conn)
                    broker.answer_in_thread(message[1], inputs, conn)
                elif kind == "bls":
                    broker.call(message[1], broker.received(message[1], conn))
                elif kind == "control":
                    broker.control(message[1])
                elif kind == "error":
                    return codec.outcomes(requests, None, message[1])
        except WorkerDied as exc:
            # (nothing happens if the loop found it dead first and restarts it)
            session.begin_restart(f"the Python worker stopped ({exc})", conn)
            raise session.died(exc) from None
        except WorkerTimeout:
            session.begin_restart(
                "a batch overran its deadline and the Python worker was killed", conn
            )
            return codec.overran(requests, deadline)
        finally:
            watch.end()

    def custom_metrics(self) -> list[FamilySnapshot]:
        """The model's own metric families (``pb_utils.MetricFamily``), as they are now."""
        return read_store(self.worker.metrics_dir)

    def close(self) -> None:
        self.session.join_restart()
        if self.pipe is not None:
            # Before ``close`` reads the worker's pipe: two readers would split its
            # messages between them.
            self.pipe.retire_threadsafe()
        self.worker.close(timeout=10.0)
        # The server waits for streaming requests before it unloads a model; one still
        # open now (a forced unload, shutdown past --exit-timeout-secs) would never end.
        self.codec.fail_open(
            KilnError(
                f"model '{self.model}' was unloaded while the request was still streaming",
                Status.UNAVAILABLE,
            )
        )
