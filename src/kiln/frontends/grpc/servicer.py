"""``inference.GRPCInferenceService`` on grpc.aio. It only translates: every decision is
core's (``kiln.server.server.Server``), so gRPC and HTTP answer alike."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from google.protobuf import json_format

from kiln.core.errors import KilnError
from kiln.core.header_forward import header_forward
from kiln.core.stream import CLIENT_STREAM_WINDOW
from kiln.core.trace import FRONTEND, FrontendSlot, frontend_done, trace_context
from kiln.core.types import InferenceRequest, InferenceResponse
from kiln.frontends import shm_io
from kiln.frontends.grpc import grpc_service_pb2 as pb
from kiln.frontends.grpc.codec import decode_request, encode_response, parameters_to_dict
from kiln.frontends.grpc.errors import error_message, guarded
from kiln.frontends.grpc.shared_memory import Context, SharedMemoryRpcs
from kiln.frontends.tensors import OFF_LOOP_DECODE_BYTES, OFF_LOOP_ENCODE_ELEMENTS, python_elements
from kiln.server.server import Server

log = logging.getLogger(__name__)

#: Messages of one ModelStreamInfer call waiting for their client: at HIGH its requests'
#: tasks wait until the writer has brought them down to LOW (``_Outbox``).
OUTBOX_HIGH = 64
OUTBOX_LOW = 16
#: Requests of one ModelStreamInfer call running at once: beyond, the call stops reading
#: its stream, so the client is held by HTTP/2 flow control rather than the server
#: holding a task (and a request) for every message it sends.
STREAM_MAX_IN_FLIGHT = 1024


class _Outbox:
    """The messages of one ``ModelStreamInfer`` call on their way to the client.

    The writer takes a message only once the client's HTTP/2 window let the one before go
    (``h2.calls``), so a client that does not read fills this; at ``OUTBOX_HIGH`` the
    requests' tasks wait (and stop taking their models' responses, which pauses a Python
    model at ``CLIENT_STREAM_WINDOW``) until the writer has brought it down to
    ``OUTBOX_LOW``, rather than waking a task for every message the writer takes, as a full
    bounded ``asyncio.Queue`` would.
    """

    def __init__(self) -> None:
        self._queue: asyncio.Queue[pb.ModelStreamInferResponse | None] = asyncio.Queue()
        self._room = asyncio.Event()
        self._room.set()

    async def put(self, message: pb.ModelStreamInferResponse | None) -> None:
        self._queue.put_nowait(message)
        if self._queue.qsize() >= OUTBOX_HIGH:
            self._room.clear()
        await self._room.wait()  # returns at once while there is room

    def close(self) -> None:
        """The end (``None``) goes in whatever the count: the writer is still reading."""
        self._queue.put_nowait(None)

    async def get(self) -> pb.ModelStreamInferResponse | None:
        message = await self._queue.get()
        if not self._room.is_set() and self._queue.qsize() <= OUTBOX_LOW:
            self._room.set()
        return message


async def _encode(response: InferenceResponse) -> pb.ModelInferResponse:
    """``encode_response``, on a worker thread when its outputs hold more than
    ``OFF_LOOP_ENCODE_ELEMENTS`` BYTES elements (each costs Python work: 16 M of them held
    the event loop 3.9 s); other outputs are one copy each, done in place."""
    count = sum(python_elements(out.datatype, out.data) for out in response.outputs)
    if count > OFF_LOOP_ENCODE_ELEMENTS:
        return await asyncio.to_thread(encode_response, response)
    return encode_response(response)


def _parse(obj: Any, message: Any) -> Any:
    # Core speaks the HTTP JSON shapes; the proto field names are the same, so one parse
    # keeps both frontends reporting identical numbers.
    return json_format.ParseDict(obj, message, ignore_unknown_fields=True)


class InferenceServicer(SharedMemoryRpcs):
    def __init__(self, server: Server) -> None:
        self.server = server
        #: --grpc-header-forward-pattern (None: no metadata becomes a parameter)
        self.header_forward = header_forward(
            server.options.grpc_header_forward_pattern, "--grpc-header-forward-pattern"
        )

    # ---- health / metadata -----------------------------------------------------------
    @guarded
    async def ServerLive(self, request: pb.ServerLiveRequest, context: Context) -> Any:
        return pb.ServerLiveResponse(live=self.server.live)

    @guarded
    async def ServerReady(self, request: pb.ServerReadyRequest, context: Context) -> Any:
        return pb.ServerReadyResponse(ready=self.server.ready)

    @guarded
    async def ModelReady(self, request: pb.ModelReadyRequest, context: Context) -> Any:
        return pb.ModelReadyResponse(ready=self.server.model_ready(request.name, request.version))

    @guarded
    async def ServerMetadata(self, request: pb.ServerMetadataRequest, context: Context) -> Any:
        return _parse(self.server.metadata(), pb.ServerMetadataResponse())

    @guarded
    async def ModelMetadata(self, request: pb.ModelMetadataRequest, context: Context) -> Any:
        meta = self.server.model_metadata(request.name, request.version)
        return _parse(meta, pb.ModelMetadataResponse())

    @guarded
    async def ModelConfig(self, request: pb.ModelConfigRequest, context: Context) -> Any:
        runtime = self.server.model(request.name, request.version)
        return pb.ModelConfigResponse(config=runtime.config)

    @guarded
    async def ModelStatistics(self, request: pb.ModelStatisticsRequest, context: Context) -> Any:
        stats = self.server.statistics(request.name, request.version)
        return _parse(stats, pb.ModelStatisticsResponse())

    # ---- inference -------------------------------------------------------------------
    async def _decode(self, message: pb.ModelInferRequest) -> InferenceRequest:
        """As HTTP's ``infer_body``: typed contents and BYTES elements cost Python work
        each, so a big message decodes on a thread while other clients are answered."""
        limit = self.server.options.max_tensor_elements
        if message.ByteSize() > OFF_LOOP_DECODE_BYTES:
            return await asyncio.to_thread(decode_request, message, limit)
        return decode_request(message, limit)

    async def _infer(
        self, message: pb.ModelInferRequest, forwarded: dict[str, str] | None
    ) -> pb.ModelInferResponse:
        request = await self._decode(message)
        if forwarded:
            request.parameters.update(forwarded)
        response = await shm_io.infer(self.server, request)
        return await _encode(response)

    def _forwarded(self, context: Context) -> dict[str, str] | None:
        """The call's metadata ``--grpc-header-forward-pattern`` picks (request
        parameters); None without the pattern."""
        if self.header_forward is None:
            return None
        metadata = context.invocation_metadata() or ()
        return self.header_forward.select((k, v) for k, v in metadata if isinstance(v, str))

    @guarded
    async def ModelInfer(self, request: pb.ModelInferRequest, context: Context) -> Any:
        forwarded = self._forwarded(context)
        if not self.server.tracer.enabled:
            return await self._infer(request, forwarded)
        # Traced: GRPC_WAITREAD_* span decoding the message (it has arrived whole by
        # now), GRPC_SEND_* encoding the response (the transport writes it after).
        metadata = {k: v for k, v in context.invocation_metadata() or () if isinstance(v, str)}
        slot = FrontendSlot("GRPC", time.monotonic_ns(), carrier=trace_context(metadata))
        token = FRONTEND.set(slot)
        send_start = 0
        try:
            decoded = await self._decode(request)
            if forwarded:
                decoded.parameters.update(forwarded)
            slot.recv_end = time.monotonic_ns()
            response = await shm_io.infer(self.server, decoded)
            send_start = time.monotonic_ns()
            return await _encode(response)
        finally:
            FRONTEND.reset(token)
            frontend_done(slot, send_start or time.monotonic_ns())

    async def ModelStreamInfer(
        self, requests: AsyncIterator[pb.ModelInferRequest], context: Context
    ) -> AsyncIterator[pb.ModelStreamInferResponse]:
        """Every request runs as soon as it arrives; responses go back as they complete
        (a decoupled model's 0..N responses each as its own message). A failed request
        answers with ``error_message`` and the stream stays open."""
        done = _Outbox()  # a client that does not read holds the requests back
        running: set[asyncio.Task[None]] = set()
        forwarded = self._forwarded(context)  # the stream's metadata, for each request
        room = asyncio.Semaphore(STREAM_MAX_IN_FLIGHT)

        def finished(task: asyncio.Task[None]) -> None:
            running.discard(task)
            room.release()

        async def one(message: pb.ModelInferRequest) -> None:
            try:
                request = await self._decode(message)
                if forwarded:
                    request.parameters.update(forwarded)
                if self.server.is_decoupled(request.model_name, request.model_version):
                    # 0..N messages for this request, as the model sends them
                    stream = self.server.infer_stream(request, CLIENT_STREAM_WINDOW)
                    async for response in stream:
                        reply = await _encode(response)
                        await done.put(pb.ModelStreamInferResponse(infer_response=reply))
                    return
                response = await shm_io.infer(self.server, request)
                answer = pb.ModelStreamInferResponse(infer_response=await _encode(response))
            except Exception as exc:
                if not isinstance(exc, KilnError):
                    log.exception("gRPC stream request failed")
                # the id lets a client match the error to its request
                answer = pb.ModelStreamInferResponse(
                    error_message=error_message(exc),
                    infer_response=pb.ModelInferResponse(
                        model_name=message.model_name,
                        model_version=message.model_version,
                        id=message.id,
                    ),
                )
            await done.put(answer)

        async def read() -> None:
            try:
                async for message in requests:
                    await room.acquire()
                    task = asyncio.create_task(one(message))
                    running.add(task)
                    task.add_done_callback(finished)
                if running:
                    await asyncio.gather(*running)
            finally:
                done.close()

        reader = asyncio.create_task(read())
        try:
            while (answer := await done.get()) is not None:
                yield answer
            await reader  # re-raises a broken request stream
        finally:
            reader.cancel()
            for task in list(running):
                task.cancel()

    # ---- repository ------------------------------------------------------------------
    @guarded
    async def RepositoryIndex(self, request: pb.RepositoryIndexRequest, context: Context) -> Any:
        rows = self.server.repository_index(request.ready)
        return _parse({"models": rows}, pb.RepositoryIndexResponse())

    @guarded
    async def RepositoryModelLoad(
        self, request: pb.RepositoryModelLoadRequest, context: Context
    ) -> Any:
        params = parameters_to_dict(request.parameters)
        await self.server.load_model(request.model_name, params)
        return pb.RepositoryModelLoadResponse()

    @guarded
    async def RepositoryModelUnload(
        self, request: pb.RepositoryModelUnloadRequest, context: Context
    ) -> Any:
        params = parameters_to_dict(request.parameters)
        await self.server.unload_model(request.model_name, params)
        return pb.RepositoryModelUnloadResponse()

    # ---- trace / log settings --------------------------------------------------------
    @guarded
    async def TraceSetting(self, request: pb.TraceSettingRequest, context: Context) -> Any:
        updates = {key: list(value.value) for key, value in request.settings.items()}
        settings = self.server.trace_settings(request.model_name, updates)
        response = pb.TraceSettingResponse()
        for key, values in settings.items():
            response.settings[key].value.extend(values)
        return response

    @guarded
    async def LogSettings(self, request: pb.LogSettingsRequest, context: Context) -> Any:
        updates = parameters_to_dict(request.settings)
        logs = self.server.log_settings
        settings = logs.update(updates) if updates else logs.get()
        response = pb.LogSettingsResponse()
        for key, value in settings.items():
            entry = response.settings[key]
            if isinstance(value, bool):
                entry.bool_param = value
            elif isinstance(value, int):
                entry.uint32_param = value
            else:
                entry.string_param = str(value)
        return response
