"""kiln's RESP client, without a socket: replies split anywhere still resolve the right
command, in order; error replies, nil and garbage; a connection that drops fails what is
pending; and a Redis that refuses connections is not dialled again for every request."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from kiln.cache.resp import RespClient, RespError, _Connection, _parse


class FakeTransport:
    def __init__(self) -> None:
        self.written: list[bytes] = []
        self.closed = False

    def write(self, data: bytes) -> None:
        self.written.append(data)

    def close(self) -> None:
        self.closed = True


def _connection() -> tuple[_Connection, FakeTransport]:
    conn = _Connection()
    transport = FakeTransport()
    conn.connection_made(transport)  # type: ignore[arg-type]
    return conn, transport


@pytest.mark.parametrize(
    ("raw", "value", "rest"),
    [
        (b"+OK\r\n", b"OK", 5),
        (b":42\r\n", 42, 5),
        (b"$-1\r\n", None, 5),
        (b"$3\r\na\r\n\r\n", b"a\r\n", 9),  # a bulk string may hold CRLF
        (b"$0\r\n\r\n", b"", 6),
    ],
)
def test_each_reply_kind_parses(raw: bytes, value: Any, rest: int) -> None:
    assert _parse(bytearray(raw), 0) == (value, rest)


def test_an_error_reply_is_a_resp_error_and_garbage_is_refused() -> None:
    error, _ = _parse(bytearray(b"-WRONGPASS invalid password\r\n"), 0)  # type: ignore[misc]
    assert isinstance(error, RespError) and "WRONGPASS" in str(error)
    with pytest.raises(ValueError):
        _parse(bytearray(b"*1\r\n"), 0)  # arrays: no command kiln sends answers one
    assert _parse(bytearray(b"$5\r\nab"), 0) is None  # not all here yet


async def test_pipelined_replies_split_anywhere_resolve_their_own_commands() -> None:
    conn, transport = _connection()
    futures = [conn.command(b"GET", b"k%d" % i) for i in range(3)]
    assert transport.written[0] == b"*2\r\n$3\r\nGET\r\n$2\r\nk0\r\n"
    stream = b"$2\r\nv0\r\n$-1\r\n-ERR wrong type\r\n"
    for byte in range(len(stream)):  # one byte at a time
        conn.data_received(stream[byte : byte + 1])
    assert futures[0].result() == b"v0"
    assert futures[1].result() is None
    with pytest.raises(RespError, match="wrong type"):
        futures[2].result()
    assert conn.buffer == bytearray()


async def test_a_dropped_connection_fails_what_is_pending_and_takes_no_more() -> None:
    conn, transport = _connection()
    pending = conn.command(b"GET", b"k")
    conn.connection_lost(None)
    assert transport.closed
    with pytest.raises(ConnectionError, match="closed"):
        pending.result()
    with pytest.raises(ConnectionError):
        conn.command(b"PING")


async def test_a_reply_nobody_asked_for_or_garbage_closes_the_connection() -> None:
    conn, transport = _connection()
    conn.data_received(b"+OK\r\n")
    assert conn.lost and transport.closed
    conn, transport = _connection()
    pending = conn.command(b"GET", b"k")
    conn.data_received(b"?what\r\n")
    assert transport.closed
    with pytest.raises(ConnectionError, match="unexpected reply"):
        pending.result()


async def test_a_refused_connect_is_not_retried_for_every_request() -> None:
    server = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    server.close()
    await server.wait_closed()  # nothing listens on the port now
    client = RespClient("127.0.0.1", port, connect_timeout=2.0)
    with pytest.raises(ConnectionError, match=f"cannot connect to Redis at 127.0.0.1:{port}"):
        await client.call(b"PING")
    dials = 0
    real_open = client._open

    async def counting_open() -> _Connection:
        nonlocal dials
        dials += 1
        return await real_open()

    client._open = counting_open  # type: ignore[method-assign]
    for _ in range(5):  # within the second after the failure: answered at once
        with pytest.raises(ConnectionError, match="cannot connect"):
            await client.call(b"GET", b"k")
    assert dials == 0
    await client.close()


async def test_no_answer_within_socket_timeout_fails_the_call_and_the_next_one_redials() -> None:
    accepted: list[asyncio.StreamWriter] = []

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted.append(writer)  # reads nothing, answers nothing

    server = await asyncio.start_server(silent, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    client = RespClient("127.0.0.1", port, socket_timeout=0.05)
    try:
        with pytest.raises(TimeoutError, match=r"did not answer within 0\.05 s"):
            await client.call(b"GET", b"k")
        first = client._slots[0]
        assert first is not None and first.lost  # its late replies would be out of order
        with pytest.raises(TimeoutError):
            await client.call(b"GET", b"k")
        assert client._slots[0] is not first and len(accepted) == 2  # a new connection
    finally:
        await client.close()
        server.close()
        for writer in accepted:
            writer.close()
        await server.wait_closed()
