"""``grpc.health.v1.Health/Check``: SERVING while kiln is ready (what a Kubernetes gRPC
probe needs), NOT_SERVING while it loads models or drains."""

from __future__ import annotations

from typing import Any

import grpc

from kiln.frontends.grpc import health_pb2
from kiln.frontends.grpc.services import HEALTH_SERVICE, INFERENCE_SERVICE
from kiln.server.server import Server

Status = health_pb2.HealthCheckResponse.ServingStatus


class HealthServicer:
    def __init__(self, server: Server) -> None:
        self.server = server

    async def Check(
        self, request: health_pb2.HealthCheckRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> health_pb2.HealthCheckResponse:
        if request.service not in ("", INFERENCE_SERVICE, HEALTH_SERVICE):
            await context.abort(grpc.StatusCode.NOT_FOUND, f"unknown service '{request.service}'")
        status = Status.SERVING if self.server.ready else Status.NOT_SERVING
        return health_pb2.HealthCheckResponse(status=status)
