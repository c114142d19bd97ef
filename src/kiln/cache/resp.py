"""A small Redis client for the response cache: RESP2 over asyncio, commands pipelined.

Why not redis-py: docs/design/resp-client.md. The cache needs five commands (``AUTH``,
``SELECT``, ``PING``, ``GET``, ``SET``). Each connection is an ``asyncio.Protocol``
whose replies resolve a FIFO of futures, so any number of requests share a connection
without waiting for one another (Redis answers in order), and a command costs one
``write`` and one parse.

A connection that fails, closes or overruns ``socket_timeout`` fails its pending commands
and is replaced on the next call; a connect that failed is not retried for a second, so a
Redis that is down costs a request an immediate ``ConnectionError``, not a connect timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import ssl
import time
from collections import deque
from typing import Any, cast

_CRLF = b"\r\n"
_RETRY_AFTER_S = 1.0
MAX_LINE = 64 * 1024  # a status, error or length line; Redis's own are far shorter
MAX_BULK = 512 * 1024 * 1024  # Redis's proto-max-bulk-len: no value it holds is larger


class RespError(Exception):
    """An error reply from Redis (``-ERR ...``, ``-WRONGPASS ...``)."""


class _Connection(asyncio.Protocol):
    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.pending: deque[asyncio.Future[Any]] = deque()
        self.buffer = bytearray()
        self.lost = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass

    def command(self, *args: bytes) -> asyncio.Future[Any]:
        if self.lost or self.transport is None:
            raise ConnectionError("the connection to Redis was lost")
        parts = [b"*%d\r\n" % len(args)]
        for arg in args:
            parts.append(b"$%d\r\n" % len(arg))
            parts.append(arg)
            parts.append(_CRLF)
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self.pending.append(future)
        self.transport.write(b"".join(parts))
        return future

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        at = 0
        while True:
            try:
                parsed = _parse(self.buffer, at)
            except ValueError as exc:  # not RESP: nothing after it can be trusted
                self._fail(ConnectionError(f"unexpected reply from Redis: {exc}"))
                return
            if parsed is None:
                break
            value, at = parsed
            if not self.pending:
                self._fail(ConnectionError("Redis sent a reply nobody asked for"))
                return
            future = self.pending.popleft()
            if not future.done():  # a caller that timed out has gone
                if isinstance(value, RespError):
                    future.set_exception(value)
                else:
                    future.set_result(value)
        if at:
            del self.buffer[:at]

    def connection_lost(self, exc: Exception | None) -> None:
        self._fail(ConnectionError(f"the connection to Redis closed ({exc or 'by the peer'})"))

    def close(self) -> None:
        self._fail(ConnectionError("the connection to Redis was closed"))

    def _fail(self, error: Exception) -> None:
        self.lost = True
        if self.transport is not None:
            self.transport.close()
        while self.pending:
            future = self.pending.popleft()
            if not future.done():
                future.set_exception(error)


def _parse(buffer: bytearray, at: int) -> tuple[Any, int] | None:
    """One reply starting at ``at`` and where the next begins; None when incomplete.
    Simple strings, errors, integers and bulk strings: all these commands answer.
    ``ValueError`` for anything else, and for a line or bulk string past Redis's own
    sizes: waiting for its end would buffer without bound."""
    limit = at + 1 + MAX_LINE + 2  # type byte, line, CRLF
    end = buffer.find(_CRLF, at, limit)
    if end < 0:
        if len(buffer) >= limit:
            raise ValueError(f"a reply line longer than {MAX_LINE} bytes")
        return None
    kind, line = buffer[at : at + 1], bytes(buffer[at + 1 : end])
    after = end + 2
    if kind == b"$":
        size = _integer(line)
        if size < 0:
            return None, after
        if size > MAX_BULK:
            raise ValueError(f"a bulk string of {size} bytes (Redis's limit is {MAX_BULK})")
        if len(buffer) < after + size + 2:
            return None
        return bytes(buffer[after : after + size]), after + size + 2
    if kind == b"+":
        return line, after
    if kind == b"-":
        return RespError(line.decode(errors="replace")), after
    if kind == b":":
        return _integer(line), after
    raise ValueError(f"reply type {bytes(kind)!r}")


_INTEGER = re.compile(rb"-?[0-9]{1,19}")  # a signed 64-bit integer, as Redis writes one


def _integer(line: bytes) -> int:
    if not _INTEGER.fullmatch(line):
        raise ValueError(f"not an integer: {line[:32]!r}")
    return int(line)


class RespClient:
    """``connections`` pipelined connections to one Redis, used in turn."""

    def __init__(
        self,
        host: str,
        port: int,
        *,
        username: str = "",
        password: str = "",
        db: int = 0,
        connect_timeout: float | None = None,
        socket_timeout: float | None = None,
        connections: int = 1,
        ssl_context: ssl.SSLContext | None = None,
        server_hostname: str = "",
    ) -> None:
        """``ssl_context``: speak TLS, verifying Redis's certificate against
        ``server_hostname`` (``host`` when empty), which also goes out as SNI."""
        self.host, self.port = host, port
        self.ssl_context = ssl_context
        self.server_hostname = server_hostname or host
        self.username, self.password, self.db = username, password, db
        self.connect_timeout, self.socket_timeout = connect_timeout, socket_timeout
        self._slots: list[_Connection | None] = [None] * max(1, connections)
        self._connecting: list[asyncio.Task[_Connection] | None] = [None] * len(self._slots)
        self._next = 0
        self._failed_at: float | None = None
        self._last_error = ""

    async def call(self, *args: bytes) -> Any:
        """The reply to one command; ``RespError`` for an error reply, ``ConnectionError``
        or ``TimeoutError`` when Redis cannot answer."""
        index = self._next
        self._next = (index + 1) % len(self._slots)
        conn = self._slots[index]
        if conn is None or conn.lost:
            conn = await self._connect(index)
        future = conn.command(*args)
        if self.socket_timeout is None:
            return await future
        try:
            return await asyncio.wait_for(future, self.socket_timeout)
        except TimeoutError:
            conn.close()  # its later replies would be late for everyone behind it
            raise TimeoutError(f"Redis did not answer within {self.socket_timeout:g} s") from None

    async def close(self) -> None:
        for task in self._connecting:
            if task is not None:
                task.cancel()
        for conn in self._slots:
            if conn is not None:
                conn.close()
        self._slots = [None] * len(self._slots)

    async def _connect(self, index: int) -> _Connection:
        task = self._connecting[index]
        if task is None:
            if self._failed_at is not None and time.monotonic() - self._failed_at < _RETRY_AFTER_S:
                raise ConnectionError(self._last_error)
            task = asyncio.ensure_future(self._open())
            self._connecting[index] = task
        try:
            conn = await asyncio.shield(task)
        except Exception as exc:
            self._failed_at = time.monotonic()
            self._last_error = f"cannot connect to Redis at {self.host}:{self.port}: {exc}"
            raise ConnectionError(self._last_error) from None
        finally:
            if task.done():
                self._connecting[index] = None
        self._failed_at = None
        self._slots[index] = conn
        return conn

    async def _open(self) -> _Connection:
        loop = asyncio.get_running_loop()
        if self.ssl_context is None:
            opening = loop.create_connection(_Connection, self.host, self.port)
        else:
            opening = loop.create_connection(
                _Connection,
                self.host,
                self.port,
                ssl=self.ssl_context,
                server_hostname=self.server_hostname,
            )
        _, conn = await asyncio.wait_for(opening, self.connect_timeout)
        try:
            if self.password:
                auth = [self.username.encode()] if self.username else []
                await self._setup(conn, b"AUTH", *auth, self.password.encode())
            if self.db:
                await self._setup(conn, b"SELECT", str(self.db).encode())
        except BaseException:
            conn.close()
            raise
        return conn

    async def _setup(self, conn: _Connection, *args: bytes) -> None:
        reply = conn.command(*args)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(reply, self.socket_timeout or self.connect_timeout)
            return
        raise TimeoutError(f"Redis did not answer {args[0].decode()}")
