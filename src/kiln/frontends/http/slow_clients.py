"""Slow-client (slowloris) protection for uvicorn's httptools protocol.

uvicorn closes idle keep-alive connections (``timeout_keep_alive``) but has no timeout for
a request's headers: a client that opens a connection and sends one header byte a minute
holds a connection forever. This protocol closes a connection whose request headers have
not all arrived within ``header_timeout`` seconds of its first byte (or of the connection
opening). Slow *bodies* are bounded separately, by the HTTP frontend's read timeout.
"""

from __future__ import annotations

import asyncio
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from kiln.frontends.http import tls_close


def header_timeout_protocol(header_timeout: float) -> type[HttpToolsProtocol]:
    class HeaderTimeoutProtocol(HttpToolsProtocol):
        _header_timer: asyncio.TimerHandle | None = None

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

        def connection_made(self, transport: Any) -> None:  # type: ignore[override]
            # A TLS connection we close is aborted once close_notify has gone out, instead
            # of waiting up to 30 s for the client's (tls_close.py).
            super().connection_made(tls_close.wrap(transport, self.loop))
            self._arm()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            if isinstance(self.transport, tls_close.TlsClosingTransport):
                self.transport.connection_lost()
            super().connection_lost(exc)

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._arm()

        def on_headers_complete(self) -> None:
            self._disarm()
            super().on_headers_complete()

        def on_response_complete(self) -> None:
            # Between requests uvicorn's keep-alive timeout applies instead.
            self._disarm()
            super().on_response_complete()

    return HeaderTimeoutProtocol
