"""The server's side of cancelling a decoupled BLS call (``bls.StreamCall.cancel`` and the
backend's registry of open calls): the callee's stream is closed as when a client leaves,
and the call ends with one final CANCELLED part, however early the cancel comes."""

from __future__ import annotations

import asyncio
import textwrap
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import numpy as np

from kiln.backends import host
from kiln.backends.base import InstanceSpec
from kiln.backends.python import bls
from kiln.backends.python.backend import PythonBackend
from kiln.config.loader import parse_config_text
from kiln.core.errors import Status
from kiln.core.types import DataType, InferenceRequest, InferenceResponse, InferOutput


class Callee:
    """An endless decoupled callee: a response every millisecond until its stream closes."""

    def __init__(self) -> None:
        self.started = 0
        self.closed = 0

    async def stream(self, request: InferenceRequest) -> AsyncIterator[InferenceResponse]:
        self.started += 1
        try:
            n = 0
            while True:
                out = InferOutput("TICK", DataType.INT32, (1,), np.array([n], np.int32))
                yield InferenceResponse("ticker", "1", outputs=[out], parameters={
                    "triton_final_response": False})  # fmt: skip
                n += 1
                await asyncio.sleep(0.001)
        finally:
            self.closed += 1


async def _unary(request: InferenceRequest) -> InferenceResponse:
    raise AssertionError("unary BLS not expected")


def _request() -> InferenceRequest:
    return InferenceRequest(model_name="ticker")


async def test_a_cancel_mid_stream_closes_the_callee_and_ends_with_cancelled() -> None:
    callee = Callee()
    host.install(_unary, asyncio.get_running_loop(), callee.stream)
    try:
        call = bls.call_stream(_request())

        def consume() -> list[bls.Part]:
            parts = []
            for part in call:
                parts.append(part)
                if len(parts) == 3:
                    call.cancel()
            return parts

        parts = await asyncio.wait_for(asyncio.to_thread(consume), 30)
    finally:
        host.uninstall(_unary)
    *ticks, last = parts
    assert len(ticks) >= 3 and all(p[0] is not None and not p[1] for p in ticks)
    outputs, final, error, _ = last
    assert outputs is None and final and error is not None
    assert error.status is Status.CANCELLED
    assert error.message == "BLS request to model 'ticker' was cancelled by the calling model"
    assert callee.closed == 1  # its stream was closed, as when a client leaves


async def test_a_cancel_before_the_call_began_never_starts_the_callee() -> None:
    callee = Callee()
    host.install(_unary, asyncio.get_running_loop(), callee.stream)
    try:
        call = bls.call_stream(_request())
        call.cancel()  # on the loop's thread: the call cannot have begun yet
        parts = await asyncio.wait_for(asyncio.to_thread(list, call), 30)
    finally:
        host.uninstall(_unary)
    ((outputs, final, error, _),) = parts
    assert outputs is None and final and error is not None
    assert error.status is Status.CANCELLED
    assert callee.started == 0


CALLER_CONFIG = """
name: "caller"
backend: "python"
max_batch_size: 0
input [ { name: "X" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "Y" data_type: TYPE_INT32 dims: [ 1 ] } ]
"""

IDLE = """
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        return [pb_utils.InferenceResponse([]) for _ in requests]
"""


async def test_a_cancel_read_before_its_helper_thread_started_the_call_is_kept(
    tmp_path: Path,
) -> None:
    """The worker's cancel may be read before the helper thread that runs the call has
    begun it: the call is registered when its message is read, so the cancel sticks and the
    call ends at once instead of streaming for nobody."""
    version = tmp_path / "caller" / "1"
    version.mkdir(parents=True)
    (version / "model.py").write_text(textwrap.dedent(IDLE))
    config = parse_config_text(CALLER_CONFIG)
    spec = InstanceSpec(name="caller_0", kind="cpu", device_id=0, index=0, total_instances=1)
    backend = PythonBackend(config, version, spec)
    callee = Callee()
    host.install(_unary, asyncio.get_running_loop(), callee.stream)
    try:
        conn = backend.worker.conn
        call: dict[str, Any] = {
            "model_name": "ticker", "model_version": -1, "inputs": [], "outputs": ["TICK"],
            "request_id": "", "parameters": "{}", "stream": 5,
        }  # fmt: skip
        inputs = backend.broker.received(call, conn)  # the reader: the message is read
        backend.broker.cancel(5, conn)  # then the worker's cancel, before anything ran
        await asyncio.wait_for(asyncio.to_thread(backend.broker.stream, call, inputs, conn), 30)
        assert backend.broker.open_calls == {}
        assert callee.started == 0  # cancelled before it began
        backend.broker.cancel(5, conn)  # a late cancel of a call that ended: nothing
    finally:
        host.uninstall(_unary)
        backend.close()
