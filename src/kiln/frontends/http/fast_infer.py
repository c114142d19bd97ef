"""The inference route without Starlette: ``POST /v2/models/{m}[/versions/{v}]/infer``.

The ASGI fallback of the protocol-level fast path (``fast_protocol.py``: why in
docs/design/http-fast-path.md): the inference requests it leaves to the ASGI app
(browsers', chunked, ``Expect: 100-continue``, ...) go straight to
:meth:`HttpFrontend.infer_body` with the same body limits, errors and headers, skipping
Starlette's router, ``Request`` and ``Response``; everything else falls through to the
Starlette app. Access control and CORS wrap this app from the outside.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from typing import TYPE_CHECKING

import orjson
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Receive, Scope, Send

from kiln.core.errors import KilnError
from kiln.core.trace import FRONTEND, FrontendSlot, frontend_done, trace_context
from kiln.frontends import disconnect
from kiln.frontends.http.codec import HEADER_LENGTH

if TYPE_CHECKING:
    from kiln.frontends.http.app import HttpFrontend

log = logging.getLogger(__name__)

# Starlette's ``{param}`` is ``[^/]+``; uvicorn has already percent-decoded ``path``.
INFER_PATH = re.compile(r"/v2/models/([^/]+)(?:/versions/([^/]+))?/infer")
WANTED_HEADERS = {
    b"content-length": "content-length",
    b"content-encoding": "content-encoding",
    HEADER_LENGTH.encode(): HEADER_LENGTH,
    b"accept-encoding": "accept-encoding",
    # a client's W3C trace context, for request tracing in opentelemetry mode
    b"traceparent": "traceparent",
    b"tracestate": "tracestate",
}


class FastInfer:
    def __init__(self, frontend: HttpFrontend, app: ASGIApp) -> None:
        self.frontend = frontend
        self.app = app  # every other route

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            match = INFER_PATH.fullmatch(scope["path"])
            if match is not None:
                if scope["method"] == "POST":
                    await self._infer(match, scope, receive, send)
                else:  # Starlette's answer for a known path with another method
                    body = orjson.dumps({"error": "Method Not Allowed"})
                    await _send(send, 405, body, {"Content-Type": "application/json"})
                return
        await self.app(scope, receive, send)

    async def _infer(
        self, match: re.Match[str], scope: Scope, receive: Receive, send: Send
    ) -> None:
        slot = None
        if self.frontend.server.tracer.enabled:
            slot = FrontendSlot("HTTP", time.monotonic_ns())
            FRONTEND.set(slot)  # this request's task: the runtime files its trace here
        headers: dict[str, str] = {}
        for key, value in scope["headers"]:
            name = WANTED_HEADERS.get(key)
            if name is not None:
                headers[name] = value.decode("latin-1")
        try:
            body = await self.frontend.read_asgi_body(
                headers.get("content-length"), headers.get("content-encoding", ""), receive
            )
        except ClientDisconnect:
            return  # nobody to answer
        except KilnError as exc:
            status, out, extra = error(exc)
        else:
            if slot is not None:
                slot.recv_end = time.monotonic_ns()
                slot.carrier = trace_context(headers)
            forward = self.frontend.header_forward
            forwarded = None if forward is None else forward.select_raw(scope["headers"])
            watch = disconnect.Watch(receive)  # a client that leaves cancels its request
            try:
                status, out, extra = await answer(
                    self.frontend, match[1], match[2] or "", body, headers, forwarded
                )
            except asyncio.CancelledError:
                if not watch.left():
                    raise  # the server stopping
                return  # nobody to answer
            finally:
                watch.stop()
        send_start = time.monotonic_ns()
        try:
            await _send(send, status, out, extra)
        finally:
            frontend_done(slot, send_start)  # a client gone mid-send ends the trace too


async def _send(send: Send, status: int, out: bytes, extra: dict[str, str]) -> None:
    raw = [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in extra.items()]
    raw.append((b"content-length", str(len(out)).encode()))
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": out})


def error(exc: KilnError) -> tuple[int, bytes, dict[str, str]]:
    body = orjson.dumps({"error": exc.message})
    return exc.status.http_status, body, {"Content-Type": "application/json"}


async def answer(
    frontend: HttpFrontend,
    name: str,
    version: str,
    body: bytes,
    headers: dict[str, str],
    forwarded: dict[str, str] | None = None,
) -> tuple[int, bytes, dict[str, str]]:
    """(status, body, headers) of one inference whose request body has been read (and
    inflated); ``headers``: the request's, as ``WANTED_HEADERS`` names them; ``forwarded``:
    those ``--http-header-forward-pattern`` picked. Never raises."""
    try:
        out, extra = await frontend.infer_body(
            name,
            version,
            body,
            headers.get(HEADER_LENGTH),
            headers.get("accept-encoding", ""),
            forwarded,
        )
        return 200, out, extra
    except KilnError as exc:
        return error(exc)
    except Exception as exc:  # never let one request take the server down
        log.exception("unhandled error on model '%s'", name)
        message = f"internal error: {type(exc).__name__}: {exc}"
        return 500, orjson.dumps({"error": message}), {"Content-Type": "application/json"}
