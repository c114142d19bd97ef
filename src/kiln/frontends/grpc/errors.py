"""Turn core's errors into gRPC statuses, once, around every RPC."""

from __future__ import annotations

import functools
import logging
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import grpc

from kiln.core.errors import KilnError

log = logging.getLogger(__name__)

S = TypeVar("S")
Req = TypeVar("Req")
Resp = TypeVar("Resp")
Rpc = Callable[[S, Req, grpc.aio.ServicerContext[Any, Any]], Awaitable[Resp]]


def status_code(exc: KilnError) -> grpc.StatusCode:
    return grpc.StatusCode[exc.status.grpc_code]


def error_message(exc: BaseException) -> str:
    """What a client reads: core's message, or a short description of a server bug."""
    if isinstance(exc, KilnError):
        return exc.message
    return f"internal error: {type(exc).__name__}: {exc}"


def guarded(fn: Rpc[S, Req, Resp]) -> Rpc[S, Req, Resp]:
    """A unary RPC whose KilnError becomes its gRPC status; a bug becomes INTERNAL, and
    never takes the server down."""

    @functools.wraps(fn)
    async def wrapped(self: S, request: Req, context: grpc.aio.ServicerContext[Any, Any]) -> Resp:
        try:
            return await fn(self, request, context)
        except KilnError as exc:
            await context.abort(status_code(exc), exc.message)
        except Exception as exc:
            log.exception("gRPC %s failed", fn.__name__)
            await context.abort(grpc.StatusCode.INTERNAL, error_message(exc))
        raise AssertionError("unreachable: context.abort raises")  # pragma: no cover

    return wrapped
