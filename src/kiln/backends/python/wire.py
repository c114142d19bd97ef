"""Messages between the server and a Python-backend worker: length-prefixed pickles on a
stream socket.

Why not ``multiprocessing.connection``: docs/design/python-backend-wire.md. One ``send``
per message (header and payload together), one ``recv_into`` a reused buffer for a message
that arrived whole (the usual case: they are small; tensors travel through the arenas), and a
``poll`` only when the caller has a deadline.

A closed peer (the worker exited, or was killed) reads as ``EOFError``.
"""

from __future__ import annotations

import math
import pickle
import select
import socket
import struct
from typing import Any

_HEADER = struct.Struct("!I")  # payload length, network order
_INITIAL_BUFFER = 1 << 16


class Wire:
    """One end of the socket. Not thread-safe: callers that send from several threads hold
    their own lock (the worker's ``Channel`` does)."""

    def __init__(self, sock: socket.socket) -> None:
        sock.setblocking(True)
        self.sock = sock
        self._buffer = bytearray(_INITIAL_BUFFER)
        self._start = 0  # received bytes not consumed yet: _buffer[_start:_end]
        self._end = 0
        self._poller = select.poll()
        self._poller.register(sock, select.POLLIN)

    def send(self, message: Any) -> None:
        payload = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        self.sock.sendall(_HEADER.pack(len(payload)) + payload)

    def poll(self, timeout: float) -> bool:
        """Whether a message (or the peer's end) can be read within ``timeout`` seconds.
        Without a deadline, call ``recv``: it blocks."""
        if self._complete() is not None:
            return True
        if self.sock.fileno() < 0:
            # Closed here (a restart): its number may be another socket's by now.
            raise EOFError("the connection was closed")
        # rounded up: waking a fraction of a millisecond early would report a deadline
        # as missed before it is
        return bool(self._poller.poll(max(0, math.ceil(timeout * 1000))))

    def recv(self) -> Any:
        """The next message, waiting for it; ``EOFError`` when the peer has closed."""
        while True:
            ready, message = self.take()
            if ready:
                return message
            self.fill()

    def take(self) -> tuple[bool, Any]:
        """``(True, message)`` for the next message if all of it is buffered, else
        ``(False, None)``: what an event loop calls after ``fill`` (``recv`` without the
        wait)."""
        size = self._complete()
        if size is None:
            return False, None
        begin = self._start + _HEADER.size
        message = pickle.loads(memoryview(self._buffer)[begin : begin + size])
        self._start = begin + size
        if self._start == self._end:
            self._start = self._end = 0
        return True, message

    @property
    def pending(self) -> int:
        """Bytes received and not yet taken as messages."""
        return self._end - self._start

    def fileno(self) -> int:
        return self.sock.fileno()

    def close(self) -> None:
        if self.sock.fileno() >= 0:
            self._poller.unregister(self.sock)
        self.sock.close()

    def _complete(self) -> int | None:
        """The payload size of the first buffered message if all of it is here."""
        available = self._end - self._start
        if available < _HEADER.size:
            return None
        (size,) = _HEADER.unpack_from(self._buffer, self._start)
        return size if available >= _HEADER.size + size else None

    def fill(self, wait: bool = True) -> bool:
        """Read what the socket has, making room first; ``EOFError`` at the peer's end.

        With ``wait`` it blocks until something comes (an event loop calls it only once the
        socket is readable); without, it returns False at once when nothing has come (a
        busy poll). True when bytes were read."""
        if self._end == len(self._buffer):
            pending = self._end - self._start
            needed = pending + _HEADER.size
            if pending >= _HEADER.size:
                needed = _HEADER.size + _HEADER.unpack_from(self._buffer, self._start)[0]
            if self._start > 0 and needed <= len(self._buffer):
                # slide the partial message to the front
                self._buffer[:pending] = self._buffer[self._start : self._end]
            else:
                grown = bytearray(max(2 * len(self._buffer), needed))
                grown[:pending] = self._buffer[self._start : self._end]
                self._buffer = grown
            self._start, self._end = 0, pending
        try:
            got = self.sock.recv_into(
                memoryview(self._buffer)[self._end :], 0, 0 if wait else socket.MSG_DONTWAIT
            )
        except BlockingIOError:
            return False
        if got == 0:
            raise EOFError("the peer closed the connection")
        self._end += got
        return True
