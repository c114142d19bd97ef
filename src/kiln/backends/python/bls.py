"""BLS: a Python model calling another kiln model, through the server that runs it.

The server installs its ``infer`` and event loop in ``kiln.backends.host`` when it starts
(the backends never import the server, which sits above them). A worker's request
that arrives on the event loop (the worker's pipe is read there: ``loopcall.py``) runs as a
task of the loop (``call_async``); one that arrives on an instance's thread (which is
waiting on that worker anyway) is handed to the loop, the thread blocking until the answer
is back (``call``). A decoupled call (``call_stream``) and model control go through a
thread either way: the model reads their answers from a queue.
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
from collections.abc import Iterator
from typing import Any

import numpy as np

from kiln.backends.host import Host, InferStream, current
from kiln.core.errors import KilnError, Status
from kiln.core.types import DataType, InferenceRequest, InferenceResponse, InferInput
from kiln.core.types import RequestedOutput as Wanted

# One response of a decoupled BLS call: (outputs or None, final, error or None, the
# response's parameters).
Part = tuple[dict[str, np.ndarray] | None, bool, KilnError | None, dict[str, Any]]


def _require_target(model: str) -> Host:
    target = current()
    if target is None:
        raise KilnError(
            f"BLS request to model '{model}': no server is running to answer it",
            Status.UNAVAILABLE,
        )
    return target


def request(
    model: str,
    version: int,
    inputs: dict[str, np.ndarray],
    outputs: list[str],
    request_id: str,
    parameters: dict[str, Any],
    trace_parent: int = 0,
) -> InferenceRequest:
    """The request a worker's BLS call describes (``KilnError`` for unusable tensors)."""
    try:
        tensors = [
            InferInput(name, DataType.from_numpy(a.dtype), tuple(a.shape), a)
            for name, a in inputs.items()
        ]
    except ValueError as exc:
        raise KilnError(f"BLS request to model '{model}': {exc}") from None
    return InferenceRequest(
        model_name=model,
        model_version="" if version < 0 else str(version),
        id=request_id,
        inputs=tensors,
        outputs=[Wanted(name) for name in outputs],
        parameters=parameters,
        trace_parent=trace_parent,
    )


def call(request: InferenceRequest) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """Run one request (from a thread other than the loop's); its outputs and the
    response's parameters."""
    target = _require_target(request.model_name)
    future = asyncio.run_coroutine_threadsafe(target.infer(request), target.loop)
    return _answer(future.result())


async def call_async(request: InferenceRequest) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """``call`` from a coroutine: on the server's loop it runs there, with no thread in
    between; on another loop, it waits for the server's."""
    target = _require_target(request.model_name)
    if asyncio.get_running_loop() is target.loop:
        return _answer(await target.infer(request))
    future = asyncio.run_coroutine_threadsafe(target.infer(request), target.loop)
    return _answer(await asyncio.wrap_future(future))


def _answer(response: InferenceResponse) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    return {out.name: out.data for out in response.outputs}, dict(response.parameters)


class StreamCall:
    """A decoupled BLS call in flight (``call_stream``): iterate it for its parts, the last
    one final. ``cancel()`` (any thread) ends the callee's request as a client leaving
    does: the model sees ``is_cancelled()``, what it sends after that is dropped, and the
    stream ends with a final CANCELLED error unless it had already ended."""

    def __init__(self, request: InferenceRequest, infer_stream: InferStream, target: Host):
        self._model = request.model_name
        self._loop = target.loop
        self._parts: queue.SimpleQueue[Part] = queue.SimpleQueue()
        self._task: asyncio.Task[None] | None = None
        self._cancelled = False
        asyncio.run_coroutine_threadsafe(self._pump(request, infer_stream), self._loop)

    def __iter__(self) -> Iterator[Part]:
        return _until_final(self._parts)

    def cancel(self) -> None:
        self._cancelled = True
        with contextlib.suppress(RuntimeError):  # the loop is closed: nothing runs there
            self._loop.call_soon_threadsafe(self._cancel_on_loop)

    def _cancel_on_loop(self) -> None:
        if self._task is not None and not self._task.done():
            self._task.cancel()

    async def _pump(self, request: InferenceRequest, infer_stream: InferStream) -> None:
        parts = self._parts
        self._task = asyncio.current_task()
        if self._cancelled:  # before it began
            parts.put(cancelled(self._model))
            return
        try:
            async for response in infer_stream(request):
                final = bool(response.parameters.get("triton_final_response", True))
                got = {out.name: out.data for out in response.outputs}
                params = dict(response.parameters)
                parts.put((got if (got or not final) else None, final, None, params))
                if final:
                    return
            parts.put((None, True, None, {}))
        except asyncio.CancelledError:  # cancel(): the callee's stream closed above
            parts.put(cancelled(self._model))
        except KilnError as exc:
            parts.put((None, True, exc, {}))
        except Exception as exc:
            parts.put((None, True, KilnError(f"{type(exc).__name__}: {exc}"), {}))


def cancelled(model: str) -> Part:
    """The final part of a decoupled BLS call its caller cancelled."""
    error = KilnError(
        f"BLS request to model '{model}' was cancelled by the calling model", Status.CANCELLED
    )
    return (None, True, error, {})


def call_stream(request: InferenceRequest) -> StreamCall:
    """Run one request and yield its responses as they come (from a thread other than
    the loop's): ``exec(decoupled=True)``. The last part is final; it has no outputs when
    the model sent the FINAL flag on its own, as in Triton. An error ends the stream as a
    final part."""
    target = _require_target(request.model_name)
    infer_stream = target.infer_stream
    if infer_stream is None:
        raise KilnError(f"BLS request to model '{request.model_name}': this server cannot stream")
    # the FINAL flag always comes back, with or without a response
    request.parameters["triton_enable_empty_final_response"] = True
    return StreamCall(request, infer_stream, target)


def control(call: dict[str, Any]) -> Any:
    """A model's ``load_model`` / ``unload_model`` / ``is_model_ready`` (from a thread
    other than the loop's): what the server answers; ``KilnError`` when it fails."""
    name = str(call.get("name", ""))
    target = current()
    if target is None or target.control is None:
        raise KilnError(
            f"model control of '{name}' from a Python model: no server is running to do it",
            Status.UNAVAILABLE,
        )
    server = target.control
    action = call.get("action")

    async def run() -> Any:
        if action == "ready":
            return server.model_ready(name, str(call.get("version") or ""))
        if action == "load":
            parameters: dict[str, Any] = dict(call.get("files") or {})
            if call.get("config"):
                parameters["config"] = call["config"]
            await server.load_model(name, parameters)
            return None
        if action == "unload":
            dependents = bool(call.get("unload_dependents"))
            await server.unload_model(name, {"unload_dependents": dependents})
            return None
        raise KilnError(f"unknown model control action {action!r}", Status.INVALID_ARG)

    return asyncio.run_coroutine_threadsafe(run(), target.loop).result()


def _until_final(parts: queue.SimpleQueue[Part]) -> Iterator[Part]:
    while True:
        part = parts.get()
        yield part
        if part[1]:
            return
