"""The gRPC listener: Triton's inference service and the standard health service, on the
event loop that also runs HTTP.

Two implementations serve the same servicers: kiln's own HTTP/2 + gRPC protocol
(``kiln``, the default; :mod:`kiln.frontends.grpc.h2`), and grpcio's ``grpc.aio``
(``grpcio``), kept for a client that meets an interoperability problem with the first.
"""

from __future__ import annotations

from typing import Protocol, cast

from kiln.core.access import AccessPolicy
from kiln.frontends.grpc.health import HealthServicer
from kiln.frontends.grpc.servicer import InferenceServicer
from kiln.frontends.grpc.services import (
    HEALTH_DESCRIPTOR,
    HEALTH_SERVICE,
    INFERENCE_DESCRIPTOR,
    INFERENCE_SERVICE,
)
from kiln.security import DEFAULT_MAX_INPUT_BYTES, GrpcTls
from kiln.server.server import Server

# One default with HTTP's --http-max-input-size for both directions (gRPC's 4 MiB default
# is far too small for tensors; Triton's 2 GiB lets one message hold that much memory).
MAX_MESSAGE_BYTES = DEFAULT_MAX_INPUT_BYTES


class GrpcListener(Protocol):
    async def stop(self, grace: float | None) -> None: ...


async def start_grpc(
    server: Server,
    host: str,
    port: int,
    max_message_bytes: int = MAX_MESSAGE_BYTES,
    access: AccessPolicy | None = None,
    tls: GrpcTls | None = None,
    implementation: str = "kiln",
    idle_timeout: float = 300.0,
    header_timeout: float = 30.0,
) -> GrpcListener:
    """Listen on ``host:port``; a port in use raises OSError. ``idle_timeout``: close
    connections without a stream for this long (0: never); ``header_timeout``: a header
    block must be complete within this long (kiln's transport only)."""
    if implementation == "grpcio":
        return await _start_grpcio(server, host, port, max_message_bytes, access, tls, idle_timeout)
    if implementation != "kiln":
        raise ValueError(f"unknown gRPC implementation '{implementation}'")
    from kiln.frontends.grpc.h2.connection import Limits
    from kiln.frontends.grpc.h2.dispatch import Dispatcher
    from kiln.frontends.grpc.h2.transport import H2GrpcServer
    from kiln.frontends.grpc.routes import service_routes

    routes = [
        *service_routes(INFERENCE_DESCRIPTOR, INFERENCE_SERVICE, InferenceServicer(server)),
        *service_routes(HEALTH_DESCRIPTOR, HEALTH_SERVICE, HealthServicer(server)),
    ]
    listener = H2GrpcServer(
        Dispatcher(routes, max_message_bytes, access),
        tls.ssl_context() if tls is not None else None,
        Limits(header_timeout=header_timeout, idle_timeout=idle_timeout),
    )
    await listener.start(host, port)
    return listener


async def _start_grpcio(
    server: Server,
    host: str,
    port: int,
    max_message_bytes: int,
    access: AccessPolicy | None,
    tls: GrpcTls | None,
    idle_timeout: float,
) -> GrpcListener:
    import grpc

    from kiln.frontends.grpc.access import AccessInterceptor
    from kiln.frontends.grpc.services import generic_handler

    interceptors = [AccessInterceptor(access)] if access is not None and access.enabled else []
    idle = [("grpc.max_connection_idle_ms", int(idle_timeout * 1000))] if idle_timeout > 0 else []
    grpc_server = grpc.aio.server(
        interceptors=interceptors,
        options=[
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.max_send_message_length", max_message_bytes),
            # Without this a second server could bind the same port and steal half the calls.
            ("grpc.so_reuseport", 0),
            *idle,
        ],
    )
    grpc_server.add_generic_rpc_handlers(
        (
            generic_handler(INFERENCE_DESCRIPTOR, INFERENCE_SERVICE, InferenceServicer(server)),
            generic_handler(HEALTH_DESCRIPTOR, HEALTH_SERVICE, HealthServicer(server)),
        )
    )
    address = f"{host}:{port}"
    if tls is not None:
        bound = grpc_server.add_secure_port(address, tls.credentials())
    else:
        bound = grpc_server.add_insecure_port(address)
    if bound == 0:
        raise OSError(f"gRPC: unable to bind {host}:{port}")
    await grpc_server.start()
    return cast("GrpcListener", grpc_server)
