"""A raw HTTP/2 client over a blocking socket, for tests that must send what no real client
sends (protocol errors, mutated frames) or watch frames a real client hides (flow control,
GOAWAY codes), and an in-process gRPC server with test routes for them."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from kiln.core.access import AccessPolicy, ApiGroup
from kiln.frontends.grpc.h2 import frames as f
from kiln.frontends.grpc.h2 import rpc
from kiln.frontends.grpc.h2.calls import Route
from kiln.frontends.grpc.h2.connection import Limits
from kiln.frontends.grpc.h2.dispatch import Dispatcher
from kiln.frontends.grpc.h2.hpack import Decoder, Header, encode
from kiln.frontends.grpc.h2.transport import H2GrpcServer

SERVER_LIVE = "/inference.GRPCInferenceService/ServerLive"


def request_headers(path: str, *extra: Header) -> list[Header]:
    return [
        (b":method", b"POST"),
        (b":scheme", b"http"),
        (b":path", path.encode()),
        (b":authority", b"localhost"),
        (b"content-type", b"application/grpc"),
        (b"te", b"trailers"),
        *extra,
    ]


def message(body: bytes, compressed: bool = False) -> bytes:
    return rpc.prefix(len(body), compressed) + body


@dataclass
class Response:
    headers: list[Header] = field(default_factory=list)
    data: bytes = b""
    trailers: list[Header] = field(default_factory=list)
    reset: int | None = None  # RST_STREAM code

    def header(self, name: str) -> str | None:
        for k, v in (*self.headers, *self.trailers):
            if k == name.encode():
                return v.decode()
        return None

    @property
    def status(self) -> int | None:
        value = self.header("grpc-status")
        return None if value is None else int(value)

    @property
    def message(self) -> str:
        value = self.header("grpc-message")
        return "" if value is None else rpc.percent_decode(value.encode())


class RawH2:
    """``settings``: our SETTINGS; ``preface=False`` sends nothing on connect;
    ``rcvbuf``: a small receive buffer, for a client that does not read."""

    def __init__(
        self,
        port: int,
        settings: dict[int, int] | None = None,
        preface: bool = True,
        rcvbuf: int | None = None,
    ) -> None:
        if rcvbuf is None:
            self.sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        else:  # set before connecting: the window the kernel offers follows it
            self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
            self.sock.settimeout(10)
            self.sock.connect(("127.0.0.1", port))
        self.reader = f.FrameReader(f.MAX_FRAME_LIMIT, preface=False)
        self.decoder = Decoder()
        self.pending: list[f.Frame] = []
        self.closed = False
        self.server_settings: dict[int, int] = {}
        self.ack = preface  # acknowledge the server's SETTINGS (not before our preface)
        if preface:
            self.send(f.PREFACE + f.settings_frame(settings or {}))

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def frame(self, ftype: int, flags: int, sid: int, payload: bytes = b"") -> None:
        self.send(f.frame(ftype, flags, sid, payload))

    def headers(self, sid: int, headers: list[Header], end_stream: bool = False) -> None:
        flags = f.END_HEADERS | (f.END_STREAM if end_stream else 0)
        self.frame(f.HEADERS, flags, sid, encode(headers))

    def data(self, sid: int, data: bytes, end_stream: bool = False) -> None:
        self.frame(f.DATA, f.END_STREAM if end_stream else 0, sid, data)

    def unary(self, sid: int, path: str, body: bytes = b"", *extra: Header) -> None:
        self.headers(sid, request_headers(path, *extra))
        self.data(sid, message(body), end_stream=True)

    def read_frame(self, timeout: float = 10.0) -> f.Frame | None:
        """The next frame (PINGs answered, SETTINGS acknowledged); None once closed."""
        deadline = time.monotonic() + timeout
        while not self.pending:
            if self.closed:
                return None
            self.sock.settimeout(max(deadline - time.monotonic(), 0.01))
            try:
                chunk = self.sock.recv(1 << 20)
            except TimeoutError:
                raise TimeoutError("no frame from the server") from None
            except ConnectionResetError:
                chunk = b""
            if not chunk:
                self.closed = True
                return None
            self.pending.extend(self.reader.feed(chunk))
        frame = self.pending.pop(0)
        ftype, flags, _, payload = frame
        if ftype == f.SETTINGS and not flags & f.ACK:
            self.server_settings.update(f.parse_settings(payload))
            if self.ack:
                with contextlib.suppress(OSError):  # closed: what it sent can still be read
                    self.send(f.SETTINGS_ACK)
        return frame

    def frames(self, timeout: float = 10.0) -> Iterator[f.Frame]:
        while (frame := self.read_frame(timeout)) is not None:
            yield frame

    def goaway(self, timeout: float = 10.0) -> tuple[int, int]:
        """Frames until GOAWAY: its (last stream id, error code). Fails if the connection
        closes without one."""
        for ftype, _, _, payload in self.frames(timeout):
            if ftype == f.GOAWAY:
                last, code, _ = f.parse_goaway(payload)
                return last, code
        raise AssertionError("connection closed without GOAWAY")

    def response(self, sid: int, timeout: float = 10.0) -> Response:
        """Everything on stream ``sid`` until it ends (END_STREAM or RST_STREAM)."""
        out = Response()
        seen_headers = False
        for ftype, flags, fsid, payload in self.frames(timeout):
            if fsid != sid:
                if ftype == f.HEADERS:  # keep the HPACK table in step
                    self.decoder.decode(payload)
                continue
            if ftype == f.HEADERS:
                block = list(self.decoder.decode(payload))
                if seen_headers:
                    out.trailers = block
                else:
                    out.headers = block
                    seen_headers = True
            elif ftype == f.DATA:
                out.data += payload
            elif ftype == f.RST_STREAM:
                out.reset = f.read_u32(payload)
                return out
            if flags & f.END_STREAM and ftype in (f.HEADERS, f.DATA):
                return out
        raise AssertionError(f"connection closed before stream {sid} ended")

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> RawH2:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ---- an in-process server with test routes ---------------------------------------------
@dataclass
class Observed:
    """What the test handlers saw, for the tests to check."""

    cancelled: list[str] = field(default_factory=list)
    started: threading.Event = field(default_factory=threading.Event)
    metadata: list[tuple[tuple[str, str | bytes], ...]] = field(default_factory=list)
    # Stubborn handlers, once cancelled, keep running until this is set (on the loop)
    release: asyncio.Event = field(default_factory=asyncio.Event)
    running: list[str] = field(default_factory=list)  # Stubborn handlers not yet ended


def make_routes(seen: Observed) -> list[Route]:
    async def echo(request: bytes, context: Any) -> bytes:
        seen.metadata.append(context.invocation_metadata())
        return request

    async def big(request: bytes, context: Any) -> bytes:
        return b"x" * int(request)

    async def sleep(request: bytes, context: Any) -> bytes:
        seen.started.set()
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            seen.cancelled.append("sleep")
            raise
        return b""

    async def stubborn(request: bytes, context: Any) -> bytes:
        """A handler whose cancellation takes until ``seen.release`` (a model call that
        cannot be interrupted)."""
        seen.running.append("stubborn")
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            await seen.release.wait()
            raise
        finally:
            seen.running.remove("stubborn")
        return b""

    async def fail(request: bytes, context: Any) -> bytes:
        raise ValueError("broken handler")

    async def abort(request: bytes, context: Any) -> bytes:
        await context.abort(5, request.decode())
        return b""

    async def stream(requests: Any, context: Any) -> Any:
        async for request in requests:
            yield request

    async def stall(requests: Any, context: Any) -> Any:
        seen.started.set()
        await asyncio.sleep(3600)
        yield b""

    def route(name: str, handler: Callable[..., Any], streaming: bool = False) -> Route:
        return Route(
            f"/t/{name}".encode(),
            handler,
            bytes,
            bytes,
            streaming,
            streaming,
            ApiGroup.INFERENCE,
        )

    return [
        route("Echo", echo),
        route("Big", big),
        route("Sleep", sleep),
        route("Stubborn", stubborn),
        route("Fail", fail),
        route("Abort", abort),
        route("Stream", stream, True),
        route("Stall", stall, True),
    ]


@dataclass
class InProcessServer:
    port: int
    seen: Observed
    server: H2GrpcServer
    loop: asyncio.AbstractEventLoop

    def call(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` on the server's loop and return its result."""

        async def run() -> Any:
            return fn()

        return asyncio.run_coroutine_threadsafe(run(), self.loop).result(10)


@contextmanager
def in_process_server(
    max_message_bytes: int = 2**31 - 1,
    access: AccessPolicy | None = None,
    limits: Limits | None = None,
) -> Iterator[InProcessServer]:
    """The test routes on kiln's gRPC server, its event loop on a thread of its own."""
    import uvloop

    seen = Observed()
    loop = uvloop.new_event_loop()
    started = threading.Event()
    holder: dict[str, Any] = {}

    async def main() -> None:
        dispatcher = Dispatcher(make_routes(seen), max_message_bytes, access)
        server = H2GrpcServer(dispatcher, limits=limits)
        await server.start("127.0.0.1", 0)
        holder["server"] = server
        started.set()
        holder["stop"] = stop = asyncio.Event()
        await stop.wait()
        await server.stop(0)

    thread = threading.Thread(target=loop.run_until_complete, args=(main(),), daemon=True)
    thread.start()
    assert started.wait(10)
    server = holder["server"]
    try:
        yield InProcessServer(server.sockets[0][1], seen, server, loop)
    finally:
        loop.call_soon_threadsafe(holder["stop"].set)
        thread.join(10)
        loop.close()
