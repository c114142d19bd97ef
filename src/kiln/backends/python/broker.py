"""The worker's requests to the server: BLS calls (``pb_utils.InferenceRequest.exec``,
plain or decoupled) and model control (``load_model`` / ``unload_model`` /
``is_model_ready``), answered through ``bls.py`` (the server the host installed,
``kiln.backends.host``).

Every answer names the pipe its call came on (``conn``): when the worker was restarted
meanwhile, the answer is dropped, since the new worker would take it as the answer to a
call of its own. A call's tensors are copied out of the side arena as its message is read
(``received``): the worker may reuse their space once a later message is answered.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import json
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from kiln.backends.python import bls
from kiln.backends.python.batch_codec import code_of
from kiln.backends.python.process import WorkerDied, WorkerProcess
from kiln.backends.python.wire import Wire
from kiln.core.activity import Activity
from kiln.core.errors import KilnError
from kiln.core.types import InferenceRequest

if TYPE_CHECKING:
    from kiln.backends.python.loopcall import WorkerPipe


@dataclass(slots=True)
class _OpenBls:
    """A decoupled BLS call of the worker's, from when its message is read until its last
    part is sent: the worker may cancel it (``BlsStream.cancel``) meanwhile."""

    cancelled: bool = False
    call: bls.StreamCall | None = None


def _params_json(params: dict[str, Any]) -> str | None:
    """A callee's response parameters for the BLS caller (``InferenceResponse.parameters()``),
    without those the server adds to every streamed response."""
    own = {k: v for k, v in params.items() if k != "triton_final_response"}
    return json.dumps(own, default=str) if own else None


class BlsBroker:
    """Answers one worker's BLS and model-control calls."""

    def __init__(
        self,
        model: str,
        worker: WorkerProcess,
        busy_poll_ns: int,
        activity: Callable[[], Activity],
    ) -> None:
        self.model = model
        #: the server's in-flight count, as the backend holds it (set after construction)
        self.activity = activity
        self.worker = worker
        self.busy_poll_ns = busy_poll_ns  # after a loop answer, see ``answer_on_loop``
        #: Decoupled BLS calls in flight, by (the pipe they came on, the worker's stream id).
        self.open_calls: dict[tuple[Wire | None, int], _OpenBls] = {}
        self._lock = threading.Lock()
        self._tasks: set[asyncio.Task[None]] = set()  # BLS calls run on the loop

    # ---- reading a call ----------------------------------------------------------------
    def received(self, call: dict[str, Any], conn: Wire | None) -> dict[str, np.ndarray]:
        """On the thread that reads the worker, as a BLS call's message is read: its
        tensors, copied out of the side arena; a decoupled call is registered now, so that
        a cancel the worker sends later finds it even before a thread has started it."""
        if call.get("stream") is not None:
            with self._lock:
                self.open_calls[(conn, call["stream"])] = _OpenBls()
        side_out = self.worker.side_out
        return {h[0]: side_out.read(h) for h in call["inputs"]}

    def _request(self, call: dict[str, Any], inputs: dict[str, np.ndarray]) -> InferenceRequest:
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

    # ---- answering it ------------------------------------------------------------------
    def call(
        self, call: dict[str, Any], inputs: dict[str, np.ndarray], conn: Wire | None = None
    ) -> None:
        """Answer a BLS call of the worker's on this thread (``WorkerDied`` when the worker
        is gone). ``conn``: the pipe the call came on."""
        if call.get("stream") is not None:
            self.stream(call, inputs, conn)
            return
        outputs: dict[str, np.ndarray] | None = None
        error: tuple[str, int] | None = None
        params: dict[str, Any] = {}
        try:
            outputs, params = bls.call(self._request(call, inputs))
        except KilnError as exc:
            error = (exc.message, code_of(exc.status))
        except Exception as exc:
            error = (f"{type(exc).__name__}: {exc}", 1)
        self._result(outputs, error, params, conn)

    def answer(
        self, call: dict[str, Any], inputs: dict[str, np.ndarray], conn: Wire | None
    ) -> None:
        """``call`` off the thread that reads the worker (a helper or executor thread). The
        worker may go away meanwhile: the reader then sees the pipe close, and the answer
        goes to nobody (``conn``: not to the worker restarted in its place)."""
        with contextlib.suppress(WorkerDied):
            self.call(call, inputs, conn)

    def answer_in_thread(
        self, call: dict[str, Any], inputs: dict[str, np.ndarray], conn: Wire | None
    ) -> None:
        """Answer a BLS call on a thread of its own."""
        name = f"kiln-bls-{self.model}"
        threading.Thread(
            target=self.answer, args=(call, inputs, conn), name=name, daemon=True
        ).start()

    def answer_on_loop(
        self, call: dict[str, Any], inputs: dict[str, np.ndarray], pipe: WorkerPipe
    ) -> None:
        """Answer a (not decoupled) BLS call that the loop read from ``pipe``: the callee
        runs as a task of the loop, and the answer goes to the worker when it is done,
        with no thread between (``call`` from a thread cost two thread hand-offs each way:
        benchmarks/HISTORY.md, "BLS calls on the event loop")."""
        # In a context of its own: the pipe's reader runs in the context of the request
        # that registered it, whose trace the call must not take for its parent (the
        # worker names the caller's trace itself, ``call["trace"]``).
        coro = self._call_async(call, inputs, pipe)
        task = asyncio.get_running_loop().create_task(coro, context=contextvars.Context())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _call_async(
        self, call: dict[str, Any], inputs: dict[str, np.ndarray], pipe: WorkerPipe
    ) -> None:
        outputs: dict[str, np.ndarray] | None = None
        error: tuple[str, int] | None = None
        params: dict[str, Any] = {}
        # A call made from an ``execute`` in progress: that batch's requests, counted in
        # flight, wait for this call, so one of them does not count meanwhile. A lone
        # request's BLS call is then a lone request too, and the callee's worker is
        # busy-polled for as the caller's is (``PythonBackend.busy_poll_budget``).
        nested = bool(pipe.calls)
        if nested:
            self.activity().inflight -= 1
        try:
            outputs, params = await bls.call_async(self._request(call, inputs))
        except KilnError as exc:
            error = (exc.message, code_of(exc.status))
        except Exception as exc:
            error = (f"{type(exc).__name__}: {exc}", 1)
        finally:
            if nested:
                self.activity().inflight += 1
        # The worker may have gone away meanwhile: the reader sees its pipe close, and
        # the answer goes to nobody (not to the worker restarted in its place).
        with contextlib.suppress(WorkerDied):
            self._result(outputs, error, params, pipe.conn)
            if nested and self.busy_poll_ns and self.activity().alone():
                # The worker goes on with the answer: its next message (the batch's
                # answer, or another call) usually follows soon.
                pipe.poll_after_answer(self.busy_poll_ns)

    def _result(
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

    # ---- decoupled calls ---------------------------------------------------------------
    def stream(
        self, call: dict[str, Any], inputs: dict[str, np.ndarray], conn: Wire | None
    ) -> None:
        """Answer a decoupled BLS call (``exec(decoupled=True)``): one ``bls_part`` message
        per response as the callee sends it, the last one final; ``conn`` as in ``call``."""
        key = (conn, call["stream"])
        with self._lock:
            entry = self.open_calls.setdefault(key, _OpenBls())
            early = entry.cancelled  # the worker cancelled it before it began
        running: bls.StreamCall | None = None
        try:
            try:
                if early:
                    parts: Iterable[bls.Part] = [bls.cancelled(call["model_name"])]
                else:
                    running = bls.call_stream(self._request(call, inputs))
                    parts = running
            except KilnError as exc:
                parts = [(None, True, exc, {})]
            except Exception as exc:  # the worker waits for a final part: it must get one
                parts = [(None, True, KilnError(f"{type(exc).__name__}: {exc}"), {})]
            with self._lock:
                entry.call = running
                cancelled = entry.cancelled
            if cancelled and running is not None:
                running.cancel()  # the worker cancelled it as it began
            self._send_parts(call["stream"], parts, conn)
        finally:
            with self._lock:
                self.open_calls.pop(key, None)
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
                error = (failure.message, code_of(failure.status))
            with worker.sending(conn):  # see _result: not into a restarted worker's arena
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

    def cancel(self, stream: int, conn: Wire | None) -> None:
        """The worker's ``BlsStream.cancel()``: cancel the callee's request (a call that
        has already ended is left alone)."""
        with self._lock:
            entry = self.open_calls.get((conn, stream))
            if entry is None:
                return
            entry.cancelled = True
            running = entry.call
        if running is not None:
            running.cancel()

    def cancel_all(self) -> None:
        """The worker is gone: nobody reads its decoupled BLS calls any more."""
        with self._lock:
            entries = list(self.open_calls.values())
            for entry in entries:
                entry.cancelled = True
        for entry in entries:
            if entry.call is not None:
                entry.call.cancel()

    # ---- model control -----------------------------------------------------------------
    def control(self, call: dict[str, Any], conn: Wire | None = None) -> None:
        """Answer a model's ``load_model`` / ``unload_model`` / ``is_model_ready``; ``conn``
        as in ``call``."""
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
