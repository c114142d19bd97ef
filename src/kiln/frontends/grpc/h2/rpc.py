"""gRPC's layer on HTTP/2 (grpc/doc/PROTOCOL-HTTP2.md): length-prefixed messages, the
``grpc-timeout`` and ``grpc-message`` encodings, compressed requests and the header
blocks of responses, built once."""

from __future__ import annotations

import re
import zlib

from kiln.frontends.grpc.h2.hpack import encode_int, literal

# status codes (grpc/doc/statuscodes.md)
OK = 0
CANCELLED = 1
UNKNOWN = 2
INVALID_ARGUMENT = 3
DEADLINE_EXCEEDED = 4
NOT_FOUND = 5
RESOURCE_EXHAUSTED = 8
UNIMPLEMENTED = 12
INTERNAL = 13
UNAVAILABLE = 14
UNAUTHENTICATED = 16

ACCEPT_ENCODING = b"identity,deflate,gzip"

# ``:status: 200`` is static entry 8; content-type has a static name.
RESPONSE_HEADERS = encode_int(8, 7, 0x80) + literal(b"content-type", b"application/grpc")
TRAILERS_OK = literal(b"grpc-status", b"0")
TRAILERS_ONLY_OK = RESPONSE_HEADERS + TRAILERS_OK


class MessageTooLarge(Exception):
    def __init__(self, size: int, limit: int) -> None:
        super().__init__(f"Received message larger than max ({size} vs. {limit})")


# ---- grpc-message ----------------------------------------------------------------------
# Percent-encoded UTF-8: every byte outside 0x20-0x7E, and '%' itself, as %XX.
_UNSAFE = re.compile(rb"[^\x20-\x24\x26-\x7e]")
_ESCAPED = re.compile(rb"%([0-9A-Fa-f]{2})")


def percent_encode(message: str) -> bytes:
    raw = message.encode("utf-8", "replace")
    return _UNSAFE.sub(lambda m: b"%%%02X" % m.group()[0], raw)


def percent_decode(value: bytes) -> str:
    """The reverse; a '%' not followed by two hex digits stays as it is (the spec asks
    receivers to be lenient)."""
    raw = _ESCAPED.sub(lambda m: bytes((int(m.group(1), 16),)), value)
    return raw.decode("utf-8", "replace")


def status_block(code: int, message: str, trailers_only: bool) -> bytes:
    """Trailers (or a trailers-only response) carrying ``grpc-status``/``grpc-message``."""
    if code == OK and not message:
        return TRAILERS_ONLY_OK if trailers_only else TRAILERS_OK
    block = literal(b"grpc-status", b"%d" % code)
    if message:
        block += literal(b"grpc-message", percent_encode(message))
    if code == UNIMPLEMENTED:  # answers to an unknown compression name ask for these
        block += literal(b"grpc-accept-encoding", ACCEPT_ENCODING)
    return RESPONSE_HEADERS + block if trailers_only else block


# ---- grpc-timeout ----------------------------------------------------------------------
_UNITS = {ord("H"): 3600.0, ord("M"): 60.0, ord("S"): 1.0, ord("m"): 1e-3, ord("u"): 1e-6,
          ord("n"): 1e-9}  # fmt: skip


def parse_timeout(value: bytes) -> float | None:
    """Seconds, or None for a malformed value (1-8 ASCII digits and a unit)."""
    if not 2 <= len(value) <= 9 or not value[:-1].isdigit():
        return None
    unit = _UNITS.get(value[-1])
    return None if unit is None else int(value[:-1]) * unit


# ---- messages --------------------------------------------------------------------------
def prefix(length: int, compressed: bool = False) -> bytes:
    return (b"\x01" if compressed else b"\x00") + length.to_bytes(4, "big")


class MessageReader:
    """Length-prefixed messages out of DATA payloads cut anywhere (a message across
    frames, several messages in one). A declared length above ``limit`` is refused as
    soon as its prefix arrives, before its bytes are buffered."""

    __slots__ = ("_buf", "limit")

    def __init__(self, limit: int) -> None:
        self._buf = bytearray()
        self.limit = limit

    @property
    def partial(self) -> bool:
        """Bytes of an unfinished message are waiting."""
        return bool(self._buf)

    def feed(self, data: bytes) -> list[tuple[int, bytes]]:
        """Complete messages as (compressed flag, bytes)."""
        buf = self._buf
        if not buf and len(data) >= 5:  # the common case: whole messages in one payload
            length = int.from_bytes(data[1:5], "big")
            if length + 5 == len(data):
                if length > self.limit:
                    raise MessageTooLarge(length, self.limit)
                return [(data[0], data[5:])]
        buf += data
        out: list[tuple[int, bytes]] = []
        while len(buf) >= 5:
            length = int.from_bytes(buf[1:5], "big")
            if length > self.limit:
                raise MessageTooLarge(length, self.limit)
            end = 5 + length
            if len(buf) < end:
                break
            with memoryview(buf) as view:
                out.append((buf[0], bytes(view[5:end])))
            del buf[:end]
        return out


def inflate(payload: bytes, encoding: bytes, limit: int) -> bytes:
    """A compressed message; ``gzip`` or ``deflate`` (zlib format, as gRPC means it)."""
    stream = zlib.decompressobj(31 if encoding == b"gzip" else 15)
    try:
        out = stream.decompress(payload, limit + 1)
    except zlib.error as exc:
        raise ValueError(f"cannot decompress the message ({encoding.decode()}): {exc}") from None
    if len(out) > limit:
        raise MessageTooLarge(len(out), limit)
    if not stream.eof:
        raise ValueError(f"truncated {encoding.decode()} message")
    if stream.unused_data:  # zlib stops at the end of the first gzip member
        raise ValueError(
            f"{len(stream.unused_data)} bytes follow the end of the {encoding.decode()} message "
            "(trailing data or a second gzip member)"
        )
    return out
