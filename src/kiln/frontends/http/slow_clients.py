"""Slow-client (slowloris) and oversized-head protection for uvicorn's httptools protocol.

uvicorn closes idle keep-alive connections (``timeout_keep_alive``) but has no timeout for
a request's headers: a client that opens a connection and sends one header byte a minute
holds a connection forever. This protocol closes a connection whose request headers have
not all arrived within ``header_timeout`` seconds of its first byte (or of the connection
opening). Slow *bodies* are bounded separately, by the HTTP frontend's read timeout.

Nor does uvicorn bound a request's head: httptools and uvicorn join the URL and each
header value chunk by chunk (quadratic), so one client sending megabytes of headers
stalled every other client for seconds and grew the process by hundreds of MiB, before
any authentication. The head is bounded here as its bytes arrive: the parser is never
fed more than ``max_head_bytes`` of one head, nor more than ``max_headers`` fields; past
either the client gets 431 and the connection is closed.
"""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from kiln.frontends.http import tls_close

#: Defaults of ``--http-max-header-size`` and ``--http-max-headers``.
MAX_HEAD_BYTES = 64 * 1024
MAX_HEADERS = 100


class _HeadTooLarge(Exception):
    """Raised from a parser callback to stop parsing; answered with 431."""


def header_timeout_protocol(
    header_timeout: float, max_head_bytes: int = MAX_HEAD_BYTES, max_headers: int = MAX_HEADERS
) -> type[HttpToolsProtocol]:
    class HeaderTimeoutProtocol(HttpToolsProtocol):
        _header_timer: asyncio.TimerHandle | None = None
        _in_head = True  # the bytes arriving belong to a request head (or precede one)
        _head_bytes = 0  # bytes of the current head fed to the parser
        _header_count = 0
        _refused: str | None = None  # why the head was refused (431), once it was

        def _arm(self) -> None:
            self._disarm()
            self._header_timer = self.loop.call_later(header_timeout, self._too_slow)

        def _disarm(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _too_slow(self) -> None:
            self._header_timer = None
            if not self.transport.is_closing():
                self.transport.close()

        def connection_made(self, transport: Any) -> None:
            # A TLS connection we close is aborted once close_notify has gone out, instead
            # of waiting up to 30 s for the client's (tls_close.py).
            super().connection_made(tls_close.wrap(transport, self.loop))
            self._arm()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            if isinstance(self.transport, tls_close.TlsClosingTransport):
                self.transport.connection_lost()
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            if self._refused is not None or self.parser is None:
                return  # refused (closing) or lost: nothing more is parsed
            # While a head is arriving, feed the parser no more than the room left in the
            # head limit; if the head is still unfinished at the limit, refuse it.
            rest: bytes | memoryview = data
            while self._in_head and len(rest) > max_head_bytes - self._head_bytes:
                room = max_head_bytes - self._head_bytes
                view = memoryview(rest)  # the parser takes any buffer: slice without copies
                chunk, rest = view[:room], view[room:]
                self._head_bytes += len(chunk)
                super().data_received(chunk)  # type: ignore[arg-type]
                if self._refused is not None or self.transport.is_closing():
                    return
                if self._in_head and self._head_bytes >= max_head_bytes:
                    self._refuse_head(
                        f"request head exceeds {max_head_bytes} bytes (--http-max-header-size)"
                    )
                    return
            if self._in_head:
                self._head_bytes += len(rest)
            super().data_received(rest)  # type: ignore[arg-type]

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._header_count = 0
            self._arm()

        def on_header(self, name: bytes, value: bytes) -> None:
            self._header_count += 1
            if self._header_count > max_headers:
                self._refused = f"more than {max_headers} header fields (--http-max-headers)"
                raise _HeadTooLarge  # uvicorn answers a parser error with send_400_response
            super().on_header(name, value)

        def on_headers_complete(self) -> None:
            self._head_complete()
            super().on_headers_complete()

        def on_message_complete(self) -> None:
            self._message_complete()
            super().on_message_complete()

        def _head_complete(self) -> None:
            """The head has arrived: what follows is its body, not bound by the head limit."""
            self._disarm()
            self._in_head = False

        def _message_complete(self) -> None:
            """What follows is the next request's head."""
            self._in_head = True
            self._head_bytes = 0

        def send_400_response(self, msg: str) -> None:
            if self._refused is not None:  # the parser stopped because we raised
                self._refuse_head(self._refused)
            else:
                super().send_400_response(msg)

        def _refuse_head(self, why: str) -> None:
            self._refused = why
            body = orjson.dumps({"error": f"request header fields too large: {why}"})
            parts = [STATUS_LINE[431]]
            for name, value in self.server_state.default_headers:
                parts += [name, b": ", value, b"\r\n"]
            parts += [
                b"content-type: application/json\r\n",
                b"content-length: ", str(len(body)).encode(), b"\r\n",
                b"connection: close\r\n\r\n", body,
            ]  # fmt: skip
            self.transport.write(b"".join(parts))
            self.transport.close()

        def on_response_complete(self) -> None:
            # Between requests uvicorn's keep-alive timeout applies instead.
            self._disarm()
            super().on_response_complete()

    return HeaderTimeoutProtocol
