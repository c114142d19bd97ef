"""The send side of an HTTP/2 connection: writes batched while a read is processed, and
DATA that never exceeds the peer's connection and stream windows nor its MAX_FRAME_SIZE.
What does not fit waits in its stream until WINDOW_UPDATE (or a larger
SETTINGS_INITIAL_WINDOW_SIZE) gives credit, and the stream's trailers wait behind it.
Also the stream bookkeeping both sides share: a stream is forgotten once both ends are
closed.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from kiln.frontends.grpc.h2 import frames as f
from kiln.frontends.grpc.h2.streams import Stream

log = logging.getLogger(__name__)

# What we advertise. Windows are large because tensors are: a 64 MiB request moves in
# 4 MiB steps per stream without waiting on us in between.
STREAM_WINDOW = 4 * 2**20
CONNECTION_WINDOW = 16 * 2**20
# Control frames a client makes us send (PING and SETTINGS acknowledgements, RST_STREAM
# answers) that may wait behind a paused socket: a client that sends them without reading
# ours would otherwise grow our buffer without end. Beyond this the connection is dropped
# (nghttp2's and Go's limit).
MAX_QUEUED_CONTROL = 10_000


class Sender(asyncio.Protocol):
    def __init__(self, on_close: Callable[[Any], None]) -> None:
        self._on_close = on_close
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.draining = False
        self.streams: dict[int, Stream] = {}
        self.max_frame_out = f.DEFAULT_MAX_FRAME  # the peer's SETTINGS_MAX_FRAME_SIZE
        self._send_window = f.DEFAULT_WINDOW  # the peer's connection window for us
        self._blocked: dict[int, Stream] = {}  # streams with DATA waiting for credit
        self._out: list[bytes] | None = None  # batches writes made while reading
        self._paused = False
        self._waiters: list[asyncio.Future[None]] = []
        self._queued_control = 0  # control frames written while the socket is paused

    def pause_writing(self) -> None:
        self._paused = True

    def resume_writing(self) -> None:
        self._paused = False
        self._queued_control = 0  # below the low-water mark: they have gone out
        self._wake()

    def write_control(self, data: bytes) -> None:
        """A frame the peer induced: counted while the socket is paused."""
        if self._paused:
            self._queued_control += 1
            if self._queued_control > MAX_QUEUED_CONTROL:
                self.abort("too many control frames queued for a client that does not read")
                return
        self.write(data)

    def abort(self, message: str) -> None:
        """Drop the connection and what is buffered for it: a GOAWAY would only wait
        behind the rest for a client that does not read."""
        if self.closed or self.transport is None:
            return
        log.info("gRPC connection closed: %s", message)
        self.closed = True
        self._out = None
        self.transport.abort()  # connection_lost cancels the calls

    def write(self, data: bytes) -> None:
        if self._out is not None:
            self._out.append(data)
        elif not self.closed and self.transport is not None:
            self.transport.write(data)

    def close(self) -> None:
        if self.transport is not None and not self.closed:
            self.closed = True
            self.transport.close()
            # Done as far as the server is concerned: a TLS transport may still wait for
            # the peer's close_notify (gRPC clients often never send one), which must not
            # hold up a shutdown.
            self._on_close(self)

    def _wake(self) -> None:
        waiters, self._waiters = self._waiters, []
        for fut in waiters:
            if not fut.done():
                fut.set_result(None)

    async def writable(self, stream: Stream) -> None:
        """Until ``stream`` has no DATA waiting and the socket takes writes again: how a
        streaming response keeps pace with its client."""
        while (stream.pending or self._paused) and not self.closed and not stream.local_closed:
            fut = asyncio.get_running_loop().create_future()
            self._waiters.append(fut)
            await fut

    # ---- what the call layer sends ---------------------------------------------------
    def send_headers(self, stream: Stream, block: bytes, end_stream: bool = False) -> None:
        self.write(f.headers_frames(stream.id, block, end_stream, self.max_frame_out))
        if end_stream:
            self._closed_local(stream)

    def send_data(self, stream: Stream, data: bytes, head: bytes | None = None) -> None:
        """One DATA payload, sent now if the windows allow, else queued in order.
        ``head``: a header block to send first (in the same write when the data fits)."""
        n = len(data)
        if (
            not stream.pending
            and n <= self._send_window
            and n <= stream.send_window
            and n <= self.max_frame_out
        ):
            self._send_window -= n
            stream.send_window -= n
            frame = f.frame_head(f.DATA, 0, stream.id, n) + data
            if head is not None:
                frame = f.headers_frames(stream.id, head, False, self.max_frame_out) + frame
            self.write(frame)
            return
        if head is not None:
            self.send_headers(stream, head)
        stream.pending.append(memoryview(data))
        self._flush(stream)

    def send_trailers(self, stream: Stream, block: bytes) -> None:
        """The trailers (END_STREAM), after any DATA still waiting for credit."""
        if stream.local_closed:
            return
        if stream.pending:
            stream.trailers = block
        else:
            self.send_headers(stream, block, end_stream=True)

    def send_response(self, stream: Stream, head: bytes, data: bytes, trailers: bytes) -> None:
        """A whole unary response (HEADERS, DATA, trailers) in one write when the data fits
        the windows."""
        n = len(data)
        if n <= self._send_window and n <= stream.send_window:
            sid = stream.id
            size = self.max_frame_out
            self._send_window -= n
            stream.send_window -= n
            out: list[bytes | memoryview] = [f.headers_frames(sid, head, False, size)]
            if n <= size:
                out += (f.frame_head(f.DATA, 0, sid, n), data)
            else:
                view = memoryview(data)
                for i in range(0, n, size):
                    piece = view[i : i + size]
                    out += (f.frame_head(f.DATA, 0, sid, len(piece)), piece)
            out.append(f.headers_frames(sid, trailers, True, size))
            self.write(b"".join(out))
            self._closed_local(stream)
            return
        self.send_headers(stream, head)
        self.send_data(stream, data)
        self.send_trailers(stream, trailers)

    def reset(self, stream: Stream, code: int) -> None:
        """RST_STREAM from our side for a malformed request; the handler is not called
        back."""
        self.write_control(f.rst_stream(stream.id, code))
        stream.local_closed = stream.remote_closed = True
        self._forget(stream)

    def consumed(self, stream: Stream, n: int) -> None:
        """The call took ``n`` bytes of the stream's DATA: credit them back to the peer."""
        if stream.remote_closed or n <= 0:
            return
        stream.recv_unacked += n
        if stream.recv_unacked >= STREAM_WINDOW // 2:
            self.write(f.window_update(stream.id, stream.recv_unacked))
            stream.recv_window += stream.recv_unacked
            stream.recv_unacked = 0

    def _closed_local(self, stream: Stream) -> None:
        stream.local_closed = True
        if not stream.remote_closed:
            # the answer is complete before the request: ask the client to stop sending
            # (§8.1), which is how gRPC servers end a call early
            self.write_control(f.rst_stream(stream.id, f.NO_ERROR))
            stream.remote_closed = True
        self._forget(stream)

    def _forget(self, stream: Stream) -> None:
        self.streams.pop(stream.id, None)
        self._blocked.pop(stream.id, None)
        if stream.pending:
            stream.pending.clear()
            self._wake()
        if self.draining and not self.streams:
            self.close()

    def _flush(self, stream: Stream) -> None:
        pending = stream.pending
        out: list[bytes | memoryview] = []
        sid = stream.id
        while pending:
            allowed = min(self._send_window, stream.send_window, self.max_frame_out)
            if allowed <= 0:
                break
            chunk = pending[0]
            if len(chunk) <= allowed:
                pending.popleft()
                piece = chunk
            else:
                piece = chunk[:allowed]
                pending[0] = chunk[allowed:]
            n = len(piece)
            self._send_window -= n
            stream.send_window -= n
            out.append(f.frame_head(f.DATA, 0, sid, n))
            out.append(piece)
        if out:
            self.write(b"".join(out))
        if pending:
            self._blocked[sid] = stream
            return
        self._blocked.pop(sid, None)
        self._wake()
        if stream.trailers is not None:
            block, stream.trailers = stream.trailers, None
            self.send_headers(stream, block, end_stream=True)

    def _flush_blocked(self) -> None:
        for stream in list(self._blocked.values()):
            if self._send_window <= 0:
                return
            self._flush(stream)

    def _reset(self, stream_id: int, code: int) -> None:
        self.write_control(f.rst_stream(stream_id, code))
        stream = self.streams.get(stream_id)
        if stream is not None:
            stream.local_closed = stream.remote_closed = True
            self._forget(stream)
            if stream.handler is not None:
                stream.handler.on_reset()
