"""``X-Request-Id`` on every HTTP response (``--enable-request-id-headers``, vLLM's flag).

A request that carries ``X-Request-Id`` gets it back; any other gets a new random id (32
hex digits), so a client, a proxy's log and kiln's answer can name the same request. The
OpenAI routes also build a completion's ``id`` from the header
(:mod:`kiln.frontends.openai.request_ids`), whether or not this flag is on. The fast
inference path adds the header itself (:mod:`kiln.frontends.http.fast_protocol`).
"""

from __future__ import annotations

import uuid

from starlette.types import ASGIApp, Message, Receive, Scope, Send

HEADER = b"x-request-id"


def new_id() -> str:
    return uuid.uuid4().hex


class RequestIdMiddleware:
    """The outermost layer of an HTTP port: even a refused request's answer carries it."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        rid = next((v for k, v in scope["headers"] if k == HEADER), None)
        value = rid if rid else new_id().encode()

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", ()), (HEADER, value)]
            await send(message)

        await self.app(scope, receive, send_with_id)
