"""gRPC adapter of :mod:`kiln.core.access`: a server interceptor in front of every RPC.

Refusals follow Triton: a restricted protocol answers UNAVAILABLE with Triton's message
(header ``triton-grpc-protocol-<key>``); a missing or wrong API key answers UNAUTHENTICATED.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import grpc

from kiln.core.access import AccessPolicy, ApiGroup, Denial
from kiln.frontends.grpc.services import HEALTH_SERVICE, INFERENCE_SERVICE

# Triton's prefix of restricted-protocol metadata keys.
GRPC_HEADER_PREFIX = "triton-grpc-protocol-"

_GROUPS: dict[str, ApiGroup] = {
    "ServerLive": ApiGroup.HEALTH,
    "ServerReady": ApiGroup.HEALTH,
    "ModelReady": ApiGroup.HEALTH,
    "ServerMetadata": ApiGroup.METADATA,
    "ModelMetadata": ApiGroup.METADATA,
    "ModelInfer": ApiGroup.INFERENCE,
    "ModelStreamInfer": ApiGroup.INFERENCE,
    "ModelConfig": ApiGroup.MODEL_CONFIG,
    "ModelStatistics": ApiGroup.STATISTICS,
    "RepositoryIndex": ApiGroup.MODEL_REPOSITORY,
    "RepositoryModelLoad": ApiGroup.MODEL_REPOSITORY,
    "RepositoryModelUnload": ApiGroup.MODEL_REPOSITORY,
    "SystemSharedMemoryStatus": ApiGroup.SHARED_MEMORY,
    "SystemSharedMemoryRegister": ApiGroup.SHARED_MEMORY,
    "SystemSharedMemoryUnregister": ApiGroup.SHARED_MEMORY,
    "CudaSharedMemoryStatus": ApiGroup.SHARED_MEMORY,
    "CudaSharedMemoryRegister": ApiGroup.SHARED_MEMORY,
    "CudaSharedMemoryUnregister": ApiGroup.SHARED_MEMORY,
    "TraceSetting": ApiGroup.TRACE,
    "LogSettings": ApiGroup.LOGGING,
}


def rpc_group(method: str) -> ApiGroup:
    """``/inference.GRPCInferenceService/ModelInfer`` -> INFERENCE; unknown: METADATA."""
    service, _, name = method.lstrip("/").partition("/")
    if service == HEALTH_SERVICE:
        return ApiGroup.HEALTH
    if service == INFERENCE_SERVICE:
        return _GROUPS.get(name, ApiGroup.METADATA)
    return ApiGroup.METADATA


def _deny_handler(handler: grpc.RpcMethodHandler, denial: Denial) -> grpc.RpcMethodHandler:
    code = (
        grpc.StatusCode.UNAUTHENTICATED
        if denial.kind == "unauthenticated"
        else grpc.StatusCode.UNAVAILABLE
    )

    async def deny(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        await context.abort(code, denial.message)

    # The refusal must have the same streaming shape as the method it replaces.
    kinds: dict[tuple[bool, bool], Callable[..., grpc.RpcMethodHandler]] = {
        (False, False): grpc.unary_unary_rpc_method_handler,
        (False, True): grpc.unary_stream_rpc_method_handler,
        (True, False): grpc.stream_unary_rpc_method_handler,
        (True, True): grpc.stream_stream_rpc_method_handler,
    }
    make = kinds[(handler.request_streaming, handler.response_streaming)]
    return make(
        deny,
        request_deserializer=handler.request_deserializer,
        response_serializer=handler.response_serializer,
    )


class AccessInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    def __init__(self, policy: AccessPolicy) -> None:
        self.policy = policy

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None:  # unknown method: gRPC answers UNIMPLEMENTED itself
            return handler
        metadata: dict[str, str] = {}
        for key, value in handler_call_details.invocation_metadata or ():
            if isinstance(value, str):  # binary (-bin) metadata never carries credentials
                metadata[key.lower()] = value
        denial = self.policy.check(rpc_group(handler_call_details.method), metadata.get)
        return handler if denial is None else _deny_handler(handler, denial)
