"""Close the connection after an answer given before the request's body was read.

uvicorn keeps a connection open after a response however much of the request's body is
still to come: it discards the rest as it arrives, and each byte re-arms the keep-alive
timeout. A client that got an early answer (401, 403, 404, 408, 413...) could so hold a
connection, and a ``--http-limit-concurrency`` slot, for as long as it trickled its body.
An answer that starts before the app has read the body to its end therefore carries
``Connection: close``, on which uvicorn closes the connection once the answer is out.
"""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

_CLOSE = (b"connection", b"close")


def _has_body(headers: list[tuple[bytes, bytes]]) -> bool:
    for name, value in headers:
        if name == b"transfer-encoding" or (name == b"content-length" and value.strip() != b"0"):
            return True
    return False


class CloseUnreadBody:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not _has_body(scope["headers"]):
            await self.app(scope, receive, send)
            return
        read = False  # the app has received the body's last chunk

        async def receive_body() -> Message:
            nonlocal read
            message = await receive()
            if message["type"] != "http.request" or not message.get("more_body", False):
                read = True
            return message

        async def send_close(message: Message) -> None:
            if not read and message["type"] == "http.response.start":
                headers = list(message.get("headers", []))
                if _CLOSE not in headers:
                    message = {**message, "headers": [*headers, _CLOSE]}
            await send(message)

        await self.app(scope, receive_body, send_close)
