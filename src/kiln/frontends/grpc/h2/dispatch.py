"""From a new stream's request headers to a running :class:`~.calls.Call`, or to the
answer that refuses it: a malformed request (RST_STREAM), a wrong method or content type
(HTTP 405/415), an unknown method (UNIMPLEMENTED), a caller the access policy turns away
(UNAUTHENTICATED/UNAVAILABLE, Triton's wording), an unknown ``grpc-encoding``.

What the headers decide depends on the headers alone, and a client sends the same ones
for every call to a method (HPACK even hands back the same tuple), so each distinct
header list is examined once and the outcome remembered.
"""

from __future__ import annotations

from dataclasses import dataclass

from kiln.core.access import AccessPolicy
from kiln.frontends.grpc.h2 import rpc
from kiln.frontends.grpc.h2.calls import Call, Route
from kiln.frontends.grpc.h2.connection import MAX_HEADER_LIST, Connection
from kiln.frontends.grpc.h2.frames import PROTOCOL_ERROR
from kiln.frontends.grpc.h2.hpack import Header, literal
from kiln.frontends.grpc.h2.streams import Stream

_CONNECTION_HEADERS = frozenset(
    (b"connection", b"keep-alive", b"proxy-connection", b"transfer-encoding", b"upgrade")
)
_ENCODINGS = frozenset((b"identity", b"gzip", b"deflate"))
_HEAD_CACHE_SIZE = 256
# Header lists larger than this are examined each time rather than kept (a client could
# otherwise park 256 x 64 KiB of its own headers in the server).
_HEAD_CACHE_MAX_LIST = 4096


@dataclass(frozen=True, slots=True)
class Head:
    """What a request's headers decide."""

    route: Route | None = None
    refusal: bytes | None = None  # a header block that answers at once (END_STREAM)
    malformed: bool = False  # RST_STREAM(PROTOCOL_ERROR)
    timeout: float | None = None
    encoding: bytes | None = None


_MALFORMED = Head(malformed=True)


def _refusal(code: int, message: str) -> Head:
    return Head(refusal=rpc.status_block(code, message, trailers_only=True))


class Dispatcher:
    def __init__(
        self, routes: list[Route], max_message_bytes: int, access: AccessPolicy | None = None
    ) -> None:
        self.routes = {route.path: route for route in routes}
        self.max_message_bytes = max_message_bytes
        self.access = access if access is not None and access.enabled else None
        self.calls: set[Call] = set()  # calls whose task runs, for shutdown
        self._heads: dict[tuple[Header, ...], Head] = {}

    def open(
        self, conn: Connection, stream: Stream, headers: tuple[Header, ...], end_stream: bool
    ) -> None:
        head = self._heads.get(headers)
        if head is None:
            head = self.examine(headers)
            if sum(len(k) + len(v) for k, v in headers) <= _HEAD_CACHE_MAX_LIST:
                if len(self._heads) >= _HEAD_CACHE_SIZE:
                    self._heads.clear()
                self._heads[headers] = head
        route = head.route
        if route is None:
            if head.malformed:
                conn.reset(stream, PROTOCOL_ERROR)
            else:
                assert head.refusal is not None
                conn.send_headers(stream, head.refusal, end_stream=True)
            return
        call = Call(conn, stream, route, headers, head.encoding, self.max_message_bytes, self.calls)
        stream.handler = call
        if head.timeout is not None:
            call.set_deadline(head.timeout)
        if route.client_streaming:
            call.start()
        if end_stream:
            call.on_end()

    def too_large(self, conn: Connection, stream: Stream, size: int, limit: int) -> None:
        message = f"header list of {size} bytes exceeds the limit of {limit}"
        block = rpc.status_block(rpc.RESOURCE_EXHAUSTED, message, trailers_only=True)
        conn.send_headers(stream, block, end_stream=True)

    def examine(self, headers: tuple[Header, ...]) -> Head:
        method = path = timeout = encoding = None
        content_type = b""
        regular = False
        size = 0
        for name, value in headers:
            size += len(name) + len(value) + 32  # RFC 9113 §6.5.2's accounting
            if name[:1] == b":":
                if regular:  # a pseudo-header after a regular field (RFC 9113 §8.3)
                    return _MALFORMED
                if name == b":path":
                    path = value
                elif name == b":method":
                    method = value
                elif name not in (b":scheme", b":authority"):
                    return _MALFORMED
                continue
            regular = True
            if name == b"content-type":
                content_type = value
            elif name == b"grpc-timeout":
                timeout = value
            elif name == b"grpc-encoding":
                encoding = value
            elif name in _CONNECTION_HEADERS or name != name.lower():
                return _MALFORMED  # §8.2.2, §8.2
            elif name == b"te" and value != b"trailers":
                return _MALFORMED
        if not path:
            return _MALFORMED
        if size > MAX_HEADER_LIST:
            return _refusal(
                rpc.RESOURCE_EXHAUSTED,
                f"header list of {size} bytes exceeds the limit of {MAX_HEADER_LIST}",
            )
        if method != b"POST":
            return Head(refusal=literal(b":status", b"405"))
        if not content_type.startswith(b"application/grpc"):
            return Head(refusal=literal(b":status", b"415"))
        route = self.routes.get(path)
        if route is None:
            return _refusal(rpc.UNIMPLEMENTED, f"Method not found: {path.decode('latin-1')}")
        if self.access is not None:
            metadata = {
                k.decode("latin-1"): v.decode("latin-1")
                for k, v in headers
                if k[:1] != b":" and not k.endswith(b"-bin")  # -bin never carries keys
            }
            denial = self.access.check(route.group, metadata.get)
            if denial is not None:
                code = rpc.UNAUTHENTICATED if denial.kind == "unauthenticated" else rpc.UNAVAILABLE
                return _refusal(code, denial.message)
        if encoding is not None and encoding not in _ENCODINGS:
            unknown = encoding.decode("latin-1")
            return _refusal(
                rpc.UNIMPLEMENTED, f"Compression algorithm '{unknown}' is not supported"
            )
        seconds = rpc.parse_timeout(timeout) if timeout is not None else None
        return Head(route=route, timeout=seconds, encoding=encoding)
