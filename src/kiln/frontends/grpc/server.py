"""gRPC listener. Until the KServe v2 gRPC service lands every RPC answers UNIMPLEMENTED."""

from __future__ import annotations

import grpc

from kiln.core.server import Server


async def start_grpc(server: Server, host: str, port: int) -> grpc.aio.Server:
    grpc_server = grpc.aio.server()
    bound = grpc_server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise OSError(f"gRPC: unable to bind {host}:{port}")
    await grpc_server.start()
    return grpc_server
