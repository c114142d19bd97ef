"""One HTTP/2 stream's state as the connection sees it (RFC 9113 §5.1, §5.2), and what a
gRPC call needs of a stream. The call layer behind it implements :class:`StreamHandler`.
"""

from __future__ import annotations

from collections import deque
from typing import Any, Protocol

from kiln.frontends.grpc.h2.hpack import Header


class StreamHandler(Protocol):
    """What the connection tells the layer above about one stream."""

    def on_data(self, data: bytes) -> None:
        """Request bytes (padding removed); the handler credits them back with
        ``Connection.consumed`` once it has taken them."""

    def on_end(self) -> None:
        """The client half-closed the stream (END_STREAM)."""

    def on_reset(self) -> None:
        """The stream is gone: RST_STREAM from the client, or the connection closed."""


class Dispatcher(Protocol):
    def open(
        self, conn: Any, stream: Stream, headers: tuple[Header, ...], end_stream: bool
    ) -> None:
        """A new request: set ``stream.handler``, or answer at once."""

    def too_large(self, conn: Any, stream: Stream, size: int, limit: int) -> None:
        """A new request whose header list exceeds ``limit``: answer at once."""


class Stream:
    __slots__ = (
        "handler", "id", "local_closed", "pending", "recv_unacked",
        "recv_window", "remote_closed", "send_window", "trailers",
    )  # fmt: skip

    def __init__(self, stream_id: int, send_window: int, recv_window: int) -> None:
        self.id = stream_id
        self.handler: StreamHandler | None = None
        # what the peer lets us send (its SETTINGS_INITIAL_WINDOW_SIZE + its updates);
        # may go negative when the peer lowers its initial window (§6.9.2)
        self.send_window = send_window
        # what we let the peer send before our next WINDOW_UPDATE
        self.recv_window = recv_window
        self.recv_unacked = 0  # consumed bytes not yet given back to the peer
        # DATA payload waiting for flow-control credit, and the trailers to send after it
        self.pending: deque[memoryview] = deque()
        self.trailers: bytes | None = None
        self.remote_closed = False  # END_STREAM received
        self.local_closed = False  # END_STREAM sent
