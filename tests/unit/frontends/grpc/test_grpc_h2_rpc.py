"""gRPC's wire rules on HTTP/2: message framing across DATA frames, ``grpc-message``
percent-encoding, ``grpc-timeout``, compressed messages and the status blocks."""

from __future__ import annotations

import gzip
import itertools
import random
import zlib

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kiln.frontends.grpc.h2 import rpc
from kiln.frontends.grpc.h2.hpack import Decoder

MESSAGES = [b"", b"a", b"hello" * 1000, bytes(range(256)), b"z" * 70_000]
WIRE = b"".join(rpc.prefix(len(m)) + m for m in MESSAGES) + rpc.prefix(3, True) + b"abc"
EXPECTED = [(0, m) for m in MESSAGES] + [(1, b"abc")]


def read(chunks: list[bytes], limit: int = 2**31 - 1) -> list[tuple[int, bytes]]:
    reader = rpc.MessageReader(limit)
    out = []
    for chunk in chunks:
        out.extend(reader.feed(chunk))
    assert not reader.partial
    return out


def test_messages_whole_and_byte_by_byte() -> None:
    assert read([WIRE]) == EXPECTED
    small = b"".join(rpc.prefix(len(m)) + m for m in MESSAGES[:4])
    assert read([small[i : i + 1] for i in range(len(small))]) == EXPECTED[:4]


@pytest.mark.parametrize("seed", range(10))
def test_messages_in_random_frames(seed: int) -> None:
    rng = random.Random(seed)
    chunks, pos = [], 0
    while pos < len(WIRE):
        n = rng.randint(1, 20_000)
        chunks.append(WIRE[pos : pos + n])
        pos += n
    assert read(chunks) == EXPECTED


@given(st.lists(st.binary(max_size=300), max_size=8), st.lists(st.integers(0, 3000)))
def test_messages_any_split(messages: list[bytes], cuts: list[int]) -> None:
    wire = b"".join(rpc.prefix(len(m)) + m for m in messages)
    points = sorted({0, len(wire), *(c for c in cuts if c < len(wire))})
    chunks = [wire[a:b] for a, b in itertools.pairwise(points)]
    assert read(chunks) == [(0, m) for m in messages]


def test_partial_message_is_reported() -> None:
    reader = rpc.MessageReader(100)
    assert reader.feed(rpc.prefix(10) + b"abc") == []
    assert reader.partial


def test_oversized_message_refused_from_its_prefix() -> None:
    reader = rpc.MessageReader(100)
    with pytest.raises(rpc.MessageTooLarge, match=r"larger than max \(101 vs. 100\)"):
        reader.feed(rpc.prefix(101))  # none of the body has arrived
    assert rpc.MessageReader(100).feed(rpc.prefix(100) + b"x" * 100) == [(0, b"x" * 100)]
    with pytest.raises(rpc.MessageTooLarge):
        rpc.MessageReader(100).feed(rpc.prefix(101) + b"x" * 101)


# ---- grpc-message -----------------------------------------------------------------------
def test_percent_encoding_follows_the_spec() -> None:
    assert rpc.percent_encode("plain text: ok!") == b"plain text: ok!"
    assert rpc.percent_encode("100%") == b"100%25"
    assert rpc.percent_encode("a\nb\tc") == b"a%0Ab%09c"
    assert rpc.percent_encode("\x7f") == b"%7F"
    assert rpc.percent_encode("Ŝ€") == b"%C5%9C%E2%82%AC"  # UTF-8 bytes, upper-case hex
    assert rpc.percent_decode(b"%C5%9C 100%25 %zz%4") == "Ŝ 100% %zz%4"


@given(st.text())
def test_percent_round_trip(text: str) -> None:
    encoded = rpc.percent_encode(text)
    assert all(0x20 <= b <= 0x7E for b in encoded)
    assert rpc.percent_decode(encoded) == text.encode("utf-8", "replace").decode("utf-8")


# ---- grpc-timeout -----------------------------------------------------------------------
@pytest.mark.parametrize(
    ("value", "seconds"),
    [(b"1H", 3600.0), (b"2M", 120.0), (b"3S", 3.0), (b"60100m", 60.1), (b"5u", 5e-6),
     (b"99999999n", 0.099999999), (b"0m", 0.0)],
)  # fmt: skip
def test_timeout_units(value: bytes, seconds: float) -> None:
    assert rpc.parse_timeout(value) == pytest.approx(seconds)


@pytest.mark.parametrize("value", [b"", b"S", b"10", b"10x", b"-1S", b"123456789S", b"1.5S"])
def test_malformed_timeout_is_ignored(value: bytes) -> None:
    assert rpc.parse_timeout(value) is None


# ---- compression ------------------------------------------------------------------------
def test_inflate_gzip_and_deflate() -> None:
    data = b"tensor bytes " * 1000
    assert rpc.inflate(gzip.compress(data), b"gzip", 2**20) == data
    assert rpc.inflate(zlib.compress(data), b"deflate", 2**20) == data


def test_inflate_limits_the_output() -> None:
    bomb = gzip.compress(b"\0" * 10_000_000)
    with pytest.raises(rpc.MessageTooLarge):
        rpc.inflate(bomb, b"gzip", 1_000_000)


@pytest.mark.parametrize(
    ("payload", "encoding"),
    [(b"not gzip", b"gzip"), (gzip.compress(b"x" * 100)[:-12], b"gzip"),
     (zlib.compress(b"abc"), b"gzip"), (b"\x78\x9c\x00", b"deflate")],
    ids=["garbage", "truncated", "wrong-format", "truncated-deflate"],
)  # fmt: skip
def test_inflate_refuses_bad_input(payload: bytes, encoding: bytes) -> None:
    with pytest.raises(ValueError, match=r"decompress|truncated"):
        rpc.inflate(payload, encoding, 2**20)


# ---- status blocks ----------------------------------------------------------------------
def test_status_blocks() -> None:
    d = Decoder()
    assert d.decode(rpc.status_block(0, "", trailers_only=False)) == ((b"grpc-status", b"0"),)
    only = dict(d.decode(rpc.status_block(13, "bad\n100%", trailers_only=True)))
    assert only == {
        b":status": b"200",
        b"content-type": b"application/grpc",
        b"grpc-status": b"13",
        b"grpc-message": b"bad%0A100%25",
    }
    unimplemented = dict(d.decode(rpc.status_block(12, "no", trailers_only=False)))
    assert unimplemented[b"grpc-accept-encoding"] == b"identity,deflate,gzip"
