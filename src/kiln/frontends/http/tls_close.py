"""Closing a TLS connection without waiting on the client.

``transport.close()`` on a TLS transport sends close_notify and then waits for the peer's,
up to the loop's SSL shutdown timeout (30 s), before the connection is lost. A client that
never reads its idle keep-alive socket (``requests``, ``urllib3``: most pools) therefore
held every closed connection for 30 s: uvicorn's graceful shutdown waited that long for
idle connections, however short ``--exit-timeout-secs`` was, and a connection closed by the
keep-alive or header timeout still counted against ``--http-limit-concurrency``.

TLS does not require the side that closes to wait for the peer's close_notify (RFC 8446
§6.1), so once ours has had time to leave and nothing else is left to send, the transport
is aborted. A response still being written to a slow reader is never cut short: the abort
waits until the write buffer is empty.
"""

from __future__ import annotations

import asyncio
from typing import Any

#: Seconds between ``close()`` and the abort, and between checks while data is still queued.
CLOSE_GRACE_S = 1.0


class TlsClosingTransport:
    """Wraps a TLS transport: ``close()`` also schedules the abort; everything else is the
    wrapped transport's."""

    __slots__ = ("_loop", "_lost", "_timer", "_transport")

    def __init__(self, transport: Any, loop: asyncio.AbstractEventLoop) -> None:
        self._transport = transport
        self._loop = loop
        self._timer: asyncio.TimerHandle | None = None
        self._lost = False

    def close(self) -> None:
        self._transport.close()
        if self._timer is None and not self._lost:
            self._timer = self._loop.call_later(CLOSE_GRACE_S, self._abort_when_flushed)

    def _abort_when_flushed(self) -> None:
        self._timer = None
        if self._lost:
            return
        if self._transport.get_write_buffer_size() > 0:  # a response is still going out
            self._timer = self._loop.call_later(CLOSE_GRACE_S, self._abort_when_flushed)
            return
        self._transport.abort()

    def connection_lost(self) -> None:
        """The protocol saw the connection go: nothing left to abort."""
        self._lost = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


def wrap(transport: Any, loop: asyncio.AbstractEventLoop) -> Any:
    """``transport`` itself unless it is TLS."""
    if transport.get_extra_info("ssl_object") is None:
        return transport
    return TlsClosingTransport(transport, loop)
