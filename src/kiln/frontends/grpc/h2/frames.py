"""HTTP/2 frames (RFC 9113 §4, §6): the constants, an incremental reader and the encoders
the server needs. Frames are plain tuples ``(type, flags, stream_id, payload)``: the
connection handles a few per request and a class per frame would cost more than the rest
of the parse."""

from __future__ import annotations

import struct
from collections.abc import Iterator

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"

# frame types (§6)
DATA = 0x0
HEADERS = 0x1
PRIORITY = 0x2
RST_STREAM = 0x3
SETTINGS = 0x4
PUSH_PROMISE = 0x5
PING = 0x6
GOAWAY = 0x7
WINDOW_UPDATE = 0x8
CONTINUATION = 0x9

# flags
END_STREAM = 0x1
ACK = 0x1
END_HEADERS = 0x4
PADDED = 0x8
PRIORITY_FLAG = 0x20

# error codes (§7)
NO_ERROR = 0x0
PROTOCOL_ERROR = 0x1
INTERNAL_ERROR = 0x2
FLOW_CONTROL_ERROR = 0x3
SETTINGS_TIMEOUT = 0x4
STREAM_CLOSED = 0x5
FRAME_SIZE_ERROR = 0x6
REFUSED_STREAM = 0x7
CANCEL = 0x8
COMPRESSION_ERROR = 0x9
CONNECT_ERROR = 0xA
ENHANCE_YOUR_CALM = 0xB
INADEQUATE_SECURITY = 0xC
HTTP_1_1_REQUIRED = 0xD

# settings (§6.5.2)
HEADER_TABLE_SIZE = 0x1
ENABLE_PUSH = 0x2
MAX_CONCURRENT_STREAMS = 0x3
INITIAL_WINDOW_SIZE = 0x4
MAX_FRAME_SIZE = 0x5
MAX_HEADER_LIST_SIZE = 0x6

DEFAULT_WINDOW = 65_535
DEFAULT_MAX_FRAME = 16_384
MAX_FRAME_LIMIT = 2**24 - 1
MAX_WINDOW = 2**31 - 1

_HEAD = struct.Struct(">BHBBL")  # length as 8 + 16 bits, type, flags, R + stream id
_SETTING = struct.Struct(">HL")
_U32 = struct.Struct(">L")
_GOAWAY = struct.Struct(">LL")

Frame = tuple[int, int, int, bytes]


class H2ConnectionError(Exception):
    """A connection error (§5.4.1): the connection ends with GOAWAY(code)."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


class H2StreamError(Exception):
    """A stream error (§5.4.2): the stream ends with RST_STREAM(code), the rest goes on."""

    def __init__(self, stream_id: int, code: int, message: str) -> None:
        super().__init__(message)
        self.stream_id = stream_id
        self.code = code


class FrameReader:
    """Cuts a byte stream (the client preface first) into frames, in whatever pieces the
    bytes arrive. A frame longer than ``max_frame_size`` is refused from its header alone,
    before its payload is buffered."""

    __slots__ = ("_buf", "_need", "_preface", "max_frame_size")

    def __init__(self, max_frame_size: int = DEFAULT_MAX_FRAME, preface: bool = True) -> None:
        self._buf = bytearray()
        # bytes the next step needs; while short of it, data is only appended (a large
        # frame arriving in many reads is copied once, not once per read)
        self._need = len(PREFACE) if preface else 9
        self._preface = preface
        self.max_frame_size = max_frame_size

    def feed(self, data: bytes) -> Iterator[Frame]:
        buf = self._buf
        if self._preface:
            # refuse a wrong preface (an HTTP/1.1 request, TLS to a plain port) as soon as
            # it differs, not once 24 bytes have come
            got = bytes(buf[: len(PREFACE)]) + data[: len(PREFACE)]
            n = min(len(got), len(PREFACE))
            if got[:n] != PREFACE[:n]:
                raise H2ConnectionError(PROTOCOL_ERROR, "invalid connection preface")
        if buf:
            buf += data
            if len(buf) < self._need:
                return
            data = bytes(buf)
            buf.clear()
        elif len(data) < self._need:
            buf += data
            return
        pos = 0
        end = len(data)
        if self._preface:
            self._preface = False
            pos = len(PREFACE)
        head = _HEAD.unpack_from
        limit = self.max_frame_size
        while end - pos >= 9:
            hi, lo, ftype, flags, sid = head(data, pos)
            length = (hi << 16) | lo
            if length > limit:
                raise H2ConnectionError(
                    FRAME_SIZE_ERROR, f"frame of {length} bytes exceeds {limit}"
                )
            stop = pos + 9 + length
            if stop > end:
                self._need = stop - pos
                break
            yield ftype, flags, sid & 0x7FFFFFFF, data[pos + 9 : stop]
            pos = stop
        else:
            self._need = 9
        if pos < end:
            buf += data[pos:] if pos else data


def frame(ftype: int, flags: int, stream_id: int, payload: bytes = b"") -> bytes:
    n = len(payload)
    return _HEAD.pack(n >> 16, n & 0xFFFF, ftype, flags, stream_id) + payload


def frame_head(ftype: int, flags: int, stream_id: int, length: int) -> bytes:
    return _HEAD.pack(length >> 16, length & 0xFFFF, ftype, flags, stream_id)


def headers_frames(stream_id: int, block: bytes, end_stream: bool, max_frame: int) -> bytes:
    """HEADERS (+ CONTINUATION when the block is larger than the peer's frame size)."""
    flags = END_STREAM if end_stream else 0
    if len(block) <= max_frame:
        return frame(HEADERS, flags | END_HEADERS, stream_id, block)
    parts = [block[i : i + max_frame] for i in range(0, len(block), max_frame)]
    out = [frame(HEADERS, flags, stream_id, parts[0])]
    for part in parts[1:-1]:
        out.append(frame(CONTINUATION, 0, stream_id, part))
    out.append(frame(CONTINUATION, END_HEADERS, stream_id, parts[-1]))
    return b"".join(out)


def settings_frame(settings: dict[int, int]) -> bytes:
    return frame(SETTINGS, 0, 0, b"".join(_SETTING.pack(k, v) for k, v in settings.items()))


def parse_settings(payload: bytes) -> list[tuple[int, int]]:
    return [_SETTING.unpack_from(payload, i) for i in range(0, len(payload), 6)]


SETTINGS_ACK = frame(SETTINGS, ACK, 0)


def window_update(stream_id: int, increment: int) -> bytes:
    return frame(WINDOW_UPDATE, 0, stream_id, _U32.pack(increment))


def rst_stream(stream_id: int, code: int) -> bytes:
    return frame(RST_STREAM, 0, stream_id, _U32.pack(code))


def goaway(last_stream_id: int, code: int, debug: bytes = b"") -> bytes:
    return frame(GOAWAY, 0, 0, _GOAWAY.pack(last_stream_id, code) + debug)


def ping_ack(payload: bytes) -> bytes:
    return frame(PING, ACK, 0, payload)


def read_u32(payload: bytes) -> int:
    return int(_U32.unpack_from(payload)[0])


def parse_goaway(payload: bytes) -> tuple[int, int, bytes]:
    last, code = _GOAWAY.unpack_from(payload)
    return last & 0x7FFFFFFF, code, payload[8:]
