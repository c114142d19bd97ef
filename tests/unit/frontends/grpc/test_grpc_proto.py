"""kiln's grpc_service.proto / health.proto match what tritonclient is generated from:
same messages, field names, numbers, types and labels, same RPCs. The wire matches on
numbers, so this is what byte compatibility rests on."""

from __future__ import annotations

from typing import Any

import pytest
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from tritonclient.grpc import model_config_pb2 as triton_config_pb2
from tritonclient.grpc import service_pb2 as triton_pb2

from kiln.config import model_config_pb2
from kiln.frontends.grpc import grpc_service_pb2, health_pb2
from kiln.frontends.grpc.services import HEALTH_DESCRIPTOR, INFERENCE_DESCRIPTOR, INFERENCE_SERVICE


def _shape(field: FieldDescriptor) -> tuple[Any, ...]:
    # Message/enum types compare by short name: the packages differ on purpose.
    sub = field.message_type.name if field.message_type else None
    enum = field.enum_type.name if field.enum_type else None
    oneof = field.containing_oneof.name if field.containing_oneof else None
    repeated = field.label == FieldDescriptor.LABEL_REPEATED
    return (field.number, field.type, repeated, sub, enum, oneof)


def _compare(ours: Descriptor, theirs: Descriptor, path: str) -> list[str]:
    problems = []
    our_fields = {f.name: f for f in ours.fields}
    for field in theirs.fields:
        mine = our_fields.get(field.name)
        if mine is None:
            problems.append(f"{path}.{field.name}: missing")
        elif _shape(mine) != _shape(field):
            problems.append(f"{path}.{field.name}: {_shape(mine)} != {_shape(field)}")
    extra = set(our_fields) - {f.name for f in theirs.fields}
    problems += [f"{path}.{name}: not in Triton's proto" for name in sorted(extra)]
    our_nested = {n.name: n for n in ours.nested_types}
    for nested in theirs.nested_types:
        if nested.name not in our_nested:
            problems.append(f"{path}.{nested.name}: nested message missing")
        else:
            problems += _compare(our_nested[nested.name], nested, f"{path}.{nested.name}")
    return problems


@pytest.mark.parametrize("name", sorted(triton_pb2.DESCRIPTOR.message_types_by_name))
def test_message_matches_triton(name: str) -> None:
    ours = grpc_service_pb2.DESCRIPTOR.message_types_by_name.get(name)
    assert ours is not None, f"message {name} missing from kiln's grpc_service.proto"
    theirs = triton_pb2.DESCRIPTOR.message_types_by_name[name]
    assert _compare(ours, theirs, name) == []


def test_service_methods_match_triton() -> None:
    theirs = triton_pb2.DESCRIPTOR.services_by_name["GRPCInferenceService"]
    assert theirs.full_name == INFERENCE_SERVICE

    def methods(service: Any) -> dict[str, tuple[str, str, bool, bool]]:
        return {
            m.name: (m.input_type.name, m.output_type.name, m.client_streaming, m.server_streaming)
            for m in service.methods
        }

    assert methods(INFERENCE_DESCRIPTOR) == methods(theirs)


def test_model_config_response_round_trips_through_tritonclient_types() -> None:
    config = model_config_pb2.ModelConfig(name="m", max_batch_size=8, backend="onnxruntime")
    config.input.add(name="x", data_type=model_config_pb2.TYPE_BF16, dims=[4, -1])
    wire = grpc_service_pb2.ModelConfigResponse(config=config).SerializeToString()
    parsed = triton_pb2.ModelConfigResponse.FromString(wire)
    assert parsed.config.name == "m"
    assert parsed.config.max_batch_size == 8
    assert parsed.config.input[0].data_type == triton_config_pb2.TYPE_BF16
    assert list(parsed.config.input[0].dims) == [4, -1]


def test_health_proto_uses_standard_numbers() -> None:
    status = health_pb2.HealthCheckResponse.ServingStatus
    assert (status.UNKNOWN, status.SERVING, status.NOT_SERVING, status.SERVICE_UNKNOWN) == (
        0,
        1,
        2,
        3,
    )
    assert [m.name for m in HEALTH_DESCRIPTOR.methods] == ["Check"]
    wire = health_pb2.HealthCheckResponse(status=status.SERVING).SerializeToString()
    assert wire == b"\x08\x01"  # field 1, varint 1: what every health client decodes
