"""kiln's gRPC listener: :class:`~kiln.frontends.grpc.h2.connection.Connection` on the
running event loop, plain (h2c) or TLS (ALPN ``h2``), with grpc.aio's ``stop(grace)``."""

from __future__ import annotations

import asyncio
import logging
import ssl

from kiln.frontends.grpc.h2 import rpc
from kiln.frontends.grpc.h2.connection import Connection, Limits
from kiln.frontends.grpc.h2.dispatch import Dispatcher

log = logging.getLogger(__name__)


class H2GrpcServer:
    def __init__(
        self,
        dispatcher: Dispatcher,
        ssl_context: ssl.SSLContext | None = None,
        limits: Limits | None = None,
    ) -> None:
        self.dispatcher = dispatcher
        self.limits = limits if limits is not None else Limits()
        self.ssl_context = ssl_context
        self.connections: set[Connection] = set()
        self._listener: asyncio.Server | None = None
        self._idle = asyncio.Event()
        self._idle.set()

    @property
    def sockets(self) -> list[tuple[str, int]]:
        if self._listener is None:
            return []
        return [s.getsockname()[:2] for s in self._listener.sockets]

    def _connection(self) -> Connection:
        return Connection(self.dispatcher, self._opened, self._closed, self.limits)

    def _opened(self, conn: Connection) -> None:
        self.connections.add(conn)
        self._idle.clear()
        if self._listener is not None and not self._listener.is_serving():
            conn.drain()  # accepted just before the listener closed

    def _closed(self, conn: Connection) -> None:
        self.connections.discard(conn)
        if not self.connections:
            self._idle.set()

    async def start(self, host: str, port: int) -> None:
        """Binds now: a port in use raises OSError here, as grpc.aio's failed bind does."""
        loop = asyncio.get_running_loop()
        self._listener = await loop.create_server(
            self._connection,
            host,
            port,
            ssl=self.ssl_context,
            reuse_port=False,
            backlog=1024,
        )

    async def stop(self, grace: float | None = None) -> None:
        """Stop accepting; GOAWAY on every connection; calls in flight get ``grace``
        seconds to finish, then are cancelled (UNAVAILABLE) and the connections close."""
        if self._listener is not None:
            self._listener.close()
        for conn in list(self.connections):
            conn.drain()
        if grace:
            try:
                await asyncio.wait_for(self._idle.wait(), grace)
            except TimeoutError:
                log.warning("gRPC: %d call(s) still running after %.0fs", self._running(), grace)
        for call in list(self.dispatcher.calls):
            call.finish(rpc.UNAVAILABLE, "server shutting down")
            if call.task is not None:
                call.task.cancel()
        for conn in list(self.connections):
            conn.close()
        await asyncio.sleep(0)  # let cancelled handlers unwind before the loop moves on

    def _running(self) -> int:
        return len(self.dispatcher.calls)
