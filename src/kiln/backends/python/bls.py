"""BLS: a Python model calling another kiln model, through the server that runs it.

The server installs its ``infer`` and event loop here when it starts. A worker's request
arrives on an instance's thread (which is waiting on that worker anyway), so the thread
hands the call to the event loop and blocks until the answer is back.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

import numpy as np

from kiln.core.errors import KilnError, Status
from kiln.core.types import DataType, InferenceRequest, InferenceResponse, InferInput
from kiln.core.types import RequestedOutput as Wanted

Infer = Callable[[InferenceRequest], Coroutine[Any, Any, InferenceResponse]]


@dataclass(slots=True)
class _Target:
    infer: Infer
    loop: asyncio.AbstractEventLoop


_target: _Target | None = None


def install(infer: Infer, loop: asyncio.AbstractEventLoop) -> None:
    global _target
    _target = _Target(infer, loop)


def uninstall(infer: Infer) -> None:
    global _target
    if _target is not None and _target.infer == infer:
        _target = None


def call(
    model: str,
    version: int,
    inputs: dict[str, np.ndarray],
    outputs: list[str],
    request_id: str,
    parameters: dict[str, Any],
) -> dict[str, np.ndarray]:
    """Run one request on ``model`` (from a thread other than the loop's); its outputs."""
    target = _target
    if target is None:
        raise KilnError(
            f"BLS request to model '{model}': no server is running to answer it",
            Status.UNAVAILABLE,
        )
    try:
        tensors = [
            InferInput(name, DataType.from_numpy(a.dtype), tuple(a.shape), a)
            for name, a in inputs.items()
        ]
    except ValueError as exc:
        raise KilnError(f"BLS request to model '{model}': {exc}") from None
    request = InferenceRequest(
        model_name=model,
        model_version="" if version < 0 else str(version),
        id=request_id,
        inputs=tensors,
        outputs=[Wanted(name) for name in outputs],
        parameters=parameters,
    )
    future = asyncio.run_coroutine_threadsafe(target.infer(request), target.loop)
    response = future.result()
    return {out.name: out.data for out in response.outputs}
