"""A shared Redis may hold anything, and a broken one may send anything: the response
cache reads every reply as untrusted. Before: a value under kiln's key that was too short
for its header length (``struct.error``), had a JSON header nested past the parser's depth
(``RecursionError``) or an ``Infinity`` byte count (``OverflowError``) raised out of the
lookup and failed the inference request, though a record that does not parse is a miss;
and a reply line that never ended (no CRLF) or a bulk string announced at any length was
buffered without bound, the buffer searched again from its start at every read."""

from __future__ import annotations

import asyncio
import json
import struct
from collections.abc import AsyncIterator

import pytest

from kiln.cache.config import RedisSettings
from kiln.cache.redis import MAGIC, PREFIX, RedisResponseCache
from kiln.cache.resp import MAX_BULK, MAX_LINE, RespClient, _parse


def _record(header: bytes) -> bytes:
    return MAGIC + struct.pack("<I", len(header)) + header


def _output(**overrides: object) -> bytes:
    spec = {"name": "Y", "datatype": "FP32", "shape": [1], "nbytes": 4, **overrides}
    return json.dumps({"outputs": [spec], "parameters": {}}).encode()


BAD_RECORDS = {
    "magic-only": MAGIC,
    "short-length": MAGIC + b"\x01",
    "nested-header": _record(b"[" * 100_000 + b"]" * 100_000),
    "infinite-nbytes": _record(_output(nbytes=float("inf"))),
    "infinite-dim": _record(_output(shape=[float("inf")])),
    "nan-dim": _record(_output(shape=[float("nan")])),
}


async def _serve(replies: dict[bytes, bytes]) -> tuple[asyncio.Server, int]:
    """A Redis that answers PING and GET <key> with ``replies[key]`` (raw RESP)."""

    async def client(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                count = int((await reader.readline())[1:])
                args = []
                for _ in range(count):
                    size = int((await reader.readline())[1:])
                    args.append((await reader.readexactly(size + 2))[:-2])
                if args[0] == b"PING":
                    writer.write(b"+PONG\r\n")
                else:
                    writer.write(replies[args[1]])
                await writer.drain()
        except (ValueError, asyncio.IncompleteReadError, ConnectionError):
            writer.close()

    server = await asyncio.start_server(client, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1]


def _bulk(value: bytes) -> bytes:
    return b"$%d\r\n%s\r\n" % (len(value), value)


@pytest.fixture
async def cache() -> AsyncIterator[RedisResponseCache]:
    replies = {PREFIX + name.encode(): _bulk(raw) for name, raw in BAD_RECORDS.items()}
    server, port = await _serve(replies)
    cache = RedisResponseCache(RedisSettings("127.0.0.1", port, socket_timeout_ms=5000))
    await cache.open()
    yield cache
    await cache.close()
    server.close()


@pytest.mark.parametrize("name", sorted(BAD_RECORDS))
async def test_a_value_that_is_not_a_kiln_record_is_a_miss(
    cache: RedisResponseCache, name: str
) -> None:
    assert await cache.get(name.encode()) is None
    assert cache.errors == 1


@pytest.mark.parametrize(
    ("reply", "words"),
    [
        (b"+" + b"x" * (MAX_LINE + 2), "a reply line longer than"),
        (b"$%d\r\n" % (MAX_BULK + 1), f"a bulk string of {MAX_BULK + 1} bytes"),
        (b":" + b"1" * 5000 + b"\r\n", "not an integer"),
        (b"$1_0\r\n", "not an integer"),
    ],
)
async def test_a_reply_without_bounds_fails_the_connection(reply: bytes, words: str) -> None:
    server, port = await _serve({b"k": reply})
    client = RespClient("127.0.0.1", port, socket_timeout=5)
    try:
        with pytest.raises(ConnectionError, match=words):
            await client.call(b"GET", b"k")
    finally:
        await client.close()
        server.close()


def test_replies_up_to_the_bounds_still_parse() -> None:
    line = b"x" * MAX_LINE
    assert _parse(bytearray(b"+" + line + b"\r\n"), 0) == (line, MAX_LINE + 3)
    assert _parse(bytearray(b"+" + line), 0) is None  # its CRLF may still come
    assert _parse(bytearray(b":-9223372036854775808\r\n"), 0) == (-(2**63), 23)
    assert _parse(bytearray(b"$%d\r\n" % MAX_BULK), 0) is None  # waits for the bytes
