"""The server a model runs in, for backends that call back into it (BLS).

The server sits above the backends and is never imported by them: it installs its
``infer``, its event loop and its model control here when it starts (``Server.start``)
and takes them back when it stops. The Python backend's BLS (``python/bls.py``) reaches
the server only through what is installed here.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Coroutine
from dataclasses import dataclass
from typing import Any, Protocol

from kiln.core.types import InferenceRequest, InferenceResponse

Infer = Callable[[InferenceRequest], Coroutine[Any, Any, InferenceResponse]]
InferStream = Callable[[InferenceRequest], AsyncIterator[InferenceResponse]]


class ModelControl(Protocol):
    """What a Python model's ``pb_utils.load_model`` & co. reach: the server."""

    async def load_model(self, name: str, parameters: dict[str, Any] | None = None) -> None: ...

    async def unload_model(self, name: str, parameters: dict[str, Any] | None = None) -> None: ...

    def model_ready(self, name: str, version: str = "") -> bool: ...


@dataclass(slots=True)
class Host:
    infer: Infer
    loop: asyncio.AbstractEventLoop
    infer_stream: InferStream | None = None
    control: ModelControl | None = None


_host: Host | None = None


def install(
    infer: Infer,
    loop: asyncio.AbstractEventLoop,
    infer_stream: InferStream | None = None,
    control: ModelControl | None = None,
) -> None:
    global _host
    _host = Host(infer, loop, infer_stream, control)


def uninstall(infer: Infer) -> None:
    global _host
    if _host is not None and _host.infer == infer:
        _host = None


def current() -> Host | None:
    """The running server's host, or None when no server runs in this process."""
    return _host
