"""The timed data path: one keep-alive HTTP/1.1 connection or one gRPC channel per slot.

HTTP uses an ``asyncio.Protocol`` fed to ``httptools``' response parser (already a kiln
dependency through uvicorn) rather than a client library: the request bytes are built once
and a response costs one parser callback, which keeps the generator's own CPU per request
low on a machine it shares with the server. gRPC sends pre-serialised ``ModelInferRequest``
bytes with no (de)serialiser, and the response bytes are not decoded.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence
from typing import Any

import grpc
import httptools
import orjson

from kiln.frontends.grpc import grpc_service_pb2 as pb

MODEL_INFER = "/inference.GRPCInferenceService/ModelInfer"
MODEL_STREAM_INFER = "/inference.GRPCInferenceService/ModelStreamInfer"


class RequestError(Exception):
    """One request failed (HTTP status != 200, gRPC status != OK, timeout, connection lost)."""


def host_port(url: str, default_port: int) -> tuple[str, int]:
    """``host:port`` from ``URL`` (a scheme and a trailing path are tolerated)."""
    rest = url.split("://", 1)[-1].split("/", 1)[0]
    host, sep, port = rest.rpartition(":")
    if not sep or not port.isdigit():
        return rest or "localhost", default_port
    return host.strip("[]") or "localhost", int(port)


def http_request(method: str, host: str, path: str, body: bytes, headers: dict[str, str]) -> bytes:
    lines = [f"{method} {path} HTTP/1.1", f"Host: {host}", f"Content-Length: {len(body)}"]
    lines += [f"{k}: {v}" for k, v in headers.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


class _Protocol(asyncio.Protocol):
    """Parses responses as they arrive and completes the one outstanding request's future."""

    def __init__(self) -> None:
        self.parser = httptools.HttpResponseParser(self)
        self.transport: Any = None  # uvloop's transports do not subclass asyncio.Transport
        self.waiter: asyncio.Future[tuple[int, bytes]] | None = None
        self.parts: list[bytes] = []
        self.lost = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(RequestError(f"malformed HTTP response: {exc}"))
            if self.transport is not None:
                self.transport.close()

    def on_body(self, body: bytes) -> None:
        self.parts.append(body)

    def on_message_complete(self) -> None:
        body, self.parts = b"".join(self.parts), []
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result((self.parser.get_status_code(), body))

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        self._fail(RequestError(f"connection closed by the server ({exc or 'EOF'})"))

    def _fail(self, exc: Exception) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_exception(exc)


class HttpConnection:
    """One keep-alive connection; reconnects when the server closed it between requests."""

    def __init__(self, host: str, port: int, timeout_s: float) -> None:
        self.host, self.port, self.timeout_s = host, port, timeout_s
        self._protocol: _Protocol | None = None

    async def connect(self) -> None:
        loop = asyncio.get_running_loop()
        _, protocol = await loop.create_connection(_Protocol, self.host, self.port)
        self._protocol = protocol

    async def send(self, request: bytes) -> tuple[int, bytes]:
        """Send pre-built request bytes; the response's status and body."""
        if self._protocol is None or self._protocol.lost:
            await self.connect()
        protocol = self._protocol
        assert protocol is not None and protocol.transport is not None
        protocol.waiter = asyncio.get_running_loop().create_future()
        protocol.transport.write(request)
        try:
            async with asyncio.timeout(self.timeout_s):
                return await protocol.waiter
        except TimeoutError:
            protocol.transport.close()  # the late response must not answer the next request
            self._protocol = None
            raise RequestError(f"no response within {self.timeout_s:g} s") from None

    def close(self) -> None:
        if self._protocol is not None and self._protocol.transport is not None:
            self._protocol.transport.close()


def error_text(status: int, body: bytes) -> str:
    """The server's ``{"error": ...}`` message when there is one, else the raw start of it."""
    try:
        doc: Any = orjson.loads(body)
        if isinstance(doc, dict) and "error" in doc:
            return f"HTTP {status}: {doc['error']}"
    except orjson.JSONDecodeError:
        pass
    return f"HTTP {status}: {body[:300].decode('utf-8', 'replace')}"


class HttpSlot:
    """A worker's connection plus the pre-built requests it cycles through."""

    def __init__(self, connection: HttpConnection, requests: Sequence[bytes]) -> None:
        self.connection, self.requests, self.next = connection, requests, 0

    async def infer(self) -> int | None:
        request = self.requests[self.next]
        self.next = (self.next + 1) % len(self.requests)
        status, body = await self.connection.send(request)
        if status != 200:
            raise RequestError(error_text(status, body))
        return None  # one response: nothing to count

    async def close(self) -> None:
        self.connection.close()


class GrpcSlot:
    """A worker's channel; requests are serialised ``ModelInferRequest`` bytes."""

    def __init__(
        self,
        target: str,
        requests: Sequence[bytes],
        timeout_s: float,
        metadata: tuple[tuple[str, str], ...] | None = None,
    ) -> None:
        self.channel = grpc.aio.insecure_channel(target)
        self.call = self.channel.unary_unary(MODEL_INFER)
        self.requests, self.next, self.timeout_s = requests, 0, timeout_s
        self.metadata = metadata

    async def infer(self) -> int | None:
        request = self.requests[self.next]
        self.next = (self.next + 1) % len(self.requests)
        try:
            await self.call(request, timeout=self.timeout_s, metadata=self.metadata)
        except grpc.aio.AioRpcError as exc:
            raise RequestError(f"gRPC {exc.code().name}: {exc.details()}") from None
        return None  # one response: nothing to count

    async def close(self) -> None:
        await self.channel.close()


class GrpcStreamSlot(GrpcSlot):
    """A worker's ``ModelStreamInfer`` stream (perf_analyzer's ``--streaming``): each
    request is written to the stream and answered once its final response has come, so a
    decoupled model's 0..N responses count as one request. Requests carry
    ``triton_enable_empty_final_response`` (``stream_request`` adds it), so the end is marked
    even when the model sends its FINAL flag alone; a response without
    ``triton_final_response`` (a model that is not decoupled) is final. Responses are
    decoded only for that flag and an error."""

    stream: Any = None  # the call, opened by the first request
    responses = 0  # over the slot's life, final ones included

    async def infer(self) -> int:
        """The request's responses that carried outputs (the FINAL marker alone does not
        count)."""
        if self.stream is None:
            self.stream = self.channel.stream_stream(MODEL_STREAM_INFER)(metadata=self.metadata)
        request = self.requests[self.next]
        self.next = (self.next + 1) % len(self.requests)
        try:
            await self.stream.write(request)
            answered = 0
            while True:
                raw = await asyncio.wait_for(self.stream.read(), self.timeout_s)
                if raw is grpc.aio.EOF:
                    raise RequestError("gRPC stream closed by the server")
                self.responses += 1
                response = pb.ModelStreamInferResponse.FromString(raw)
                if response.error_message:
                    raise RequestError(f"gRPC stream error: {response.error_message}")
                answered += bool(response.infer_response.outputs)
                final = response.infer_response.parameters.get("triton_final_response")
                if final is None or final.bool_param:
                    return answered
        except TimeoutError:
            self._reset()
            raise RequestError(f"no final response within {self.timeout_s:g} s") from None
        except grpc.aio.AioRpcError as exc:
            self._reset()
            raise RequestError(f"gRPC {exc.code().name}: {exc.details()}") from None

    def _reset(self) -> None:
        """A stream in an unknown state (a late response would answer the next request):
        the next request opens a new one."""
        if self.stream is not None:
            self.stream.cancel()
            self.stream = None

    async def close(self) -> None:
        if self.stream is not None:
            with contextlib.suppress(grpc.aio.AioRpcError, grpc.aio.UsageError):
                await self.stream.done_writing()
            self.stream.cancel()
        await super().close()
