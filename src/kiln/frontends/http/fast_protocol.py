"""``POST .../infer`` answered inside uvicorn's HTTP protocol, without an ASGI cycle.

Why: docs/design/http-fast-path.md (``KILN_HTTP_FAST_PATH=0`` turns it off). The protocol
takes the inference route over at the parser's callbacks: it collects the body, runs the
same ``answer`` as the ASGI fallback (``fast_infer.py``) and writes the response bytes
itself. Everything else (every other route, and
inference requests this path does not take: chunked or oversized bodies, ``Expect:
100-continue``, percent-encoded paths, requests over the concurrency limit) is left to
uvicorn unchanged. Ordering of pipelined requests, graceful shutdown, keep-alive and the
header timeout keep working because the in-flight request stands in ``self.cycle`` as
uvicorn's own cycle would. A client whose connection drops before its answer has its
request cancelled, as a cancelled gRPC call's is (the model sees ``is_cancelled()``).

API keys and restricted API groups are checked here exactly as the access middleware
checks them, as soon as the head has arrived: a refused request is answered and its
connection closed without reading (buffering) its body. A browser's request (``Origin`` or
``Sec-Fetch-Site``) and one whose ``Host`` kiln does not answer to go to the ASGI app, whose
browser guard refuses them (403 / 421, :mod:`kiln.frontends.http.browser`) and whose CORS
middleware adds the headers a browser needs; other clients pay one dict lookup per request
for this (the Host value's). With ``--enable-request-id-headers`` every answer written here
carries ``X-Request-Id`` as the ASGI app's (:mod:`kiln.frontends.http.request_id`).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httptools
import orjson
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from kiln.core.access import AccessPolicy, ApiGroup
from kiln.core.errors import KilnError, Status
from kiln.core.trace import FRONTEND, FrontendSlot, frontend_done, trace_context
from kiln.frontends.http.app import HttpFrontend
from kiln.frontends.http.browser import BrowserGuard
from kiln.frontends.http.fast_infer import (
    INFER_PATH,
    WANTED_HEADERS,
    answer,
    error,
)
from kiln.frontends.http.request_id import new_id

# markers in the header lookup (no header name holds a NUL)
_HOST, _BROWSER = "\0host", "\0browser"
_REQUEST_ID = "\0x-request-id"


class _Nothing:
    def set(self) -> None:  # uvicorn calls cycle.message_event.set() when a connection drops
        pass


class _FastCycle:
    """What uvicorn reads of ``self.cycle`` while a fast request is in flight."""

    __slots__ = (
        "body", "disconnected", "headers", "keep_alive", "match", "raw_headers",
        "recv_end", "recv_start", "response_complete", "task",
    )  # fmt: skip
    message_event = _Nothing()

    def __init__(
        self,
        match: Any,
        headers: dict[str, str],
        keep_alive: bool,
        raw_headers: list[tuple[bytes, bytes]],
    ) -> None:
        self.match = match
        self.headers = headers
        self.raw_headers = raw_headers  # every header, for the access check
        self.keep_alive = keep_alive
        self.body: list[bytes] = []
        self.disconnected = False
        self.response_complete = False
        self.recv_start = self.recv_end = 0  # stamped while the server traces
        self.task: asyncio.Task[None] | None = None  # the one answering it


def fast_infer_protocol(
    base: type[HttpToolsProtocol],
    frontend: HttpFrontend,
    access: AccessPolicy | None = None,
    browser: BrowserGuard | None = None,
    request_id_headers: bool = False,
) -> type[HttpToolsProtocol]:
    """``access``: the HTTP access policy when it is enabled; ``browser``: the host names
    answered (requests this path leaves to the ASGI app's guard); ``request_id_headers``:
    every answer carries ``X-Request-Id``."""
    max_body = frontend.max_body
    # One dict lookup per header finds the wanted ones and those that send the request to
    # the ASGI app's browser guard (Host only where kiln checks it).
    lookup: dict[bytes, str] = {**WANTED_HEADERS, b"origin": _BROWSER, b"sec-fetch-site": _BROWSER}
    if browser is not None and browser.hosts is not None:
        lookup[b"host"] = _HOST
    if request_id_headers:
        lookup[b"x-request-id"] = _REQUEST_ID
    host_ok = (browser or BrowserGuard(None, frozenset())).host_ok
    read_timeout = frontend.read_timeout
    tracer = frontend.server.tracer

    class FastInferProtocol(base):  # type: ignore[valid-type,misc]
        _fast_rx: _FastCycle | None = None  # a fast request whose body is arriving
        _read_timer: asyncio.TimerHandle | None = None
        _begun = 0  # when the request began arriving (while the server traces)

        def on_message_begin(self) -> None:
            if tracer.enabled:
                self._begun = time.monotonic_ns()
            super().on_message_begin()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            # Arm the body timeout only when a body spans reads: most bodies arrive whole.
            if self._fast_rx is not None and self._read_timer is None and read_timeout:
                self._read_timer = self.loop.call_later(read_timeout, self._body_too_slow)

        def on_headers_complete(self) -> None:
            cycle = self._fast_cycle()
            if cycle is None:
                super().on_headers_complete()
                return
            self._head_complete()  # the header timeout and head limit, as the base class does
            self.cycle = cycle
            if access is not None and self._denied(cycle):
                return  # answered and closing: not one byte of the body is buffered
            self._fast_rx = cycle
            cycle.recv_start = self._begun

        def _fast_cycle(self) -> _FastCycle | None:
            if self.parser.get_method() != b"POST" or self.expect_100_continue:
                return None
            if self.cycle is not None and not self.cycle.response_complete:
                return None  # pipelined behind a response in flight: uvicorn queues it
            limit = self.limit_concurrency
            if limit is not None and (len(self.connections) >= limit or len(self.tasks) >= limit):
                return None  # uvicorn answers 503
            path = httptools.parse_url(self.url).path
            if b"%" in path:
                return None
            match = INFER_PATH.fullmatch(path.decode("latin-1"))
            if match is None:
                return None
            headers: dict[str, str] = {}
            for key, value in self.headers:
                name = lookup.get(key)
                if name is None:
                    continue
                if name is _HOST:
                    if not host_ok(value):
                        return None  # a foreign Host: the ASGI app answers 421
                elif name is _BROWSER:
                    return None  # a browser's request: the ASGI app judges it, adds CORS
                elif name is _REQUEST_ID:
                    headers.setdefault(_REQUEST_ID, value.decode("latin-1"))  # the first
                else:
                    headers[name] = value.decode("latin-1")
            length = headers.get("content-length")
            if length is None or not length.isdigit() or int(length) > max_body:
                return None  # chunked or too large: the ASGI path reads and refuses it
            keep_alive = self.parser.get_http_version() != "1.0" and self.parser.should_keep_alive()
            return _FastCycle(match, headers, keep_alive, self.headers)

        def on_body(self, body: bytes) -> None:
            if self._fast_rx is not None:
                self._fast_rx.body.append(body)
            else:
                super().on_body(body)

        def on_message_complete(self) -> None:
            cycle = self._fast_rx
            if cycle is None:
                super().on_message_complete()
                return
            self._fast_rx = None
            self._message_complete()
            self._cancel_read_timer()
            if cycle.recv_start:
                cycle.recv_end = time.monotonic_ns()
            task = cycle.task = self.loop.create_task(self._serve(cycle))
            task.add_done_callback(self.tasks.discard)
            self.tasks.add(task)

        async def _serve(self, cycle: _FastCycle) -> None:
            headers, match = cycle.headers, cycle.match
            slot = None
            if cycle.recv_start and tracer.enabled:
                # this task's own context: the runtime files a sampled trace here
                slot = FrontendSlot(
                    "HTTP", cycle.recv_start, cycle.recv_end, carrier=trace_context(headers)
                )
                FRONTEND.set(slot)
            try:
                body = b"".join(cycle.body)
                if "content-encoding" in headers:
                    body = await frontend.inflate(body, headers["content-encoding"])
            except KilnError as exc:
                status, out, extra = error(exc)
            else:
                forward = frontend.header_forward
                forwarded = None if forward is None else forward.select_raw(cycle.raw_headers)
                try:
                    status, out, extra = await answer(
                        frontend, match[1], match[2] or "", body, headers, forwarded
                    )
                except asyncio.CancelledError:
                    if not cycle.disconnected:
                        raise  # the server stopping
                    return  # the client left (connection_lost): its request was cancelled
            if slot is None:
                self._respond(cycle, status, out, extra)
            else:
                send_start = time.monotonic_ns()
                self._respond(cycle, status, out, extra)
                frontend_done(slot, send_start)
            if self.flow.write_paused and not self.transport.is_closing():
                await self.flow.drain()  # a slow reader: don't start its next request yet
            self._complete(cycle)

        def _denied(self, cycle: _FastCycle) -> bool:
            assert access is not None
            every = {k.decode("latin-1"): v.decode("latin-1") for k, v in cycle.raw_headers}
            denial = access.check(ApiGroup.INFERENCE, every.get)
            if denial is None:
                return False
            extra = {"Content-Type": "application/json"}
            status = 403
            if denial.kind == "unauthenticated":
                status, extra["WWW-Authenticate"] = 401, "Bearer"
            cycle.keep_alive = False  # the body was not read: it would be parsed as a request
            self._respond(cycle, status, orjson.dumps({"error": denial.message}), extra)
            self._complete(cycle)
            return True

        def _respond(
            self, cycle: _FastCycle, status: int, out: bytes, extra: dict[str, str]
        ) -> None:
            if cycle.disconnected or self.transport.is_closing():
                return
            parts = [STATUS_LINE[status]]
            for name, value in self.server_state.default_headers:
                parts += [name, b": ", value, b"\r\n"]
            for key, text in extra.items():
                parts += [key.encode("latin-1"), b": ", text.encode("latin-1"), b"\r\n"]
            if request_id_headers:
                rid = cycle.headers.get(_REQUEST_ID) or new_id()
                parts += [b"x-request-id: ", rid.encode("latin-1"), b"\r\n"]
            parts += [b"content-length: ", str(len(out)).encode(), b"\r\n"]
            if not cycle.keep_alive:
                parts.append(b"connection: close\r\n")
            parts += [b"\r\n", out]
            self.transport.write(b"".join(parts))

        def _complete(self, cycle: _FastCycle) -> None:
            cycle.response_complete = True
            if not cycle.keep_alive and not self.transport.is_closing():
                self.transport.close()
            self.on_response_complete()  # keep-alive timer, or the next pipelined request

        def _body_too_slow(self) -> None:
            self._read_timer = None
            cycle = self._fast_rx
            if cycle is None or self.transport.is_closing():
                return
            self._fast_rx = None
            cycle.keep_alive = False  # the rest of the body would be read as a request
            exc = KilnError(
                f"request body not received within {read_timeout:g}s (--http-read-timeout-secs)",
                Status.REQUEST_TIMEOUT,
            )
            self._respond(cycle, *error(exc))
            self._complete(cycle)

        def _cancel_read_timer(self) -> None:
            if self._read_timer is not None:
                self._read_timer.cancel()
                self._read_timer = None

        def connection_lost(self, exc: Exception | None) -> None:
            self._cancel_read_timer()
            self._fast_rx = None
            cycle = self.cycle
            super().connection_lost(exc)
            if isinstance(cycle, _FastCycle) and cycle.disconnected and cycle.task is not None:
                # nobody to answer: the model's request is cancelled (``is_cancelled()``,
                # withdrawn from a batcher's queue), as a cancelled gRPC call's is
                cycle.task.cancel()

    return FastInferProtocol
