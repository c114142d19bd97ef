"""A service's methods as :class:`~kiln.frontends.grpc.h2.calls.Route` s, from kiln's
descriptors, under the public wire name (see :mod:`kiln.frontends.grpc.services`)."""

from __future__ import annotations

from google.protobuf.descriptor import ServiceDescriptor
from google.protobuf.message_factory import GetMessageClass

from kiln.frontends.grpc.access import rpc_group
from kiln.frontends.grpc.h2.calls import Route


def service_routes(descriptor: ServiceDescriptor, wire_name: str, servicer: object) -> list[Route]:
    routes = []
    for method in descriptor.methods:
        path = f"/{wire_name}/{method.name}"
        routes.append(
            Route(
                path=path.encode(),
                handler=getattr(servicer, method.name),
                decode=GetMessageClass(method.input_type).FromString,
                encode=GetMessageClass(method.output_type).SerializeToString,
                client_streaming=method.client_streaming,
                server_streaming=method.server_streaming,
                group=rpc_group(path),
            )
        )
    return routes
