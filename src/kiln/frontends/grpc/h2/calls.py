"""One gRPC call on an HTTP/2 stream: the servicer's method run in a task, its request
messages read from the stream, its answer written back, and the context object the
servicers use.

A servicer method is what grpc.aio would call: ``async def Method(request, context)`` for
a unary response, an async generator for a streaming one; a streaming request arrives as
an async iterator. ``context`` is the :class:`Call` itself, with the parts of
``grpc.aio.ServicerContext`` kiln's servicers use (``abort``, ``invocation_metadata``,
``time_remaining``, ``cancelled``, ``peer``, ``set_code``/``set_details``).
"""

from __future__ import annotations

import asyncio
import base64
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import grpc

from kiln.core.access import ApiGroup
from kiln.frontends.grpc.h2 import rpc
from kiln.frontends.grpc.h2.connection import Connection
from kiln.frontends.grpc.h2.hpack import Header
from kiln.frontends.grpc.h2.streams import Stream

log = logging.getLogger(__name__)

# Compressed messages above this size are inflated on a worker thread, off the event loop
# (zlib gives up the GIL meanwhile). Small: deflate inflates up to ~1,000-fold, so 256 KiB
# held every client for the second its 256 MiB took; 1 KiB is at most a few milliseconds.
INFLATE_INLINE_BYTES = 2**10
# A streaming call whose handler has this many messages waiting stops giving flow-control
# credit back, so a client that sends faster than the handler reads is held by its window.
STREAM_BACKLOG = 16
# A unary call's bytes are credited back as they arrive (a message may be larger than every
# window), so without a bound the calls of one connection could hold a message of the
# largest size each (MAX_CONCURRENT_STREAMS of them). What a connection's calls hold before
# their handlers take it (unfinished messages, unary requests not yet parsed) is at most
# this many messages of the largest size; the call whose bytes pass it ends with
# RESOURCE_EXHAUSTED.
HELD_MESSAGES_PER_CONNECTION = 4
_PREFIX = 5  # a message's compressed flag and length

_CODES: dict[Any, int] = {code: code.value[0] for code in grpc.StatusCode}


class Abort(grpc.aio.AbortError):  # type: ignore[misc]
    """``await context.abort(code, details)``: ends the call with that status (a subclass
    of grpc.aio's, so code written for grpc.aio that catches it still does)."""

    def __init__(self, code: int, details: str) -> None:
        super().__init__(details)
        self.code = code
        self.details = details


@dataclass(frozen=True, slots=True)
class Route:
    """One method: the servicer's bound method and its message (de)serializers."""

    path: bytes
    handler: Callable[..., Any]
    decode: Callable[[bytes], Any]
    encode: Callable[[Any], bytes]
    client_streaming: bool
    server_streaming: bool
    group: ApiGroup


class Call:
    __slots__ = (
        "_cancelled", "_code", "_details", "_held", "_orphaned", "_withheld", "conn", "deadline",
        "done", "encoding", "headers", "headers_sent", "limit", "messages", "queue", "reader",
        "registry", "route", "stream", "task", "timer",
    )  # fmt: skip

    def __init__(
        self,
        conn: Connection,
        stream: Stream,
        route: Route,
        headers: tuple[Header, ...],
        encoding: bytes | None,
        limit: int,
        registry: set[Call],
    ) -> None:
        """``limit``: the largest message either way; ``registry``: where the call is
        while its task runs (the server cancels what is left there at shutdown)."""
        self.conn = conn
        self.stream = stream
        self.route = route
        self.headers = headers
        self.encoding = encoding
        self.limit = limit
        self.registry = registry
        self.reader = rpc.MessageReader(limit)
        self.messages: list[tuple[int, bytes]] = []  # a unary request's message(s)
        self.queue: asyncio.Queue[tuple[int, bytes] | None] | None = (
            asyncio.Queue() if route.client_streaming else None
        )
        self.task: asyncio.Task[None] | None = None
        self.timer: asyncio.TimerHandle | None = None
        self.deadline: float | None = None
        self.done = False  # the final status is sent (or the stream is gone)
        self.headers_sent = False
        self._code: int | None = None
        self._details = ""
        self._cancelled = False
        self._withheld = 0  # bytes received but not credited back (a full backlog)
        self._orphaned = False  # counted in conn.orphans until the task ends
        self._held = 0  # its part of conn.held

    # ---- from the connection ---------------------------------------------------------
    def on_data(self, data: bytes) -> None:
        if self.done:
            return
        try:
            messages = self.reader.feed(data)
        except rpc.MessageTooLarge as exc:
            self.finish(rpc.RESOURCE_EXHAUSTED, str(exc))
            return
        # Held: a unary call's bytes until its handler takes the request; a streaming
        # call's unfinished message (whole ones wait in its queue, under flow control).
        grow = len(data)
        if self.queue is not None and messages:
            grow -= sum(_PREFIX + len(payload) for _, payload in messages)
        self._held += grow
        self.conn.held += grow
        budget = HELD_MESSAGES_PER_CONNECTION * self.limit
        if grow > 0 and self.conn.held > budget:
            self.finish(
                rpc.RESOURCE_EXHAUSTED,
                f"the connection holds more than {budget} bytes of requests not yet handled "
                f"({HELD_MESSAGES_PER_CONNECTION} x --grpc-max-message-bytes)",
            )
            if self.task is not None:
                self.task.cancel()  # a streaming call's handler waits for its next message
            return
        queue = self.queue
        if queue is None:
            self.conn.consumed(self.stream, len(data))
            self.messages.extend(messages)
            if len(self.messages) > 1:  # refused now: unanswered, they would pile up
                self.finish(rpc.INTERNAL, "more than one request message for a unary method")
            return
        for message in messages:
            queue.put_nowait(message)
        if queue.qsize() < STREAM_BACKLOG:
            self.conn.consumed(self.stream, len(data) + self._withheld)
            self._withheld = 0
        else:
            self._withheld += len(data)

    def on_end(self) -> None:
        if self.done:
            return
        if self.queue is not None:
            self.queue.put_nowait(None)
        else:
            self.start()

    def on_reset(self) -> None:
        self._cancelled = not self.done
        self.done = True
        self._drop_unread()
        self._stop_timer()
        task = self.task
        if task is not None:
            if not task.done() and not self._orphaned:
                # The stream is gone but the handler runs until the cancellation reaches
                # it: it keeps its slot (MAX_CONCURRENT_STREAMS) until then.
                self._orphaned = True
                self.conn.orphans += 1
                task.add_done_callback(self._released)
            task.cancel()

    def _released(self, task: asyncio.Task[None]) -> None:
        self.conn.orphans -= 1

    def _release(self, n: int | None = None) -> None:
        """The handler took ``n`` of the bytes this call holds (None: all of them, or the
        call is over)."""
        n = self._held if n is None else min(n, self._held)
        self._held -= n
        self.conn.held -= n

    def _drop_unread(self) -> None:
        """The call is over: what it holds goes now, not when the garbage collector finds
        the call (it and its stream refer to each other)."""
        if self.reader.partial:
            self.reader = rpc.MessageReader(self.limit)
        self.messages = []
        self._release()

    # ---- lifecycle -------------------------------------------------------------------
    def start(self) -> None:
        self.task = asyncio.get_running_loop().create_task(self._run())
        self.registry.add(self)

    def set_deadline(self, seconds: float) -> None:
        loop = asyncio.get_running_loop()
        self.deadline = loop.time() + seconds
        self.timer = loop.call_later(seconds, self._expired)

    def _expired(self) -> None:
        self.timer = None
        if not self.done:
            self._cancelled = True
            self.finish(rpc.DEADLINE_EXCEEDED, "Deadline Exceeded")
            if self.task is not None:
                self.task.cancel()

    def _stop_timer(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    def finish(self, code: int, message: str = "") -> None:
        """Send the final status (once)."""
        if self.done:
            return
        self.done = True
        self._drop_unread()  # nothing more is taken
        self._stop_timer()
        block = rpc.status_block(code, message, trailers_only=not self.headers_sent)
        if self.headers_sent:
            self.conn.send_trailers(self.stream, block)
        else:
            self.conn.send_headers(self.stream, block, end_stream=True)

    async def _run(self) -> None:
        route = self.route
        try:
            request: Any
            if self.queue is not None:
                request = self._requests()
            else:
                if len(self.messages) != 1 or self.reader.partial:
                    raise Abort(
                        rpc.INTERNAL, f"expected one request message, got {len(self.messages)}"
                    )
                self._release()  # taken: the handler's from here
                request = self._parse(*self.messages[0])
                if asyncio.iscoroutine(request):
                    request = await request
                self.messages = []
            if route.server_streaming:
                responses = route.handler(request, self)
                try:
                    async for response in responses:
                        await self._send_message(route.encode(response))
                finally:
                    # now, not whenever the generator is collected: its cleanup (the
                    # servicer's tasks for a stream) must not outlive the call
                    await responses.aclose()
                self.finish(self._code or rpc.OK, self._details)
            else:
                body = route.encode(await route.handler(request, self))
                if self.done:
                    return
                if self._code:  # set_code() with a normal return: no message
                    self.finish(self._code, self._details)
                    return
                self._send_unary(body)
        except Abort as exc:
            self.finish(exc.code, exc.details)
        except asyncio.CancelledError:
            # a reset, a deadline or a shutdown: whichever it was has answered already
            self.finish(rpc.CANCELLED, "Cancelled")
        except Exception as exc:
            log.exception("gRPC %s failed", route.path.decode())
            self.finish(rpc.UNKNOWN, f"Unexpected error in RPC handling: {type(exc).__name__}")
        finally:
            self._release()
            self._stop_timer()
            self.registry.discard(self)

    def _parse(self, flag: int, payload: bytes) -> Any:
        """The request message; a coroutine when it must be decompressed first."""
        if flag:
            return self._inflated(payload)
        try:
            return self.route.decode(payload)
        except Exception:
            raise Abort(rpc.INTERNAL, "Failed to parse the request message") from None

    async def _inflated(self, payload: bytes) -> Any:
        encoding = self.encoding
        if encoding is None or encoding == b"identity":
            raise Abort(rpc.INTERNAL, "compressed message without a grpc-encoding")
        limit = self.limit
        try:
            if len(payload) > INFLATE_INLINE_BYTES:
                raw = await asyncio.to_thread(rpc.inflate, payload, encoding, limit)
            else:
                raw = rpc.inflate(payload, encoding, limit)
        except rpc.MessageTooLarge as exc:
            raise Abort(rpc.RESOURCE_EXHAUSTED, str(exc)) from None
        except ValueError as exc:
            raise Abort(rpc.INTERNAL, str(exc)) from None
        return self._parse(0, raw)

    async def _requests(self) -> AsyncIterator[Any]:
        assert self.queue is not None
        while True:
            item = await self.queue.get()
            if item is None:
                return
            flag, payload = item
            if self._withheld and self.queue.qsize() < STREAM_BACKLOG:
                self.conn.consumed(self.stream, self._withheld)
                self._withheld = 0
            message = self._parse(flag, payload)
            yield (await message) if asyncio.iscoroutine(message) else message

    def _check_size(self, body: bytes) -> None:
        limit = self.limit
        if len(body) > limit:
            raise Abort(
                rpc.RESOURCE_EXHAUSTED, f"Sent message larger than max ({len(body)} vs. {limit})"
            )

    def _send_unary(self, body: bytes) -> None:
        self._check_size(body)
        self.done = True
        self._stop_timer()
        self.headers_sent = True
        if len(body) > 2**20:  # large: the DATA goes out in two pieces, without a copy
            self.conn.send_data(self.stream, rpc.prefix(len(body)), rpc.RESPONSE_HEADERS)
            self.conn.send_data(self.stream, body)
            self.conn.send_trailers(self.stream, rpc.TRAILERS_OK)
        else:
            data = rpc.prefix(len(body)) + body
            self.conn.send_response(self.stream, rpc.RESPONSE_HEADERS, data, rpc.TRAILERS_OK)

    async def _send_message(self, body: bytes) -> None:
        if self.done:
            raise asyncio.CancelledError
        self._check_size(body)
        head = None if self.headers_sent else rpc.RESPONSE_HEADERS
        self.headers_sent = True
        self.conn.send_data(self.stream, rpc.prefix(len(body)) + body, head)
        await self.conn.writable(self.stream)

    # ---- grpc.aio.ServicerContext, the parts kiln uses -------------------------------
    async def abort(self, code: Any, details: str = "", trailing_metadata: Any = ()) -> None:
        raise Abort(_CODES.get(code, code), details)

    def invocation_metadata(self) -> tuple[tuple[str, str | bytes], ...]:
        """Custom metadata as grpc.aio gives it: no pseudo-headers nor gRPC's reserved
        fields; ``-bin`` values base64-decoded."""
        out: list[tuple[str, str | bytes]] = []
        for name, value in self.headers:
            if name[:1] == b":" or name.startswith(b"grpc-") or name in (b"te", b"content-type"):
                continue
            key = name.decode("latin-1")
            if key.endswith("-bin"):
                try:  # unpadded base64 is allowed (PROTOCOL-HTTP2.md)
                    out.append(
                        (key, base64.b64decode(value + b"=" * (-len(value) % 4), validate=True))
                    )
                except ValueError:
                    out.append((key, value))  # not base64 after all: the bytes as sent
            else:
                out.append((key, value.decode("latin-1")))
        return tuple(out)

    def time_remaining(self) -> float | None:
        if self.deadline is None:
            return None
        return max(self.deadline - asyncio.get_running_loop().time(), 0.0)

    def cancelled(self) -> bool:
        """The client cancelled (RST_STREAM, a closed connection) or the deadline passed."""
        return self._cancelled

    def peer(self) -> str:
        return self.conn.peer

    def set_code(self, code: Any) -> None:
        self._code = _CODES.get(code, code)

    def set_details(self, details: str) -> None:
        self._details = details
