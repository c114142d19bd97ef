"""Services under their public wire names, built from kiln's own descriptors.

kiln's protos live in ``kiln.*`` packages so they can share a process with tritonclient
and grpcio-health-checking (both register ``inference.*`` / ``grpc.health.v1.*`` in the
global descriptor pool). gRPC routes on the path string only, so registering the handlers
as ``/inference.GRPCInferenceService/<Method>`` makes kiln byte-for-byte Triton's service;
no ``*_pb2_grpc`` stubs are generated (they would use the ``kiln.`` paths).
"""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import grpc
from google.protobuf.descriptor import ServiceDescriptor
from google.protobuf.message_factory import GetMessageClass

from kiln.frontends.grpc import grpc_service_pb2, health_pb2

INFERENCE_SERVICE = "inference.GRPCInferenceService"
HEALTH_SERVICE = "grpc.health.v1.Health"

INFERENCE_DESCRIPTOR: ServiceDescriptor = grpc_service_pb2.DESCRIPTOR.services_by_name[
    "GRPCInferenceService"
]
HEALTH_DESCRIPTOR: ServiceDescriptor = health_pb2.DESCRIPTOR.services_by_name["Health"]

_SERVER_KINDS: dict[tuple[bool, bool], Callable[..., grpc.RpcMethodHandler]] = {
    (False, False): grpc.unary_unary_rpc_method_handler,
    (False, True): grpc.unary_stream_rpc_method_handler,
    (True, False): grpc.stream_unary_rpc_method_handler,
    (True, True): grpc.stream_stream_rpc_method_handler,
}


def generic_handler(
    descriptor: ServiceDescriptor, wire_name: str, servicer: object
) -> grpc.GenericRpcHandler:
    """One handler per method of ``descriptor``, taken from ``servicer``'s same-named method."""
    handlers = {}
    for method in descriptor.methods:
        request = GetMessageClass(method.input_type)
        response = GetMessageClass(method.output_type)
        factory = _SERVER_KINDS[(method.client_streaming, method.server_streaming)]
        handlers[method.name] = factory(
            getattr(servicer, method.name),
            request_deserializer=request.FromString,
            response_serializer=response.SerializeToString,
        )
    return grpc.method_handlers_generic_handler(wire_name, handlers)


def stub(channel: Any, descriptor: ServiceDescriptor, wire_name: str) -> SimpleNamespace:
    """A client stub (sync or aio channel) calling ``/<wire_name>/<Method>``."""
    calls = {}
    for method in descriptor.methods:
        request = GetMessageClass(method.input_type)
        response = GetMessageClass(method.output_type)
        if method.client_streaming and method.server_streaming:
            make = channel.stream_stream
        elif method.client_streaming:
            make = channel.stream_unary
        elif method.server_streaming:
            make = channel.unary_stream
        else:
            make = channel.unary_unary
        calls[method.name] = make(
            f"/{wire_name}/{method.name}",
            request_serializer=request.SerializeToString,
            response_deserializer=response.FromString,
        )
    return SimpleNamespace(**calls)


def inference_stub(channel: Any) -> SimpleNamespace:
    return stub(channel, INFERENCE_DESCRIPTOR, INFERENCE_SERVICE)


def health_stub(channel: Any) -> SimpleNamespace:
    return stub(channel, HEALTH_DESCRIPTOR, HEALTH_SERVICE)
