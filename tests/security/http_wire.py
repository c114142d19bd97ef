"""Raw-socket HTTP/1.1 for the security tests: nothing a client library smooths over."""

from __future__ import annotations

import json
import socket


def body_for(a: int, b: int) -> bytes:
    """An inference request body for the example model ``simple``."""
    return json.dumps(
        {
            "inputs": [
                {"name": "INPUT0", "shape": [1, 16], "datatype": "INT32", "data": [a] * 16},
                {"name": "INPUT1", "shape": [1, 16], "datatype": "INT32", "data": [b] * 16},
            ],
            "outputs": [{"name": "OUTPUT0"}],
        }
    ).encode()


def post(path: str, body: bytes, extra: str = "", length: int | None = None) -> bytes:
    """A POST with ``body``; ``length``: the Content-Length to declare (``len(body)``)."""
    size = len(body) if length is None else length
    head = (
        f"POST {path} HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
        f"Content-Length: {size}\r\n{extra}\r\n"
    )
    return head.encode() + body


class Reader:
    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buf = b""

    def _fill(self) -> bool:
        chunk = self.sock.recv(65536)
        self.buf += chunk
        return bool(chunk)

    def response(self) -> tuple[int, dict[str, str], bytes]:
        while b"\r\n\r\n" not in self.buf:
            assert self._fill(), f"connection closed mid-response: {self.buf!r}"
        head, self.buf = self.buf.split(b"\r\n\r\n", 1)
        lines = head.decode("latin-1").split("\r\n")
        status = int(lines[0].split()[1])
        headers = {k.lower(): v.strip() for k, v in (x.split(":", 1) for x in lines[1:])}
        length = int(headers.get("content-length", "0"))
        while len(self.buf) < length:
            assert self._fill(), "connection closed mid-body"
        body, self.buf = self.buf[:length], self.buf[length:]
        return status, headers, body

    def closed(self) -> bool:
        """Whether the server closed the connection (a reset counts as closed)."""
        try:
            return not self.buf and not self._fill()
        except ConnectionResetError:
            return True


def connect(port: int) -> tuple[socket.socket, Reader]:
    sock = socket.create_connection(("127.0.0.1", port), timeout=20)
    return sock, Reader(sock)


def send_until_answered(sock: socket.socket, data: bytes, piece: int = 16384) -> None:
    """Send ``data`` in pieces, stopping early once the server has answered or closed
    (what a client that reads while it writes would do)."""
    import select

    for start in range(0, len(data), piece):
        if select.select([sock], [], [], 0)[0]:
            return  # an answer (or the close) is waiting
        try:
            sock.sendall(data[start : start + piece])
        except (BrokenPipeError, ConnectionResetError):
            return
