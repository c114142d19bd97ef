"""A client that disconnects before its answer cancels the work done for it (vLLM's
``with_cancellation``): the handler's task is cancelled, which aborts the engine requests it
waits on instead of running them to the end for nobody.

ASGI's ``receive`` answers ``http.disconnect`` once the client's connection is gone, and
only after the body: :func:`watch` starts listening once the handler has read it. A
streamed answer's disconnect is noticed at its next write instead (the handler has
returned by then: :func:`stop` ended the watch)."""

from __future__ import annotations

import asyncio

from starlette.requests import Request
from starlette.responses import Response

#: the status of an answer nobody reads (nginx's "client closed request")
CLIENT_CLOSED = 499


def watch(request: Request) -> None:
    """From now on (the body read), a disconnect cancels the current task."""
    handler = asyncio.current_task()
    if handler is None or getattr(request.state, "disconnect_watch", None) is not None:
        return

    async def listen() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass
        request.state.client_left = True
        handler.cancel()

    request.state.disconnect_watch = asyncio.create_task(listen())


def stop(request: Request) -> None:
    """The handler is done: stop listening (before a response starts to be sent)."""
    task = getattr(request.state, "disconnect_watch", None)
    if task is not None:
        task.cancel()


def answered_nobody(request: Request) -> Response:
    """For a ``CancelledError`` the handler raised: when the watch cancelled it (the client
    left), the task's cancellation is spent and the answer is one nobody reads; any other
    cancellation (the server stopping) is raised again."""
    if not getattr(request.state, "client_left", False):
        raise  # the cancellation being handled
    task = asyncio.current_task()
    if task is not None:
        task.uncancel()
    return Response(status_code=CLIENT_CLOSED)
