"""An HTTP/2 server connection (RFC 9113) as an asyncio protocol: frames in, streams
handed to the gRPC layer, and the rules that make a broken peer close only its own
connection. The send side (flow-controlled writes) is :mod:`.sender`.

Receive side: we advertise large windows and give credit back once half of a window has
been consumed, so a fast client never waits for us and one WINDOW_UPDATE covers many
requests. Connection credit is returned on receipt; stream credit when the call takes the
bytes, so a streaming call whose handler falls behind stops its own client only.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, cast

from kiln.frontends.grpc.h2 import frames as f
from kiln.frontends.grpc.h2.hpack import Decoder, HeaderListTooLarge, HpackError
from kiln.frontends.grpc.h2.sender import CONNECTION_WINDOW, STREAM_WINDOW, Sender
from kiln.frontends.grpc.h2.streams import Dispatcher, Stream

log = logging.getLogger(__name__)

# What we advertise (the windows: see sender.py).
MAX_FRAME = 2**20
MAX_CONCURRENT = 1024
MAX_HEADER_LIST = 64 * 2**10
# A header block (HEADERS + CONTINUATION) larger than this closes the connection: the
# decoded list would exceed MAX_HEADER_LIST anyway, and buffering fragments is unbounded.
MAX_HEADER_BLOCK = 2 * MAX_HEADER_LIST
PREFACE_TIMEOUT = 20.0
LINGER = 2.0  # seconds a connection closed for an error keeps reading (see fail)
# Streams a client may cancel in one second before the connection is closed with
# ENHANCE_YOUR_CALM: opening and resetting streams in a loop costs the client nothing and
# the server a call each (the "rapid reset" attack, CVE-2023-44487). Generous for real
# cancellations.
# Resets we send for a stream error the client provoked count too ("MadeYouReset",
# CVE-2025-8671): a malformed frame on a stream costs the client as little as a reset.
MAX_RESETS_PER_SECOND = 1000
# SETTINGS: each INITIAL_WINDOW_SIZE walks every open stream, so one frame may carry this
# many entries (nghttp2's default) and a client may send this many frames a second.
MAX_SETTINGS_ENTRIES = 32
MAX_SETTINGS_PER_SECOND = 100
# Empty CONTINUATION (or HEADERS) fragments in one header block: they cost nothing to send
# and keep the connection in the "expecting CONTINUATION" state forever.
MAX_EMPTY_FRAGMENTS = 4
# An unfinished header block (HEADERS without END_HEADERS) must be completed within this
# long (the HTTP side's header timeout, --http-header-timeout-secs, by default).
HEADER_TIMEOUT = 30.0
# A connection with no stream open and none opened for this long is closed with
# GOAWAY(NO_ERROR) (grpc's max_connection_idle; 0: never).
IDLE_TIMEOUT = 300.0


@dataclass(frozen=True, slots=True)
class Limits:
    """What a server sets for its connections (the module's defaults otherwise)."""

    max_concurrent: int = MAX_CONCURRENT
    header_timeout: float = HEADER_TIMEOUT
    idle_timeout: float = IDLE_TIMEOUT


@lru_cache(maxsize=8)
def server_preface(max_concurrent: int) -> bytes:
    settings = {
        f.ENABLE_PUSH: 0,
        f.MAX_CONCURRENT_STREAMS: max_concurrent,
        f.INITIAL_WINDOW_SIZE: STREAM_WINDOW,
        f.MAX_FRAME_SIZE: MAX_FRAME,
        f.MAX_HEADER_LIST_SIZE: MAX_HEADER_LIST,
    }
    return f.settings_frame(settings) + f.window_update(0, CONNECTION_WINDOW - f.DEFAULT_WINDOW)


class _Rate:
    """Events in the current one-second window, for limits checked on rare frames."""

    __slots__ = ("count", "since")

    def __init__(self) -> None:
        self.count = 0
        self.since = 0.0

    def exceeds(self, limit: int) -> bool:
        now = asyncio.get_running_loop().time()
        if now - self.since > 1.0:
            self.since, self.count = now, 0
        self.count += 1
        return self.count > limit


class Connection(Sender):
    def __init__(
        self,
        dispatcher: Dispatcher,
        on_open: Callable[[Connection], None] = lambda conn: None,
        on_close: Callable[[Connection], None] = lambda conn: None,
        limits: Limits = Limits(),
    ) -> None:
        """``on_open``/``on_close``: the server's bookkeeping of live connections (a TLS
        connection counts from its completed handshake: one that fails never opens)."""
        super().__init__(on_close)
        self.dispatcher = dispatcher
        self._on_open = on_open
        self.last_stream_id = 0
        self.limits = limits
        self._reader = f.FrameReader(MAX_FRAME)
        self._decoder = Decoder(max_list_size=MAX_HEADER_LIST)
        self._got_settings = False
        self._continuation: tuple[int, int, list[bytes], int] | None = None
        self._empty_fragments = 0
        self._header_timer: asyncio.TimerHandle | None = None
        self._idle_timer: asyncio.TimerHandle | None = None
        self._idle_mark = -1
        # calls whose stream is gone (reset) but whose handler has not ended yet: they
        # keep their MAX_CONCURRENT_STREAMS slot until it has
        self.orphans = 0
        # request bytes its calls have received and their handlers not taken yet (calls.py)
        self.held = 0
        self._peer_window = f.DEFAULT_WINDOW  # its SETTINGS_INITIAL_WINDOW_SIZE
        self._recv_window = CONNECTION_WINDOW  # what the peer may still send us
        self._recv_unacked = 0
        self._preface_timer: asyncio.TimerHandle | None = None
        self._resets = _Rate()
        self._settings = _Rate()
        self.peer = ""

    # ---- asyncio.Protocol ------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass
        peer = self.transport.get_extra_info("peername")
        if isinstance(peer, tuple) and len(peer) >= 2:
            family = "ipv6" if ":" in str(peer[0]) else "ipv4"
            self.peer = f"{family}:{peer[0]}:{peer[1]}"
        self.transport.write(server_preface(self.limits.max_concurrent))
        self._on_open(self)
        loop = asyncio.get_running_loop()
        self._preface_timer = loop.call_later(PREFACE_TIMEOUT, self._preface_expired)
        if self.limits.idle_timeout > 0:
            self._idle_timer = loop.call_later(self.limits.idle_timeout, self._idle_check)

    def data_received(self, data: bytes) -> None:
        if self.closed:
            return
        self._out = out = cast(list[bytes], [])
        try:
            for ftype, flags, sid, payload in self._reader.feed(data):
                try:
                    if self._continuation is not None and ftype != f.CONTINUATION:
                        raise f.H2ConnectionError(f.PROTOCOL_ERROR, "expected CONTINUATION")
                    if not self._got_settings and (ftype != f.SETTINGS or flags & f.ACK):
                        raise f.H2ConnectionError(f.PROTOCOL_ERROR, "preface without SETTINGS")
                    if ftype == f.DATA:
                        self._on_data(flags, sid, payload)
                    elif ftype == f.HEADERS:
                        self._on_headers(flags, sid, payload)
                    else:
                        handler = self._handlers.get(ftype)
                        if handler is not None:  # unknown frame types are ignored (§5.5)
                            handler(self, flags, sid, payload)
                except f.H2StreamError as exc:
                    self._reset(exc.stream_id, exc.code)
                    self._count_reset()
                if self.closed:
                    return
        except f.H2ConnectionError as exc:
            self.fail(exc.code, str(exc))
        except Exception as exc:  # a bug must cost this connection only
            log.exception("gRPC connection %s: unexpected error", self.peer)
            self.fail(f.INTERNAL_ERROR, f"internal error: {type(exc).__name__}")
        finally:
            self._out = None
            if out and not self.closed and self.transport is not None:
                self.transport.write(b"".join(out))

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        for timer in (self._preface_timer, self._header_timer, self._idle_timer):
            if timer is not None:
                timer.cancel()
        streams = list(self.streams.values())
        self.streams.clear()
        self._blocked.clear()
        for stream in streams:
            if stream.handler is not None:
                stream.handler.on_reset()
        self._wake()
        self._on_close(self)

    # ---- writing ---------------------------------------------------------------------
    def fail(self, code: int, message: str) -> None:
        """A connection error: GOAWAY(code), every call cancelled, the socket closed."""
        if self.closed:
            return
        log.info("gRPC connection %s closed: %s (code %d)", self.peer, message, code)
        out, self._out = self._out, None
        if out and self.transport is not None:
            self.transport.write(b"".join(out))
        self.write(f.goaway(self.last_stream_id, code, message.encode()[:256]))
        transport = self.transport
        if transport is None or not transport.can_write_eof():  # TLS: close at once
            self.close()
            return
        # Lingering close: closing a socket with unread input makes the kernel send a
        # reset, and a reset can destroy the GOAWAY in the client's buffer before it is
        # read. So: FIN after the GOAWAY, discard what still comes, close once the client
        # closes or LINGER seconds have passed.
        transport.write_eof()
        self.closed = True
        streams = list(self.streams.values())
        self.streams.clear()
        for stream in streams:
            if stream.handler is not None:
                stream.handler.on_reset()
        asyncio.get_running_loop().call_later(LINGER, transport.close)
        self._on_close(self)

    def drain(self) -> None:
        """Graceful shutdown: GOAWAY(NO_ERROR), no new streams, close once the last one is
        done."""
        if self.closed or self.draining:
            return
        self.draining = True
        self.write(f.goaway(self.last_stream_id, f.NO_ERROR))
        if not self.streams:
            self.close()

    def _preface_expired(self) -> None:
        self._preface_timer = None
        if not self._got_settings:
            self.fail(f.SETTINGS_TIMEOUT, "no client preface")

    def _header_expired(self) -> None:
        self._header_timer = None
        if self._continuation is not None:
            seconds = self.limits.header_timeout
            self.fail(f.ENHANCE_YOUR_CALM, f"header block not finished within {seconds:g}s")

    def _idle_check(self) -> None:
        """Idle: no stream open now, and none opened since the last check."""
        self._idle_timer = None
        if self.closed:
            return
        if (
            not self.streams
            and not self.orphans
            and self._continuation is None
            and self.last_stream_id == self._idle_mark
        ):
            log.info("gRPC connection %s closed: idle", self.peer)
            self.drain()
            return
        self._idle_mark = self.last_stream_id
        loop = asyncio.get_running_loop()
        self._idle_timer = loop.call_later(self.limits.idle_timeout, self._idle_check)

    def _count_reset(self) -> None:
        if self._resets.exceeds(MAX_RESETS_PER_SECOND):
            raise f.H2ConnectionError(f.ENHANCE_YOUR_CALM, "too many streams reset")

    def reset(self, stream: Stream, code: int) -> None:
        super().reset(stream, code)
        self._count_reset()

    # ---- frames ----------------------------------------------------------------------
    def _on_data(self, flags: int, sid: int, payload: bytes) -> None:
        if sid == 0:
            raise f.H2ConnectionError(f.PROTOCOL_ERROR, "DATA on stream 0")
        n = len(payload)
        self._recv_window -= n
        if self._recv_window < 0:
            raise f.H2ConnectionError(f.FLOW_CONTROL_ERROR, "connection window exceeded")
        self._recv_unacked += n
        if self._recv_unacked >= CONNECTION_WINDOW // 2:
            self.write(f.window_update(0, self._recv_unacked))
            self._recv_window += self._recv_unacked
            self._recv_unacked = 0
        stream = self.streams.get(sid)
        if stream is None:
            if sid > self.last_stream_id:
                raise f.H2ConnectionError(f.PROTOCOL_ERROR, f"DATA on idle stream {sid}")
            return  # a stream we already closed: bytes in flight, ignored (§5.1)
        if stream.remote_closed:
            raise f.H2StreamError(sid, f.STREAM_CLOSED, "DATA after END_STREAM")
        stream.recv_window -= n
        if stream.recv_window < 0:
            raise f.H2StreamError(sid, f.FLOW_CONTROL_ERROR, "stream window exceeded")
        if flags & f.PADDED:
            if n == 0 or payload[0] >= n:
                raise f.H2ConnectionError(f.PROTOCOL_ERROR, "padding exceeds the frame")
            data = payload[1 : n - payload[0]]
            self.consumed(stream, n - len(data))  # padding is never handed on
        else:
            data = payload
        handler = stream.handler
        if data and handler is not None:
            handler.on_data(data)
        if flags & f.END_STREAM and not stream.remote_closed:
            stream.remote_closed = True
            if handler is not None:
                handler.on_end()
            if stream.local_closed:
                self._forget(stream)

    def _on_headers(self, flags: int, sid: int, payload: bytes) -> None:
        if sid == 0:
            raise f.H2ConnectionError(f.PROTOCOL_ERROR, "HEADERS on stream 0")
        if flags & f.PADDED:
            if not payload or payload[0] >= len(payload):
                raise f.H2ConnectionError(f.PROTOCOL_ERROR, "padding exceeds the frame")
            payload = payload[1 : len(payload) - payload[0]]
        if flags & f.PRIORITY_FLAG:  # priority is deprecated (§5.3.2): skipped
            if len(payload) < 5:
                raise f.H2ConnectionError(f.FRAME_SIZE_ERROR, "HEADERS too short for priority")
            payload = payload[5:]
        if len(payload) > MAX_HEADER_BLOCK:
            raise f.H2ConnectionError(f.ENHANCE_YOUR_CALM, "header block too large")
        if flags & f.END_HEADERS:
            self._headers_done(sid, flags, payload)
        else:
            self._continuation = (sid, flags, [payload], len(payload))
            self._empty_fragments = 0 if payload else 1
            self._header_timer = asyncio.get_running_loop().call_later(
                self.limits.header_timeout, self._header_expired
            )

    def _on_continuation(self, flags: int, sid: int, payload: bytes) -> None:
        if self._continuation is None or self._continuation[0] != sid:
            raise f.H2ConnectionError(f.PROTOCOL_ERROR, "unexpected CONTINUATION")
        first, first_flags, parts, size = self._continuation
        if not payload:
            self._empty_fragments += 1
            if self._empty_fragments > MAX_EMPTY_FRAGMENTS:
                raise f.H2ConnectionError(f.ENHANCE_YOUR_CALM, "too many empty CONTINUATION")
        parts.append(payload)
        size += len(payload)
        if size > MAX_HEADER_BLOCK:
            raise f.H2ConnectionError(f.ENHANCE_YOUR_CALM, "header block too large")
        if flags & f.END_HEADERS:
            self._continuation = None
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None
            self._headers_done(sid, first_flags, b"".join(parts))
        else:
            self._continuation = (first, first_flags, parts, size)

    def _headers_done(self, sid: int, flags: int, block: bytes) -> None:
        # Always decode: the table must follow the client's encoder even for a stream we
        # are about to refuse.
        too_large = 0
        try:
            headers = self._decoder.decode(block)
        except HeaderListTooLarge as exc:
            if exc.fatal:  # decoding stopped: the table may be out of step
                raise f.H2ConnectionError(f.ENHANCE_YOUR_CALM, str(exc)) from None
            headers, too_large = (), exc.size
        except HpackError as exc:
            raise f.H2ConnectionError(f.COMPRESSION_ERROR, f"HPACK: {exc}") from None
        end_stream = bool(flags & f.END_STREAM)
        stream = self.streams.get(sid)
        if stream is not None:  # trailers of a request
            if too_large:
                raise f.H2StreamError(sid, f.ENHANCE_YOUR_CALM, "trailers too large")
            if stream.remote_closed:
                raise f.H2StreamError(sid, f.STREAM_CLOSED, "HEADERS after END_STREAM")
            if not end_stream:
                raise f.H2StreamError(sid, f.PROTOCOL_ERROR, "trailers without END_STREAM")
            stream.remote_closed = True
            if stream.handler is not None:
                stream.handler.on_end()
            if stream.local_closed:
                self._forget(stream)
            return
        if sid % 2 == 0:
            raise f.H2ConnectionError(f.PROTOCOL_ERROR, f"client stream id {sid} is even")
        if sid <= self.last_stream_id:
            raise f.H2StreamError(sid, f.STREAM_CLOSED, f"stream {sid} is closed")
        self.last_stream_id = sid
        if self.draining:
            raise f.H2StreamError(sid, f.REFUSED_STREAM, "shutting down")
        if len(self.streams) + self.orphans >= self.limits.max_concurrent:
            raise f.H2StreamError(sid, f.REFUSED_STREAM, "too many concurrent streams")
        stream = Stream(sid, self._peer_window, STREAM_WINDOW)
        stream.remote_closed = end_stream
        self.streams[sid] = stream
        if too_large:
            self.dispatcher.too_large(self, stream, too_large, MAX_HEADER_LIST)
        else:
            self.dispatcher.open(self, stream, headers, end_stream)

    def _on_priority(self, flags: int, sid: int, payload: bytes) -> None:
        if sid == 0:
            raise f.H2ConnectionError(f.PROTOCOL_ERROR, "PRIORITY on stream 0")
        if len(payload) != 5:
            raise f.H2StreamError(sid, f.FRAME_SIZE_ERROR, "PRIORITY of the wrong size")

    def _on_rst_stream(self, flags: int, sid: int, payload: bytes) -> None:
        if sid == 0:
            raise f.H2ConnectionError(f.PROTOCOL_ERROR, "RST_STREAM on stream 0")
        if len(payload) != 4:
            raise f.H2ConnectionError(f.FRAME_SIZE_ERROR, "RST_STREAM of the wrong size")
        stream = self.streams.get(sid)
        if stream is None:
            if sid > self.last_stream_id:
                raise f.H2ConnectionError(f.PROTOCOL_ERROR, f"RST_STREAM on idle stream {sid}")
            return
        stream.local_closed = stream.remote_closed = True
        self._forget(stream)
        if stream.handler is not None:
            stream.handler.on_reset()
        self._count_reset()

    def _on_settings(self, flags: int, sid: int, payload: bytes) -> None:
        if sid != 0:
            raise f.H2ConnectionError(f.PROTOCOL_ERROR, "SETTINGS on a stream")
        if flags & f.ACK:
            if payload:
                raise f.H2ConnectionError(f.FRAME_SIZE_ERROR, "SETTINGS ACK with a payload")
            return
        if len(payload) % 6:
            raise f.H2ConnectionError(f.FRAME_SIZE_ERROR, "SETTINGS of the wrong size")
        if len(payload) > 6 * MAX_SETTINGS_ENTRIES:
            raise f.H2ConnectionError(f.ENHANCE_YOUR_CALM, "too many entries in one SETTINGS")
        if self._settings.exceeds(MAX_SETTINGS_PER_SECOND):
            raise f.H2ConnectionError(f.ENHANCE_YOUR_CALM, "too many SETTINGS frames")
        self._got_settings = True
        window = None
        for key, value in f.parse_settings(payload):
            if key == f.INITIAL_WINDOW_SIZE:
                if value > f.MAX_WINDOW:
                    raise f.H2ConnectionError(f.FLOW_CONTROL_ERROR, "initial window too large")
                window = value  # only the last one counts: applied once, below
            elif key == f.MAX_FRAME_SIZE:
                if not f.DEFAULT_MAX_FRAME <= value <= f.MAX_FRAME_LIMIT:
                    raise f.H2ConnectionError(f.PROTOCOL_ERROR, f"MAX_FRAME_SIZE {value}")
                self.max_frame_out = value
            elif key == f.ENABLE_PUSH and value > 1:
                raise f.H2ConnectionError(f.PROTOCOL_ERROR, f"ENABLE_PUSH {value}")
            # HEADER_TABLE_SIZE: our encoder never indexes, so any size suits it;
            # MAX_CONCURRENT_STREAMS limits streams we open, and we open none.
        if window is not None and window != self._peer_window:
            delta = window - self._peer_window
            self._peer_window = window
            for stream in self.streams.values():
                stream.send_window += delta
                if stream.send_window > f.MAX_WINDOW:
                    raise f.H2ConnectionError(f.FLOW_CONTROL_ERROR, "window overflow")
        self.write_control(f.SETTINGS_ACK)
        self._flush_blocked()

    def _on_push_promise(self, flags: int, sid: int, payload: bytes) -> None:
        raise f.H2ConnectionError(f.PROTOCOL_ERROR, "PUSH_PROMISE from a client")

    def _on_ping(self, flags: int, sid: int, payload: bytes) -> None:
        if sid != 0:
            raise f.H2ConnectionError(f.PROTOCOL_ERROR, "PING on a stream")
        if len(payload) != 8:
            raise f.H2ConnectionError(f.FRAME_SIZE_ERROR, "PING of the wrong size")
        if not flags & f.ACK:
            self.write_control(f.ping_ack(payload))

    def _on_goaway(self, flags: int, sid: int, payload: bytes) -> None:
        if sid != 0:
            raise f.H2ConnectionError(f.PROTOCOL_ERROR, "GOAWAY on a stream")
        if len(payload) < 8:
            raise f.H2ConnectionError(f.FRAME_SIZE_ERROR, "GOAWAY too short")
        # The client opens no more streams: finish the ones it has, then close.
        self.draining = True
        if not self.streams:
            self.close()

    def _on_window_update(self, flags: int, sid: int, payload: bytes) -> None:
        if len(payload) != 4:
            raise f.H2ConnectionError(f.FRAME_SIZE_ERROR, "WINDOW_UPDATE of the wrong size")
        increment = f.read_u32(payload) & 0x7FFFFFFF
        if sid == 0:
            if increment == 0:
                raise f.H2ConnectionError(f.PROTOCOL_ERROR, "WINDOW_UPDATE of 0")
            self._send_window += increment
            if self._send_window > f.MAX_WINDOW:
                raise f.H2ConnectionError(f.FLOW_CONTROL_ERROR, "connection window overflow")
            self._flush_blocked()
            return
        stream = self.streams.get(sid)
        if stream is None:
            if sid > self.last_stream_id:
                raise f.H2ConnectionError(f.PROTOCOL_ERROR, f"WINDOW_UPDATE on idle stream {sid}")
            return
        if increment == 0:
            raise f.H2StreamError(sid, f.PROTOCOL_ERROR, "WINDOW_UPDATE of 0")
        stream.send_window += increment
        if stream.send_window > f.MAX_WINDOW:
            raise f.H2StreamError(sid, f.FLOW_CONTROL_ERROR, "stream window overflow")
        if stream.pending:
            self._flush(stream)

    _handlers: dict[int, Callable[[Any, int, int, bytes], None]] = {
        f.PRIORITY: _on_priority,
        f.RST_STREAM: _on_rst_stream,
        f.SETTINGS: _on_settings,
        f.PUSH_PROMISE: _on_push_promise,
        f.PING: _on_ping,
        f.GOAWAY: _on_goaway,
        f.WINDOW_UPDATE: _on_window_update,
        f.CONTINUATION: _on_continuation,
    }
