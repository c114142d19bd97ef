"""A client that disconnects before its answer cancels the work done for it (vLLM's
``with_cancellation``; Triton's request cancellation, which it does for gRPC calls): the
handler's task is cancelled, which aborts the engine requests it waits on, and a model's
request turns ``is_cancelled()``, instead of running them to the end for nobody.

ASGI's ``receive`` answers ``http.disconnect`` once the client's connection is gone, and
only after the body: :func:`watch` starts listening once the handler has read it. A
streamed answer's disconnect is noticed at its next write instead (the handler has
returned by then: :func:`stop` ended the watch)."""

from __future__ import annotations

import asyncio

from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Receive

#: the status of an answer nobody reads (nginx's "client closed request")
CLIENT_CLOSED = 499


class Watch:
    """Cancels the current task when ``receive`` answers ``http.disconnect``; the body
    must have been read. :meth:`stop` it before the response starts to be sent."""

    __slots__ = ("_listener", "client_left")

    def __init__(self, receive: Receive) -> None:
        self.client_left = False
        handler = asyncio.current_task()
        assert handler is not None, "a watch is started by the handler's task"

        async def listen() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            self.client_left = True
            handler.cancel()

        self._listener = asyncio.create_task(listen())

    def stop(self) -> None:
        self._listener.cancel()

    def left(self) -> bool:
        """For a ``CancelledError`` being handled: True (its cancellation spent) when the
        watch cancelled the task because the client left; False for any other
        cancellation (the server stopping), which the caller raises again."""
        if not self.client_left:
            return False
        task = asyncio.current_task()
        if task is not None:
            task.uncancel()
        return True


def watch(request: Request) -> None:
    """From now on (the body read), a disconnect cancels the current task."""
    if getattr(request.state, "disconnect_watch", None) is None:
        request.state.disconnect_watch = Watch(request.receive)


def stop(request: Request) -> None:
    """The handler is done: stop listening (before a response starts to be sent)."""
    found: Watch | None = getattr(request.state, "disconnect_watch", None)
    if found is not None:
        found.stop()


def answered_nobody(request: Request) -> Response:
    """For a ``CancelledError`` the handler raised: when the watch cancelled it (the client
    left), the task's cancellation is spent and the answer is one nobody reads; any other
    cancellation (the server stopping) is raised again."""
    found: Watch | None = getattr(request.state, "disconnect_watch", None)
    if found is None or not found.left():
        raise  # the cancellation being handled
    return Response(status_code=CLIENT_CLOSED)
